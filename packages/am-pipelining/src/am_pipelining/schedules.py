"""Build the torch schedule that runs a rank's stages, and `pipeline_model`: plan, split, parallelize, schedule.

What it is for: `build_pipeline_schedule` (any torch schedule by name, or a compute-only CSV) with the batch rules
of `plan_pipeline`, and `pipeline_model`, which plans the whole layout first (so a request that cannot run is refused
before any collective), splits, applies a per-stage `parallelize_fn` (e.g. FSDP2) and builds the schedule.

What it must not do: re-derive a schedule rule (ask `planning`) or reach torch pipelining internals other than
through `am_pipelining._compat`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from . import _compat
from .layers import find_layers
from .planning import PipelinePlan, csv_problems, plan_pipeline
from .stage_modules import stage_metas
from .stage_names import plan_for_module_names
from .stages import split_model_into_stages

__all__ = [
    "ParallelizeFnProtocol",
    "build_pipeline_schedule",
    "check_step_shapes",
    "pipeline_model",
    "precompute_stage_shapes",
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


def build_pipeline_schedule(
    csv: str | os.PathLike[str] | None,
    schedule_name: str | None,
    microbatch_size: int,
    local_batch_size: int,
    stages: list[PipelineStage],
    loss_fn: Callable[..., torch.Tensor] | None,
    scale_grads: bool = False,
    *,
    plan: PipelinePlan | None = None,
) -> Any:
    """Build the schedule that runs `stages` with `local_batch_size // microbatch_size` microbatches.

    Accepts every schedule name the installed torch knows (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, case-insensitive) or a compute-only CSV file (one row per
    rank, actions like `0F1,1B0`). With `scale_grads=False` gradients are the sum over microbatches. The batch
    rules come from `plan_pipeline`, applied to the plan the stages were split with (or to `plan`).

    `loss_fn` must be the same kind on EVERY pipeline rank, including ranks that hold no last stage: a callable
    gives a training schedule (forward + backward); None gives a forward-only (inference) schedule. Mixing the two
    across ranks makes the ranks disagree about backward sends and deadlocks, so None logs a warning.

    Raises:
        FileNotFoundError: the CSV path is not a file.
        PipelinePlanError (ValueError): batch not divisible by the microbatch size, too few microbatches for the
            schedule, a schedule that cannot run the stages' layout.
        ValueError: no stages, or a wrong number of local stages for the plan.
    """
    problems = csv_problems(csv)
    if problems:
        raise FileNotFoundError(problems[0])
    if not stages:
        raise ValueError("No pipeline stages on this rank; split the model first.")
    split_plan = plan if plan is not None else getattr(stages[0], "_am_pipeline_plan", None)
    if split_plan is not None:
        plan = plan_pipeline(
            split_plan.num_layers,
            split_plan.pp_size,
            schedule_name,
            csv=csv,
            stage_layers=split_plan.stage_layers,
            num_stages=None if split_plan.stage_layers is not None else split_plan.num_stages,
            local_batch_size=local_batch_size,
            microbatch_size=microbatch_size,
        )
    else:  # stages built elsewhere: plan from what they say about themselves
        plan = plan_pipeline(
            None,
            stages[0].group_size,
            schedule_name,
            csv=csv,
            num_stages=stages[0].num_stages,
            local_batch_size=local_batch_size,
            microbatch_size=microbatch_size,
        )
    if len(stages) != plan.stages_per_rank:
        raise ValueError(
            f"{plan.schedule} runs {plan.stages_per_rank} stage(s) per rank but this rank has {len(stages)}; split "
            "the model with the same schedule and stage request."
        )
    assert plan.n_microbatches is not None
    if plan.n_microbatches < plan.pp_size:
        logger.warning(
            "%d microbatches for %d pipeline ranks: most of each step is bubble. Use >= %d microbatches.",
            plan.n_microbatches,
            plan.pp_size,
            plan.pp_size,
        )
    if loss_fn is None:
        logger.warning(
            "build_pipeline_schedule(loss_fn=None) builds a forward-only schedule; every pipeline rank must pass "
            "loss_fn=None too (pass the loss function on all ranks, not only the last stage's, to train)."
        )
    schedule_class = _compat.runtime_schedule_class() if csv is not None else plan.schedule_class
    multi = _compat.is_multi_stage_schedule(schedule_class)
    schedule = schedule_class(
        stages if multi else stages[0], n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads
    )
    if csv is not None:
        _compat.load_schedule_csv(schedule, os.fspath(csv))
    if any(getattr(stage, "_am_static_shape", None) is not None for stage in stages):
        _check_shapes_before_each_step(schedule, stages, plan.n_microbatches)
    return schedule


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

    Raises:
        ValueError: the pipeline axis has size 1, `patch_stage_backward_maybe_with_nosync` or
            `reduce_grad_per_microbatch` is True (upstream options torch's stage already covers), or any error of
            `split_model_into_stages` / `build_pipeline_schedule`.
    """
    if patch_stage_backward_maybe_with_nosync or reduce_grad_per_microbatch:
        raise ValueError(
            "patch_stage_backward_maybe_with_nosync=True / reduce_grad_per_microbatch=True are not supported: torch's "
            "PipelineStage already runs every microbatch's backward without FSDP gradient sync and reduces once "
            "after the last one. Leave both False."
        )
    if parallelize_fn is None:
        _refuse_options_without_parallelize_fn(
            moe_mesh=moe_mesh,
            dp_axis_names=dp_axis_names,
            cp_axis_name=cp_axis_name,
            tp_axis_name=tp_axis_name,
            ep_axis_name=ep_axis_name,
            ep_shard_axis_names=ep_shard_axis_names,
        )
    names = getattr(world_mesh, "mesh_dim_names", None)
    pp_mesh = world_mesh[pp_axis_name] if names is not None and len(names) > 1 else world_mesh
    pp_size = pp_mesh.size() if hasattr(pp_mesh, "size") else dist.get_world_size(pp_mesh)
    if pp_size <= 1:
        raise ValueError(f"Pipeline parallelism is not enabled: the {pp_axis_name!r} mesh axis has size {pp_size}.")
    # With a CSV, the schedule name (if any) still decides stages per rank and placement; without one, the CSV
    # runtime's defaults apply (2 stages per rank, loop placement).
    layout = find_layers(model)
    explicit = None if module_fqns_per_model_part is None else [list(s) for s in module_fqns_per_model_part]
    if explicit is not None:
        plan = plan_for_module_names(
            model,
            layout,
            pp_size,
            pipeline_parallel_schedule,
            explicit,
            option_label="module_fqns_per_model_part",
            csv=pipeline_parallel_schedule_csv,
            stages_per_rank=stages_per_rank,
            layers_per_stage=layers_per_stage,
            round_to_pp_multiple=round_to_pp_multiple,
            local_batch_size=local_batch_size,
            microbatch_size=microbatch_size,
        )
    else:
        plan = plan_pipeline(
            layout.num_layers,
            pp_size,
            pipeline_parallel_schedule,
            csv=pipeline_parallel_schedule_csv,
            stages_per_rank=stages_per_rank,
            layers_per_stage=layers_per_stage,
            round_to_pp_multiple=round_to_pp_multiple,
            local_batch_size=local_batch_size,
            microbatch_size=microbatch_size,
        )
    stages, model_parts = split_model_into_stages(
        model,
        pp_mesh,
        pp_axis_name,
        pipeline_parallel_schedule,
        device,
        module_names_per_stage=explicit,
        patch_inner_model=patch_inner_model,
        patch_causal_lm_model=patch_causal_lm_model,
        plan=plan,
        microbatch_size=microbatch_size if seq_len is not None else None,
        seq_len=seq_len,
        tensor_dtype=tensor_dtype if seq_len is not None else None,
    )
    if parallelize_fn is not None:
        for i, part in enumerate(model_parts):
            result = parallelize_fn(
                part,
                world_mesh=world_mesh,
                moe_mesh=moe_mesh,
                dp_axis_names=dp_axis_names,
                cp_axis_name=cp_axis_name,
                tp_axis_name=tp_axis_name,
                ep_axis_name=ep_axis_name,
                ep_shard_axis_names=ep_shard_axis_names,
            )
            if isinstance(result, nn.Module) and result is not part:
                for attr in ("_pp_tied_embedding", "_pp_stage_index"):
                    if hasattr(part, attr):
                        setattr(result, attr, getattr(part, attr))
                model_parts[i] = result
            stages[i].submod = model_parts[i]
    schedule = build_pipeline_schedule(
        pipeline_parallel_schedule_csv,
        pipeline_parallel_schedule,
        microbatch_size,
        local_batch_size,
        stages,
        loss_fn,
        scale_grads=scale_grads,
        plan=plan,
    )
    has_first = any(stage.is_first for stage in stages)
    has_last = any(stage.is_last for stage in stages)
    return schedule, model_parts, has_first, has_last, stages


