"""`GradSyncStage`: a `PipelineStage` that chooses when FSDP2 reduces gradients over a step's microbatches.

torch's `PipelineStage` runs the backward of every microbatch without gradient sync when the stage module itself is
an FSDP2 module and reduce-scatters once after the last microbatch; FSDP2 modules nested below a plain stage module
are left alone, so each of them reduces after every microbatch's backward. Two choices per stage change that:

- `reduce_grad_per_microbatch`: an FSDP2 stage module reduce-scatters after every microbatch's backward (each
  backward is a complete FSDP2 backward), so unsharded gradients are freed per microbatch (lower peak memory, one
  reduction per microbatch). Sums of reduced gradients equal the reduction of summed gradients: same result.
- `cover_nested_fsdp`: the stage's choice also applies to the outermost FSDP2 modules below a stage module that is
  not one (e.g. experts or blocks sharded on their own): deferred, they accumulate unsharded gradients and reduce
  once after the last microbatch (`perform_reduce_grad`); per microbatch, they are made to sync every backward.

What it must not do: change anything when both choices are off (then it is torch's stage; `build_stages` builds
plain `PipelineStage`s), bind methods onto instances, or reach torch pipelining internals other than via `_compat`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from . import _compat

__all__ = ["GradSyncStage", "outermost_fsdp_modules"]


def outermost_fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """The FSDP2 modules in `module` (itself included) that no other FSDP2 module in it contains, in module order."""
    found: list[FSDPModule] = []
    seen: set[int] = set()
    pending = [module]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, FSDPModule):
            found.append(current)
        else:
            pending[0:0] = list(current.children())  # depth-first, so the order is the modules' order
    return found


class GradSyncStage(PipelineStage):
    """A `PipelineStage` with the two gradient-reduction choices of the module docstring (keyword-only, both False
    = torch's behaviour). The stage module may be replaced after construction (`pipeline_model` parallelizes after
    building); the choices apply to whatever `submod` is at backward time.

    Raises (at backward): RuntimeError for `reduce_grad_per_microbatch` with a split (input / weight) backward;
    `build_schedule` refuses such schedules before any step.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        *,
        group: Any = None,
        reduce_grad_per_microbatch: bool = False,
        cover_nested_fsdp: bool = False,
    ) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self.reduce_grad_per_microbatch = reduce_grad_per_microbatch
        self.cover_nested_fsdp = cover_nested_fsdp
        self._deferred_nested: list[FSDPModule] = []  # nested FSDP2 roots whose reduction waits for the last one
        self._reduced_in_backward = False  # per-microbatch root: "started", nothing left to reduce, wait pending

    def _root_reduces_per_microbatch(self) -> bool:
        return self.reduce_grad_per_microbatch and isinstance(self.submod, FSDPModule)

    def _nested_fsdp(self) -> list[FSDPModule]:
        if not self.cover_nested_fsdp or isinstance(self.submod, FSDPModule):
            return []  # an FSDP2 stage module covers its nested FSDP2 modules itself (recursive settings)
        return outermost_fsdp_modules(self.submod)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        if self._root_reduces_per_microbatch():
            if backward_type != "full":
                raise RuntimeError(
                    f"reduce_grad_per_microbatch=True needs one full backward per microbatch, but the schedule runs "
                    f"a {backward_type!r} backward; use GPipe, 1F1B, Interleaved1F1B or LoopedBFS, or defer the "
                    "reduction (reduce_grad_per_microbatch=False)."
                )
            root: Any = self.submod
            # Automatic finalization: FSDP2's end-of-backward callback reduce-scatters every group and waits, also
            # groups whose inputs need no gradient (the first stage's), whose hooks only that callback runs.
            # torch's forward switched manual finalization on; the mode latches at the first backward hook.
            root.set_manual_backward_finalization(False)
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(last_backward)  # keep parameters gathered until the last microbatch
            return _compat.full_stage_backward(bwd_kwargs), None
        for module in self._nested_fsdp():
            if self.reduce_grad_per_microbatch:
                module.set_requires_gradient_sync(True)
                continue
            if not any(module is deferred for deferred in self._deferred_nested):
                module.set_manual_backward_finalization(True)  # before its first backward hook of this step
                self._deferred_nested.append(module)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # One reduction per deferred nested FSDP2 root, in module order (the same on every data-parallel rank),
        # before torch's scaling of the stage's gradients.
        for module in self._deferred_nested:
            module.set_requires_gradient_sync(True)
            module.set_reshard_after_backward(True)
            module.finalize_backward()
            module.set_manual_backward_finalization(False)
        self._deferred_nested.clear()
        super().perform_reduce_grad(grad_scale_factor)

    def start_gradient_reduction(self) -> None:
        if not self._root_reduces_per_microbatch():
            super().start_gradient_reduction()
            return
        if self._reduced_in_backward:
            raise RuntimeError("A gradient reduction is already pending")
        self._reduced_in_backward = True  # every microbatch's backward already reduced its gradients

    def wait_for_gradient_reduction(self, grad_scale_factor: int) -> None:
        if not self._root_reduces_per_microbatch():
            super().wait_for_gradient_reduction(grad_scale_factor)
            return
        if not self._reduced_in_backward:
            raise RuntimeError("No gradient reduction is pending")
        self._reduced_in_backward = False
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)
