"""Per-layer activation checkpointing and torch.compile: `--activation-checkpointing`, `--compile`.

What it is for: applying both to each decoder layer of a model part (am-pipelining's `find_layers`, so a pipeline
stage wraps the layers it holds), after the pipeline split and before FSDP2 (torchtitan's order). Both keep every
parameter name (no wrapper module is inserted), so checkpoints, the fp32 rules and FSDP2 groups see the same model:
  - activation checkpointing replaces a layer's `forward` by a non-reentrant `torch.utils.checkpoint` of the original
    (activations inside the layer are recomputed in backward; the loss and gradients are unchanged);
  - compile is `nn.Module.compile()` in place (the layer's call, hooks included, is compiled on first use).
Whether a model may be checkpointed is am-capabilities' rule (`ModelSupports.supports_gradient_checkpointing`, which
also refuses it under expert parallelism): `activation_checkpointing_problems` asks it before any collective.
What it must not do: wrap anything but decoder layers, or decide support itself.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from am_pipelining import find_layers

_CHECKPOINTED = "_am_activation_checkpointed"


def activation_checkpointing_problems(model: nn.Module, *, mesh: Any) -> list[str]:
    """Why `--activation-checkpointing` cannot run on `model` under `mesh` (am-capabilities' rule); [] = it can."""
    from am_capabilities import ModelSupports

    if ModelSupports(model, mesh).supports_gradient_checkpointing:
        return []
    return [
        f"--activation-checkpointing: {type(model).__name__} does not support gradient checkpointing "
        "(am-capabilities: supports_gradient_checkpointing is False for this model and mesh); drop the option"
    ]


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Non-reentrant: works with keyword arguments, with inputs that need no grad (a pipeline stage's received
    # activations do) and with autograd.grad on the inputs (how pipeline stages run backward).
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Checkpoint every decoder layer of `model` (idempotent); returns the number of layers wrapped."""
    layers = find_layers(model).layers
    for layer in layers:
        if getattr(layer, _CHECKPOINTED, False):
            continue
        layer.forward = functools.partial(_checkpointed_forward, layer.forward)
        setattr(layer, _CHECKPOINTED, True)
    return len(layers)


def is_activation_checkpointed(layer: nn.Module) -> bool:
    return bool(getattr(layer, _CHECKPOINTED, False))


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
