"""Build the torch schedule that runs a rank's stages from a `PipelinePlan` (`build_schedule`), and upstream's
spellings around it: `build_pipeline_schedule`, `pipeline_model` (plan, split, parallelize, schedule),
`reset_pp_stage_shapes` and `scale_grads_by_divisor`.

What it must not do: re-plan a given plan, derive a schedule rule (ask `planning`), or reach torch pipelining
internals other than through `am_pipelining._compat`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from . import _compat
from .planning import PipelinePlan, csv_problems, plan_pipeline
from .stage_names import plan_for_model
from .stages import _pipeline_axis, _pp_rank_size_group, _set_static_shapes, build_stages

__all__ = [
    "ParallelizeFnProtocol",
    "build_pipeline_schedule",
    "build_schedule",
    "check_step_shapes",
    "pipeline_model",
    "reset_pp_stage_shapes",
    "scale_grads_by_divisor",
]

logger = logging.getLogger(__name__)


class ParallelizeFnProtocol(Protocol):
    """What `pipeline_model` calls on each stage module (e.g. to apply FSDP2); may return a new module."""

    def __call__(self, model: nn.Module, **kwargs: Any) -> nn.Module | None: ...


# ------------------------------------------------------------------------------------------------------------
# Schedules
# ------------------------------------------------------------------------------------------------------------


def build_schedule(
    stages: Sequence[PipelineStage],
    plan: PipelinePlan,
    *,
    loss_fn: Callable[..., torch.Tensor] | None,
    scale_grads: bool = False,
) -> Any:
    """The schedule that runs this rank's `stages` exactly as `plan` says: its schedule (or CSV file) and its
    `n_microbatches` (`plan.local_batch_size // plan.microbatch_size`). The plan is trusted, not re-planned.

    With `scale_grads=False` gradients are the sum over microbatches. `loss_fn` must be the same kind on EVERY
    pipeline rank, including ranks that hold no last stage: a callable gives a training schedule (forward +
    backward); None gives a forward-only (inference) schedule. Mixing the two across ranks makes the ranks
    disagree about backward sends and deadlocks, so None logs a warning. Stages that reduce gradients per
    microbatch (`build_stages(reduce_grad_per_microbatch=True)`) need a schedule without split backward.

    Raises:
        ValueError: a plan without a batch, stages that are not the plan's (count on this rank, total count), or
            per-microbatch gradient reduction with a split-backward schedule.
    """
    if plan.n_microbatches is None:
        raise ValueError(
            "build_schedule: the plan has no batch; plan it with local_batch_size= and microbatch_size= "
            "(plan_pipeline), which also checks the schedule's microbatch rules."
        )
    if len(stages) != plan.stages_per_rank or any(stage.num_stages != plan.num_stages for stage in stages):
        raise ValueError(
            f"{plan.schedule} runs {plan.stages_per_rank} of {plan.num_stages} stage(s) per rank but this rank has "
            f"{len(stages)} of {[stage.num_stages for stage in stages]}; build the stages from the same plan "
            "(build_stages)."
        )
    if plan.n_microbatches < plan.pp_size:
        logger.warning(
            "%d microbatches for %d pipeline ranks: most of each step is bubble. Use >= %d microbatches.",
            plan.n_microbatches,
            plan.pp_size,
            plan.pp_size,
        )
    if loss_fn is None:
        logger.warning(
            "A forward-only schedule (loss_fn=None): every pipeline rank must pass loss_fn=None too (pass the loss "
            "function on all ranks, not only the last stage's, to train)."
        )
    schedule_class = _compat.runtime_schedule_class() if plan.csv is not None else plan.schedule_class
    multi = _compat.is_multi_stage_schedule(schedule_class)
    schedule = schedule_class(
        list(stages) if multi else stages[0],
        n_microbatches=plan.n_microbatches,
        loss_fn=loss_fn,
        scale_grads=scale_grads,
    )
    if plan.csv is not None:
        _compat.load_schedule_csv(schedule, plan.csv)
    _refuse_split_backward_per_microbatch(schedule, stages, plan)
    if any(getattr(stage, "_am_static_shape", None) is not None for stage in stages):
        _check_shapes_before_each_step(schedule, stages, plan.n_microbatches)
    return schedule


def _refuse_split_backward_per_microbatch(schedule: Any, stages: Sequence[PipelineStage], plan: PipelinePlan) -> None:
    """FSDP2 can reduce per microbatch only after a full backward: a schedule that splits a microbatch's backward
    into input and weight parts (zero-bubble kinds) leaves the weight gradients of its last part unreduced."""
    if not any(getattr(stage, "reduce_grad_per_microbatch", False) for stage in stages):
        return
    actions = _compat.schedule_compute_actions(
        schedule, pp_size=plan.pp_size, n_microbatches=plan.n_microbatches or 1, stages_per_rank=plan.stages_per_rank
    )
    if any(kind in ("I", "W") for rank_actions in actions.values() for _, kind, _ in rank_actions):
        raise ValueError(
            f"reduce_grad_per_microbatch=True (defer_fsdp_grad_sync=False) needs one full backward per microbatch, "
            f"but {plan.csv or plan.schedule} splits backward into input and weight parts. Use GPipe, 1F1B, "
            "Interleaved1F1B or LoopedBFS, or defer the reduction to the last microbatch."
        )


def build_pipeline_schedule(
    csv: str | os.PathLike[str] | None,
    schedule_name: str | None,
    microbatch_size: int,
    local_batch_size: int,
    stages: list[PipelineStage],
    loss_fn: Callable[..., torch.Tensor] | None,
    scale_grads: bool = False,
) -> Any:
    """Upstream's spelling: plan the schedule and batch of `stages` from these options, then `build_schedule`.

    Accepts every schedule name the installed torch knows (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, case-insensitive) or a compute-only CSV file (one row per
    rank, actions like `0F1,1B0`). The layers come from the plan the stages were built with.

    Raises:
        FileNotFoundError: the CSV path is not a file.
        PipelinePlanError (ValueError): batch not divisible by the microbatch size, too few microbatches for the
            schedule, a schedule that cannot run the stages' layout.
        ValueError: no stages, or `build_schedule`'s errors.
    """
    problems = csv_problems(csv)
    if problems:
        raise FileNotFoundError(problems[0])
    if not stages:
        raise ValueError("No pipeline stages on this rank; split the model first.")
    split: PipelinePlan | None = getattr(stages[0], "_am_pipeline_plan", None)
    plan = plan_pipeline(
        split.num_layers if split is not None else None,
        split.pp_size if split is not None else stages[0].group_size,
        schedule_name,
        csv=csv,
        stage_layers=split.stage_layers if split is not None else None,
        num_stages=None if split is not None else stages[0].num_stages,  # stages built elsewhere: their own count
        local_batch_size=local_batch_size,
        microbatch_size=microbatch_size,
    )
    return build_schedule(stages, plan, loss_fn=loss_fn, scale_grads=scale_grads)


def check_step_shapes(
    stages: Sequence[PipelineStage], n_microbatches: int, inputs: Sequence[Any], target: Any = None
) -> None:
    """Refuse step inputs that do not match the stages' static shapes, before anything is sent.

    `inputs` (the model input, e.g. input_ids [B, S]) and `target` (labels [B, S]) must have B = n_microbatches ×
    microbatch_size rows and S = the static sequence length. Every rank that is given inputs or a target checks
    them, so a mismatch ends with the same error on all those ranks instead of a wait on a message of the wrong
    size. (Pass the target, or AutoPipeline's model input, on every rank to cover every rank.)

    Raises:
        ValueError: naming the shape that was given, the one the stages were built for, and the fix.
    """
    static = next((getattr(s, "_am_static_shape", None) for s in stages if hasattr(s, "_am_static_shape")), None)
    if static is None:
        return
    microbatch_size, seq_len = static
    batch = n_microbatches * microbatch_size
    for what, tensor in [*(("the model input", t) for t in inputs), ("the target", target)]:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
            continue
        rows, length = tensor.shape[0], tensor.shape[1] if tensor.dim() > 1 else None
        if rows == batch and length in (None, seq_len):
            continue
        fixes = []
        if length is not None and length != seq_len:
            fixes.append(
                f"call AutoPipeline.update_seq_len({length}) before this step (or split the stages with "
                f"seq_len={length})"
            )
        if rows != batch:
            fixes.append(
                f"give {batch} rows per step, or rebuild the schedule for a local batch of {rows} (microbatches of "
                f"{microbatch_size})"
            )
        raise ValueError(
            f"Pipeline step refused before any send: {what} has shape {list(tensor.shape)} but the stages were built "
            f"for static shapes of {n_microbatches} microbatches x {microbatch_size} rows x seq_len {seq_len} "
            f"([{batch}, {seq_len}, ...]). Fix: {'; '.join(fixes)}."
        )


def _check_shapes_before_each_step(schedule: Any, stages: Sequence[PipelineStage], n_microbatches: int) -> None:
    """Wrap `schedule.step` (this instance only) so that every step first runs `check_step_shapes`."""
    step = schedule.step

    @functools.wraps(step)
    def checked_step(*args: Any, target: Any = None, **kwargs: Any) -> Any:
        check_step_shapes(stages, n_microbatches, args, target)
        return step(*args, target=target, **kwargs)

    schedule.step = checked_step


def _refuse_options_without_parallelize_fn(**options: Any) -> None:
    """The mesh / axis options only reach `parallelize_fn`; without one they would be accepted and ignored."""
    given = [
        name
        for name, value in options.items()
        if value is not None and not (name == "dp_axis_names" and tuple(value) == ("dp",))
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} given without a parallelize_fn: these options are only passed to parallelize_fn "
            "(which applies FSDP2 / TP / EP / CP to each stage), so nothing would use them. Pass parallelize_fn, or "
            "drop them."
        )


def pipeline_model(
    model: nn.Module,
    world_mesh: Any,
    moe_mesh: Any = None,
    *,
    pp_axis_name: str = "pp",
    dp_axis_names: tuple[str, ...] | None = ("dp",),
    cp_axis_name: str | None = None,
    tp_axis_name: str | None = None,
    ep_axis_name: str | None = None,
    ep_shard_axis_names: tuple[str, ...] | None = None,
    layers_per_stage: int | None = None,
    pipeline_parallel_schedule_csv: str | None = None,
    pipeline_parallel_schedule: str | None = "1f1b",
    microbatch_size: int = 1,
    local_batch_size: int = 1,
    device: torch.device | str = "cpu",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    parallelize_fn: ParallelizeFnProtocol | None = None,
    module_fqns_per_model_part: Sequence[Sequence[str]] | None = None,
    patch_inner_model: bool = True,
    patch_causal_lm_model: bool = True,
    scale_grads: bool = False,
    round_to_pp_multiple: str | None = None,
    seq_len: int | None = None,
    tensor_dtype: torch.dtype | None = None,
    stages_per_rank: int | None = None,
    patch_stage_backward_maybe_with_nosync: bool = False,
    reduce_grad_per_microbatch: bool = False,
) -> tuple[Any, list[nn.Module], bool, bool, list[PipelineStage]]:
    """Plan, split, parallelize each stage module (e.g. FSDP2 over the dp axes), and build the schedule.

    The whole layout is planned first (`plan_pipeline`: stages, layers, placement, microbatches), so a request
    that cannot run is refused before any collective. `stages_per_rank` runs exactly that many stages per rank.

    Returns:
        (schedule, model_parts, has_first_stage, has_last_stage, stages) for this rank.

    `reduce_grad_per_microbatch=True` makes FSDP2 stage modules reduce their gradients after every microbatch;
    `patch_stage_backward_maybe_with_nosync=True` makes FSDP2 modules nested below a non-FSDP2 stage module follow
    the same choice (`build_stages`'s `reduce_grad_per_microbatch` / `cover_nested_fsdp`).

    Raises:
        ValueError: the pipeline axis has size 1, or any error of `plan_for_model` / `build_stages` /
            `build_schedule`.
    """
    mesh_options: dict[str, Any] = {
        "moe_mesh": moe_mesh,
        "dp_axis_names": dp_axis_names,
        "cp_axis_name": cp_axis_name,
        "tp_axis_name": tp_axis_name,
        "ep_axis_name": ep_axis_name,
        "ep_shard_axis_names": ep_shard_axis_names,
    }
    if parallelize_fn is None:
        _refuse_options_without_parallelize_fn(**mesh_options)
    pp_mesh = _pipeline_axis(world_mesh, pp_axis_name)
    pp_size = _pp_rank_size_group(pp_mesh)[1]
    if pp_size <= 1:
        raise ValueError(f"Pipeline parallelism is not enabled: the {pp_axis_name!r} mesh axis has size {pp_size}.")
    # With a CSV, the schedule name (if any) still decides stages per rank and placement; without one, the CSV
    # runtime's defaults apply (2 stages per rank, loop placement).
    plan = plan_for_model(
        model,
        pp_size,
        pipeline_parallel_schedule,
        module_fqns_per_model_part,
        option_label="module_fqns_per_model_part",
        csv=pipeline_parallel_schedule_csv,
        stages_per_rank=stages_per_rank,
        layers_per_stage=layers_per_stage,
        round_to_pp_multiple=round_to_pp_multiple,
        local_batch_size=local_batch_size,
        microbatch_size=microbatch_size,
    )
    stages, model_parts = build_stages(
        model,
        pp_mesh,
        plan,
        device=device,
        module_names_per_stage=module_fqns_per_model_part,
        seq_len=seq_len,
        dtype=tensor_dtype if seq_len is not None else None,
        patch_inner_model=patch_inner_model,
        patch_causal_lm_model=patch_causal_lm_model,
        reduce_grad_per_microbatch=reduce_grad_per_microbatch,
        cover_nested_fsdp=patch_stage_backward_maybe_with_nosync,
    )
    if parallelize_fn is not None:
        for i, part in enumerate(model_parts):
            result = parallelize_fn(part, world_mesh=world_mesh, **mesh_options)
            if isinstance(result, nn.Module) and result is not part:
                for attr in ("_pp_tied_embedding", "_pp_stage_index"):
                    if hasattr(part, attr):
                        setattr(result, attr, getattr(part, attr))
                model_parts[i] = result
            stages[i].submod = model_parts[i]
    schedule = build_schedule(stages, plan, loss_fn=loss_fn, scale_grads=scale_grads)
    has_first = any(stage.is_first for stage in stages)
    has_last = any(stage.is_last for stage in stages)
    return schedule, model_parts, has_first, has_last, stages


# ------------------------------------------------------------------------------------------------------------
# Between steps
# ------------------------------------------------------------------------------------------------------------


def reset_pp_stage_shapes(
    schedule: Any,
    stages: Sequence[PipelineStage],
    config: Any,
    microbatch_size: int,
    seq_len: int,
    tensor_dtype: torch.dtype | None = None,
) -> None:
    """Give this rank's stages static shapes for a new sequence length; the next `schedule.step()` re-initializes
    (`_set_static_shapes` with the schedule; `config`, when not None, gives the hidden and vocabulary sizes).

    Raises:
        RuntimeError: this torch's stages expose no known static-metadata API.
    """
    _set_static_shapes(
        stages, microbatch_size=microbatch_size, seq_len=seq_len, dtype=tensor_dtype, config=config, schedule=schedule
    )


@torch.no_grad()
def scale_grads_by_divisor(stages: Sequence[Any], divisor: int | float) -> None:
    """Divide the accumulated gradients of every stage by `divisor` (stages without `scale_grads` are skipped)."""
    for stage in stages:
        scale = getattr(stage, "scale_grads", None)
        if callable(scale):
            scale(divisor)