# ------------------------------------------------------------------------------------------------------------
# Between steps (upstream names)
# ------------------------------------------------------------------------------------------------------------


def reset_pp_stage_shapes(
    schedule: Any,
    stages: Sequence[PipelineStage],
    config: Any,
    microbatch_size: int,
    seq_len: int,
    tensor_dtype: torch.dtype | None = None,
) -> None:
    """Give this rank's stages static shapes for a new sequence length; the next `schedule.step()` re-initializes.

    Inputs of the first stage become `[microbatch_size, seq_len]` int64, later ones `[microbatch_size, seq_len, H]`;
    outputs `[microbatch_size, seq_len, V]` on a stage with an LM head, else hidden states (a model's
    `get_pipeline_stage_metas` wins). `config` gives H and V (its `text_config` as fallback); `tensor_dtype`
    defaults to each stage's parameter dtype. Accumulated gradients are kept.

    Raises:
        RuntimeError: this torch's stages expose no known static-metadata API.
    """
    metas = _metas_of_stages(stages, config, microbatch_size, seq_len, tensor_dtype)
    _compat.reset_stage_shapes(schedule, list(stages), metas)
    for stage in stages:
        stage._am_static_shape = (microbatch_size, seq_len)  # type: ignore[attr-defined]


def _metas_of_stages(
    stages: Sequence[PipelineStage], config: Any, microbatch_size: int, seq_len: int, dtype: torch.dtype | None
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    return [
        stage_metas(
            stage.submod,
            is_first=stage.is_first,
            is_last=stage.is_last,
            microbatch_size=microbatch_size,
            seq_len=seq_len,
            dtype=dtype,
            config=config,
        )
        for stage in stages
    ]


def precompute_stage_shapes(
    stages: Sequence[PipelineStage],
    config: Any,
    microbatch_size: int,
    seq_len: int,
    tensor_dtype: torch.dtype | None = None,
) -> bool:
    """Give stages that were built without shapes static ones, so torch skips its shape-inference round trip.

    Same shapes as `reset_pp_stage_shapes` (which also makes a built schedule re-initialize). Returns False, and
    leaves every stage to torch's dynamic inference, when this torch's stages take no static metadata.
    """
    if not all(_compat.has_static_meta_api(stage) for stage in stages):
        logger.info("PipelineStage takes no static metadata in torch %s; shapes are inferred", torch.__version__)
        return False
    for stage, (inputs, outputs) in zip(
        stages, _metas_of_stages(stages, config, microbatch_size, seq_len, tensor_dtype), strict=True
    ):
        _compat.set_stage_metas(stage, inputs, outputs)
        stage._am_static_shape = (microbatch_size, seq_len)  # type: ignore[attr-defined]
    return True


@torch.no_grad()
def scale_grads_by_divisor(stages: Sequence[Any], divisor: int | float) -> None:
    """Divide the accumulated gradients of every stage by `divisor` (stages without `scale_grads` are skipped)."""
    for stage in stages:
        scale = getattr(stage, "scale_grads", None)
        if callable(scale):
            scale(divisor)


# ------------------------------------------------------------------------------------------------------------
# Upstream's private stage-metadata helper names (`functional` re-exports them)
# ------------------------------------------------------------------------------------------------------------


def _set_stage_metas(stage: Any, inputs_meta: tuple[torch.Tensor, ...], outputs_meta: tuple[torch.Tensor, ...]) -> None:
    """Upstream's name: give one `PipelineStage` static input/output meta tensors (`_compat.set_stage_metas`).

    Raises:
        RuntimeError: "Unsupported PipelineStage metadata API" on a torch whose stages take no static metadata.
    """
    _compat.set_stage_metas(stage, tuple(inputs_meta), tuple(outputs_meta))


def _precompute_stage_shapes(
    stages: Sequence[Any],
    model_config: Any,
    microbatch_size: int,
    seq_len: int,
    tensor_dtype: torch.dtype | None = None,
) -> None:
    """Upstream's name for `precompute_stage_shapes` (logs and leaves shapes to torch when it cannot set them)."""
    precompute_stage_shapes(stages, model_config, microbatch_size, seq_len, tensor_dtype)


def _preserve_grads_across_stage_reinit(stages: Sequence[Any]) -> None:
    """Upstream's name: keep accumulated gradients when the schedule re-initializes each stage in static mode
    (`_compat.preserve_grads_across_stage_reinit`; stages without torch's cleanup hook are skipped)."""
    for stage in stages:
        _compat.preserve_grads_across_stage_reinit(stage)
