"""The one place that touches private internals of `torch.distributed.pipelining` and torch's checkpoint wrapper.

torch renames and reshapes these internals between releases (static stage metadata lives in `_user_meta` since
2.12; schedule action lists live in `pipeline_order`). Written for the declared floor (torch >= 2.13) and checked
against 2.13 and 2.15; an internal that a future torch drops is reported as a clear error here, so a torch upgrade
touches this file only. Nothing else in the package may import a private torch pipelining name. This module must not
import transformers.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import schedules as _schedules

__all__ = [
    "ComputeAction",
    "SCHEDULE_NAMES",
    "get_schedule_class",
    "is_schedule_class",
    "is_multi_stage_schedule",
    "schedule_class_name",
    "schedule_compute_actions",
    "schedule_stage_to_rank",
    "load_schedule_csv",
    "runtime_schedule_class",
    "kwargs_chunk_spec_override",
    "replicate_chunk_spec",
    "reset_stage_shapes",
    "preserve_grads_across_stage_reinit",
    "set_stage_metas",
    "has_static_meta_api",
    "is_reentrant_checkpoint_wrapper",
    "full_stage_backward",
    "fsdp_finalization_problem",
]

ComputeAction = tuple[int, str, int]
"""(stage_index, kind, microbatch_index) with kind one of "F", "B", "I", "W"."""

_COMPUTE_KINDS = ("F", "B", "I", "W")


SCHEDULE_NAMES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
"""The runnable schedules torch's `get_schedule_class` knows (it also maps the abstract base classes)."""


def get_schedule_class(name: str) -> type:
    """Map a schedule name (case-insensitive, e.g. "1f1b", "interleaved1f1b") to torch's schedule class."""
    return _schedules.get_schedule_class(name)


def is_schedule_class(candidate: type) -> bool:
    """True for torch pipeline schedule classes (single- or multi-stage)."""
    return issubclass(candidate, (_schedules.PipelineScheduleSingle, _schedules.PipelineScheduleMulti))


def is_multi_stage_schedule(schedule_class: type) -> bool:
    """True for schedules that take a list of stages (several virtual stages per rank)."""
    return issubclass(schedule_class, _schedules.PipelineScheduleMulti)


def runtime_schedule_class() -> type:
    """The class that runs a schedule loaded from a CSV file."""
    return _schedules._PipelineScheduleRuntime


def load_schedule_csv(schedule: Any, path: str) -> None:
    """Load a compute-only CSV schedule (one row per rank, actions like `0F1`) into a runtime schedule."""
    schedule._load_csv(path)


def schedule_class_name(schedule_class: type) -> str:
    """Short name of a schedule class as `get_schedule_class` accepts it ("ScheduleGPipe" -> "GPipe")."""
    name = schedule_class.__name__
    return name[len("Schedule") :] if name.startswith("Schedule") else name


# --------------------------------------------------------------------------------------------------------------
# Schedule action lists (for the schedule picture)
# --------------------------------------------------------------------------------------------------------------


def _flatten_action(action: Any) -> Iterator[ComputeAction]:
    """Yield the compute actions inside one torch `_Action` (OVERLAP_F_B holds sub-actions)."""
    if action is None:
        return
    sub_actions = getattr(action, "sub_actions", None)
    if sub_actions:
        for sub in sub_actions:
            yield from _flatten_action(sub)
        return
    kind = getattr(action.computation_type, "value", str(action.computation_type))
    if kind in _COMPUTE_KINDS and action.microbatch_index is not None:
        yield (int(action.stage_index), kind, int(action.microbatch_index))


def _order_to_compute_actions(order: dict[int, list[Any]]) -> dict[int, list[ComputeAction]]:
    return {rank: [a for action in actions for a in _flatten_action(action)] for rank, actions in order.items()}


class _StandInStage:
    """The few attributes a schedule constructor reads from its stages; lets us ask torch for its action lists
    without a process group."""

    def __init__(self, *, num_stages: int, group_size: int) -> None:
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.submod = None
        self.stage_index = 0
        self.is_first = True
        self.is_last = False
        self.has_backward = True
        self.stage_index_to_group_rank: dict[int, int] = {}


