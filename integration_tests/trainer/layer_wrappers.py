"""Per-layer activation checkpointing and torch.compile: `--activation-checkpointing`, `--compile`.

What it is for: applying both to each decoder layer of a model part (am-pipelining's `find_layers`, so a pipeline
stage wraps the layers it holds), after the pipeline split and before FSDP2 (torchtitan's order). Both keep every
parameter name and state-dict key (no wrapper module is inserted, no `forward` is rebound), so checkpoints, the fp32
rules and FSDP2 groups see the same model:
  - activation checkpointing is torch's composable, hook-based non-reentrant checkpoint
    (`torch.distributed._composable.checkpoint`: a forward pre-hook opens the checkpoint region, a forward hook
    closes it; the layer is recomputed through its own `__call__` in backward, where FSDP2's pre-forward is a no-op
    and its pre-backward hook has gathered the parameters). The loss and gradients are unchanged;
  - compile is `nn.Module.compile()` in place (the layer's call, hooks included, is compiled on first use).
Recomputation runs the WHOLE layer (early stop off): every collective inside it (the MoE all-to-all, a sequence aux
loss's all-reduce, ring attention) is re-issued in the forward's order on every rank, whatever tensors a rank needs.
Counters that must see each forward once (am-moe's expert load, bias-update counts, aux-loss sums) skip the
recomputed forward themselves.
Whether a model may be checkpointed is am-capabilities' rule (`ModelSupports.supports_gradient_checkpointing`: the
class's declaration): `activation_checkpointing_problems` asks it before any collective.
What it must not do: wrap anything but decoder layers, or decide support itself.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.contract import _get_registry

from am_pipelining import find_layers


def activation_checkpointing_problems(model: nn.Module, *, mesh: Any, compile: bool = False) -> list[str]:
    """Why `--activation-checkpointing` cannot run on `model` under `mesh` (am-capabilities' rule) or together with
    `--compile` (`compile`); [] = it can."""
    from am_capabilities import ModelSupports

    problems = []
    if not ModelSupports(model, mesh).supports_gradient_checkpointing:
        problems.append(
            f"--activation-checkpointing: {type(model).__name__} does not support gradient checkpointing "
            "(am-capabilities: its class does not declare supports_gradient_checkpointing = True); drop the option"
        )
    if compile:
        # Measured with torch 2.15 on the CPU: a layer compiled under the hook-based checkpoint recomputes through a
        # different compiled graph, whose saved tensors do not match the forward's (torch's CheckpointError,
        # pytorch/pytorch#166926), so backward fails.
        problems.append(
            "--activation-checkpointing with --compile: torch cannot compile a layer under the hook-based checkpoint "
            "(the recomputed tensors differ from the forward's, pytorch/pytorch#166926); drop one of the two options"
        )
    return problems


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Checkpoint every decoder layer of `model` (idempotent); returns the number of layers checkpointed.

    Non-reentrant (keyword arguments, stage inputs that need no grad and `autograd.grad` on the inputs, how pipeline
    stages run backward, all work), RNG state preserved, early stop off (see the module docstring).
    """
    layers = find_layers(model).layers
    for layer in layers:
        if not is_activation_checkpointed(layer):
            checkpoint(layer, preserve_rng_state=True, early_stop=False)
    return len(layers)


def is_activation_checkpointed(layer: nn.Module) -> bool:
    return "checkpoint" in (_get_registry(layer) or {})


def apply_compile(model: nn.Module) -> int:
    """torch.compile every decoder layer of `model` in place; returns the number of layers compiled."""
    layers = find_layers(model).layers
    for layer in layers:
        layer.compile()
    return len(layers)


def is_compiled(layer: nn.Module) -> bool:
    return getattr(layer, "_compiled_call_impl", None) is not None


__all__ = [
    "activation_checkpointing_problems",
    "apply_activation_checkpointing",
    "apply_compile",
    "is_activation_checkpointed",
    "is_compiled",
]
