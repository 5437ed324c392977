"""FSDP2 gradient accumulation without a reduce-scatter per micro-batch (`BackendConfig.enable_fsdp_optimizations`).

What it is for: NeMo AutoModel's MoE FSDP optimization, as its `MoEFSDPSyncMixin` documents it: without pipeline
parallelism, `prepare_for_grad_accumulation(model)` before the first backward of an optimizer step defers every
FSDP unit's gradient reduce-scatter and resharding (unsharded gradients accumulate locally), and
`prepare_for_final_backward(model)` before the last backward turns both back on, so the last backward reduce-scatters
the accumulated gradients once. The gradients after the step equal those of plain FSDP2 accumulation; the
communication is one reduce-scatter per step instead of one per micro-batch, at the cost of keeping unsharded
parameters and gradients between micro-batches. With pipeline parallelism torch's schedules already defer the
sync to the last micro-batch (am-pipelining), so both calls are no-ops there (`pp_enabled=True`).
What it must not do: touch modules that are not FSDP units, run a collective, or change a model without FSDP.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["fsdp_units", "prepare_for_final_backward", "prepare_for_grad_accumulation"]


def fsdp_units(model: nn.Module) -> Iterator[FSDPModule]:
    """Every module of `model` (itself included) that `fully_shard` made an FSDP unit, in module order."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            yield module


def _configure(model: nn.Module, *, final: bool) -> int:
    count = 0
    for unit in fsdp_units(model):
        # recurse=False: each unit is visited itself; a recursive call would reset the units below it again.
        unit.set_requires_gradient_sync(final, recurse=False)
        unit.set_reshard_after_backward(final, recurse=False)
        unit.set_is_last_backward(final)
        count += 1
    return count


def prepare_for_grad_accumulation(model: nn.Module, *, pp_enabled: bool = False) -> int:
    """Before the first backward of an optimizer step: no reduce-scatter and no resharding after the backwards that
    follow, until `prepare_for_final_backward`. Returns the FSDP units configured (0 with `pp_enabled` or no FSDP)."""
    return 0 if pp_enabled else _configure(model, final=False)


def prepare_for_final_backward(model: nn.Module, *, pp_enabled: bool = False) -> int:
    """Before the last backward of an optimizer step: that backward reduce-scatters the accumulated gradients and
    reshards, as plain FSDP2 does. Returns the FSDP units configured (0 with `pp_enabled` or no FSDP)."""
    return 0 if pp_enabled else _configure(model, final=True)