def schedule_compute_actions(
    schedule: Any, *, pp_size: int, n_microbatches: int, stages_per_rank: int
) -> dict[int, list[ComputeAction]]:
    """Compute actions per rank, in torch's own order, for a schedule name/class or a built schedule instance.

    Returns an empty dict when this torch cannot tell (the caller falls back to its own textbook order).
    """
    order = getattr(schedule, "pipeline_order", None) if not isinstance(schedule, (str, type)) else None
    if not isinstance(order, dict) or not order:  # a name, a class, or no order kept: ask a stand-in instance
        schedule_class = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
        if not isinstance(schedule_class, type):
            schedule_class = type(schedule)
        num_stages = pp_size * stages_per_rank
        stand_ins = [_StandInStage(num_stages=num_stages, group_size=pp_size) for _ in range(stages_per_rank)]
        try:
            multi = is_multi_stage_schedule(schedule_class)
            instance = schedule_class(stand_ins if multi else stand_ins[0], n_microbatches)
            order = getattr(instance, "pipeline_order", None)
        # ValueError: torch refuses fewer microbatches than the schedule needs (1F1B, DualPipeV); AttributeError /
        # TypeError: a torch whose constructor reads more of a stage than the stand-in offers. Either way: no list.
        except (ValueError, AttributeError, TypeError):
            order = None
    return _order_to_compute_actions(order) if isinstance(order, dict) and order else {}


def schedule_stage_to_rank(schedule: Any) -> dict[int, int] | None:
    """The stage -> rank map a built multi-stage schedule uses (None when the schedule does not expose one)."""
    mapping = getattr(schedule, "stage_index_to_group_rank", None)
    return dict(mapping) if isinstance(mapping, dict) else None


# --------------------------------------------------------------------------------------------------------------
# Schedule state
# --------------------------------------------------------------------------------------------------------------


@contextmanager
def kwargs_chunk_spec_override(schedule: Any, spec: dict[str, Any] | None) -> Iterator[None]:
    """Temporarily set the schedule's keyword-argument chunking spec; restore the old one even on errors."""
    if spec is None or not hasattr(schedule, "_kwargs_chunk_spec"):
        yield
        return
    previous = schedule._kwargs_chunk_spec
    schedule._kwargs_chunk_spec = spec
    try:
        yield
    finally:
        schedule._kwargs_chunk_spec = previous


def replicate_chunk_spec() -> Any:
    """The chunk spec that hands every microbatch the whole value (for non-tensor keyword arguments)."""
    from torch.distributed.pipelining import microbatch as _microbatch

    return getattr(_microbatch, "_Replicate", None)


def has_static_meta_api(stage: Any) -> bool:
    """True when this torch's `stage` takes static input/output metadata (`_user_meta`)."""
    return hasattr(getattr(stage, "_user_meta", None), "inputs")


def set_stage_metas(stage: Any, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
    """Give one stage static input/output metadata (meta tensors); clears its gradient metadata.

    Raises:
        RuntimeError: when this torch's stages expose no known metadata API.
    """
    from torch.distributed.pipelining._utils import extract_tensor_metas

    if not has_static_meta_api(stage):
        raise RuntimeError(
            f"Unsupported PipelineStage metadata API: {type(stage).__name__} exposes no known static-metadata API "
            f"in torch {torch.__version__}; update am_pipelining._compat.set_stage_metas for this torch."
        )
    user_meta = stage._user_meta
    user_meta.inputs = extract_tensor_metas(inputs)
    user_meta.outputs = extract_tensor_metas(outputs)
    user_meta.input_grads = None
    user_meta.output_grads = None


def reset_stage_shapes(schedule: Any, stages: list[Any]) -> None:
    """Forget what each stage inferred or sent for its old shapes and make the schedule re-run its setup on the next
    step (after `set_stage_metas` gave the stages their new shapes)."""
    for stage in stages:
        stage_meta = getattr(stage, "_stage_meta", None)
        if stage_meta is not None:
            for field in ("inputs", "outputs", "input_grads", "output_grads"):
                if hasattr(stage_meta, field):
                    setattr(stage_meta, field, None)
        for field in ("_fwd_outputs_for_bwd_meta", "_fwd_inputs_for_bwd_meta", "_fwd_kwargs_tensors_for_bwd_meta"):
            if hasattr(stage, field):
                setattr(stage, field, None)
        if hasattr(stage, "_inference_mode"):
            stage._inference_mode = None
        for field, empty in (("args_recv_info", {}), ("grad_recv_info", {}), ("grad_send_info", None)):
            if hasattr(stage, field):
                setattr(stage, field, type(empty)() if isinstance(empty, dict) else empty)
    for flag in (
        "_stage_forward_initialized",
        "_stage_backward_initialized",
        "_stages_forward_initialized",
        "_stages_backward_initialized",
    ):
        if hasattr(schedule, flag):
            setattr(schedule, flag, False)


def preserve_grads_across_stage_reinit(stage: Any) -> None:
    """Keep accumulated gradients when the schedule re-initialises `stage` with static shapes.

    After (re-)initialisation torch calls `stage._post_metadata_inference_cleanup()`, which sets every FSDP
    parameter's `.grad` to None (torch 2.12+): right after dynamic shape inference those grads are by-products of
    the inference pass, but with static shapes nothing ran, so they are the gradients accumulated by earlier steps
    (e.g. `AutoPipeline.update_seq_len` between gradient-accumulation steps). In static mode this wrapper puts
    them back; in dynamic mode torch's behaviour is unchanged. Idempotent; a no-op on torch without the hook.
    """
    original = getattr(stage, "_post_metadata_inference_cleanup", None)
    if not callable(original) or getattr(original, "_am_pp_preserves_grads", False):
        return

    def cleanup() -> None:
        mode = getattr(stage, "_inference_mode", None)
        if getattr(mode, "name", None) != "STATIC":
            original()
            return
        saved = [(p, p.grad) for p in stage.submod.parameters() if p.grad is not None]
        original()
        for param, grad in saved:
            if param.grad is None:
                param.grad = grad

    cleanup._am_pp_preserves_grads = True  # type: ignore[attr-defined]
    stage._post_metadata_inference_cleanup = cleanup


def fsdp_finalization_problem() -> str | None:
    """Why this torch cannot run `GradSyncStage` (its FSDP2 lacks the explicit end-of-backward API it drives:
    `FSDPModule.set_manual_backward_finalization` / `finalize_backward`, in torch 2.15, not in 2.13), or None."""
    from torch.distributed.fsdp import FSDPModule

    missing = [
        name for name in ("set_manual_backward_finalization", "finalize_backward") if not hasattr(FSDPModule, name)
    ]
    if not missing:
        return None
    return (
        f"torch {torch.__version__}'s FSDP2 has no {' / '.join(missing)}, which per-microbatch gradient reduction "
        "(reduce_grad_per_microbatch / defer_fsdp_grad_sync=False) and deferred reduction of nested FSDP2 modules "
        "(patch_stage_backward_maybe_with_nosync / cover_nested_fsdp) drive. Upgrade torch (2.15 has it), or leave "
        "both options off."
    )


def full_stage_backward(bwd_kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, ...]:
    """One microbatch's full backward as `PipelineStage.backward_maybe_with_nosync` runs it (weights and inputs
    together); `bwd_kwargs` holds the stage's "stage_output", "output_grads" and "input_values". Returns the
    gradients of the stage inputs."""
    from torch.distributed.pipelining._backward import stage_backward

    return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])


# --------------------------------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------------------------------


def is_reentrant_checkpoint_wrapper(module: nn.Module) -> bool:
    """True when `module` is torch's `CheckpointWrapper` configured with the reentrant implementation."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as _cw

    if not isinstance(module, _cw.CheckpointWrapper):
        return False
    if getattr(module, "checkpoint_impl", None) == _cw.CheckpointImpl.REENTRANT:
        return True
    # A wrapper built with a custom checkpoint_fn may carry use_reentrant in a functools.partial.
    checkpoint_fn = getattr(module, "checkpoint_fn", None)
    keywords = getattr(checkpoint_fn, "keywords", None) or {}
    return bool(keywords.get("use_reentrant", False))


def bind_method(module: nn.Module, name: str, function: Callable[..., Any]) -> None:
    """Bind `function` as an instance method `name` of `module` (shadows the class method for this object)."""
    setattr(module, name, types.MethodType(function, module))
