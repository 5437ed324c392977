"""Build this rank's `PipelineStage`s from a `PipelinePlan` (`build_stages`), and upstream's spelling of it.

What it is for: the module lists of the stages (`stage_names`: generated from the plan's layer split, or given
explicitly and validated), building this rank's stage modules (`stage_modules`), marking tied-embedding copies,
wrapping each stage module into a `PipelineStage` (a `GradSyncStage` for the gradient-reduction choices), and
static shapes (`_set_static_shapes`).
`split_model_into_stages` keeps upstream's signature: it plans from its options, then calls `build_stages`.

What it must not do: re-derive a stage count, a placement or a layer split from a given plan (ask `planning`), or
import a model package. Errors that would otherwise surface as hangs are raised here, early, naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from . import _compat
from .grad_sync import GradSyncStage
from .hf_validation import check_forward_reproduction
from .layers import DecoderLayers, find_layers, module_at
from .outputs import output_names_problems, pipeline_output_names
from .planning import PipelinePlan
from .stage_modules import build_stage_modules, stage_metas
from .stage_names import _default_module_names, _stage_layers_from_names, module_names_problems, plan_for_model
from .tied import TiedEmbeddingCopy, pair_group

__all__ = ["build_stages", "split_model_into_stages"]


def _find_tied_embedding(model: nn.Module, layout: DecoderLayers) -> tuple[str, str] | None:
    """(embedding weight FQN, lm_head weight FQN) when they share storage by identity, else None."""
    lm_head_fqn = layout.lm_head_fqn
    if lm_head_fqn is None:
        return None
    embed = module_at(model, layout.layers_prefix + "embed_tokens")
    head = module_at(model, lm_head_fqn)
    embed_weight = getattr(embed, "weight", None)
    if embed_weight is None or getattr(head, "weight", None) is not embed_weight:
        return None
    return f"{layout.layers_prefix}embed_tokens.weight", f"{lm_head_fqn}.weight"


# ------------------------------------------------------------------------------------------------------------
# Splitting into PipelineStages
# ------------------------------------------------------------------------------------------------------------


def _pipeline_axis(pp_mesh: Any, pp_axis_name: str) -> Any:
    """The 1-D pipeline mesh: `pp_mesh` itself (1-D, or a ProcessGroup), or its `pp_axis_name` axis."""
    names = getattr(pp_mesh, "mesh_dim_names", None)
    if names is None or len(names) <= 1:
        return pp_mesh
    if pp_axis_name not in names:
        raise ValueError(f"Mesh axes {names} have no pipeline axis {pp_axis_name!r}.")
    return pp_mesh[pp_axis_name]


def _pp_rank_size_group(pp_mesh: Any) -> tuple[int, int, Any]:
    """(rank, size, process group) of a 1-D DeviceMesh or a ProcessGroup."""
    if isinstance(pp_mesh, dist.ProcessGroup):
        return dist.get_rank(pp_mesh), dist.get_world_size(pp_mesh), pp_mesh
    return pp_mesh.get_local_rank(), pp_mesh.size(), pp_mesh.get_group()


def build_stages(
    model: nn.Module,
    pp_mesh: Any,
    plan: PipelinePlan,
    *,
    device: torch.device | str,
    module_names_per_stage: Sequence[Sequence[str]] | None = None,
    seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    patch_inner_model: bool = True,
    patch_causal_lm_model: bool = True,
    reduce_grad_per_microbatch: bool = False,
    cover_nested_fsdp: bool = False,
) -> tuple[list[PipelineStage], list[nn.Module]]:
    """This rank's `PipelineStage`s and their modules, in stage order, exactly as `plan` lays them out.

    The plan is trusted: nothing is re-planned. It is only checked against what it is applied to (the pipeline
    group's size, the model's layer count, and `module_names_per_stage` when given).

    Args:
        model: the full model (meta device is fine; it is left unchanged).
        pp_mesh: a DeviceMesh (its "pp" axis when it has several) or the pipeline ProcessGroup.
        plan: from `plan_pipeline` with the model's layer count (for explicit stage lists, the plan made from them).
        device: device the stages compute on.
        module_names_per_stage: explicit FQN lists per global stage, holding the plan's layers (default: generated
            from the plan's layer split, then passed through the model's `customize_pipeline_stage_modules` hook).
        seq_len / dtype: with `seq_len`, stages get static shapes `[plan.microbatch_size, seq_len, ...]` in `dtype`
            (default: the stage's parameter dtype); the plan must then have a batch.
        patch_inner_model / patch_causal_lm_model: run the pipeline forward in the text decoder / the top-level model
            (upstream's names; the stage copies become instances of stage classes, `build_stage_modules`).
        reduce_grad_per_microbatch: an FSDP2 stage module reduce-scatters its gradients after every microbatch's
            backward instead of once after the last (lower peak memory, more communication; same gradients).
        cover_nested_fsdp: the outermost FSDP2 modules below a stage module that is not one (e.g. separately
            sharded experts) follow the stage's choice too: one reduction after the last microbatch, or one per
            microbatch with `reduce_grad_per_microbatch` (without it they reduce every microbatch, as in torch).
            With either option the stages are `GradSyncStage`s (`am_pipelining.grad_sync`), else `PipelineStage`s.

    Raises:
        ValueError: a plan for another group size or layer count, stage lists that do not hold the plan's layers,
            `seq_len` with a plan without a batch, `dtype` without `seq_len`, reentrant checkpointing, a model whose
            own forward the pipeline forwards do not reproduce (`check_forward_reproduction`), either gradient
            choice on a torch whose FSDP2 lacks the end-of-backward API they drive (torch 2.13; 2.15 has it).

    NOTE: call it on every rank of the default process group (SPMD). When tied input/output embeddings land on
    different ranks, the first/last-stage pair groups of all pipeline replicas are created here, collectively.
    """
    pp_rank, pp_size, group = _pp_rank_size_group(_pipeline_axis(pp_mesh, "pp"))
    check_forward_reproduction(model)  # first: a stage list cannot fix a forward the stages do not reproduce
    layout = find_layers(model)
    if (reduce_grad_per_microbatch or cover_nested_fsdp) and (why := _compat.fsdp_finalization_problem()):
        raise ValueError(f"build_stages: {why}")
    problems = []
    if plan.pp_size != pp_size:
        problems.append(f"the plan is for {plan.pp_size} pipeline ranks but the pipeline group has {pp_size}")
    if plan.num_layers != layout.num_layers or plan.stage_layers is None:
        problems.append(f"the plan is for {plan.num_layers} layers but the model has {layout.num_layers}")
    if seq_len is not None and plan.microbatch_size is None:
        problems.append("seq_len asks for static shapes of a microbatch, but the plan has no batch")
    if seq_len is None and dtype is not None:
        problems.append("dtype describes static shapes and needs seq_len (give seq_len, or drop dtype)")
    explicit = None if module_names_per_stage is None else [list(stage) for stage in module_names_per_stage]
    planned = [list(layers) for layers in plan.stage_layers or ()]
    if explicit is not None and _stage_layers_from_names(explicit, layout) != planned:
        problems.append("module_names_per_stage do not hold the plan's layers per stage")
    if problems:
        raise ValueError(
            "build_stages: " + "; ".join(problems) + ". Plan with this model, group and stage lists "
            "(plan_pipeline(num_layers, pp_size, schedule, ..., local_batch_size=, microbatch_size=)), "
            "or with plan_for_model for explicit stage lists."
        )
    # generated lists come from the plan, then the model's hook edits them: the hook must keep the model whole
    names = explicit if explicit is not None else _default_module_names(model, plan.stage_layers or (), layout)
    problems = module_names_problems(model, layout, names, explicit=explicit is not None)
    if problems:
        whose = (
            "module_names_per_stage"
            if explicit is not None
            else f"{type(model).__name__}.customize_pipeline_stage_modules returned stage lists that"
        )
        raise ValueError(f"{whose} do not run the model as one: " + " ".join(problems))
    stage_ids = plan.stage_ids(pp_rank)
    models = build_stage_modules(
        model, names, stage_ids, patch_inner_model=patch_inner_model, patch_causal_lm_model=patch_causal_lm_model
    )
    _attach_tied_embedding_copies(model, layout, names, stage_ids, models, plan, group)
    declared = pipeline_output_names(model)
    if declared is not None and output_names_problems(declared):
        raise ValueError(
            f"{type(model).__name__}'s contract pp.output_names is invalid: "
            + "; ".join(output_names_problems(declared))
        )
    stage_class: Callable[..., PipelineStage] = PipelineStage
    if reduce_grad_per_microbatch or cover_nested_fsdp:
        stage_class = partial(
            GradSyncStage, reduce_grad_per_microbatch=reduce_grad_per_microbatch, cover_nested_fsdp=cover_nested_fsdp
        )
    stages = []
    for stage_id, stage_model in zip(stage_ids, models, strict=True):
        stage = stage_class(stage_model, stage_id, plan.num_stages, torch.device(device), group=group)
        _compat.preserve_grads_across_stage_reinit(stage)
        stage._am_pipeline_plan = plan  # type: ignore[attr-defined]  # build_pipeline_schedule reads it back
        stages.append(stage)
    if seq_len is not None:
        assert plan.microbatch_size is not None
        _set_static_shapes(stages, microbatch_size=plan.microbatch_size, seq_len=seq_len, dtype=dtype)
    return stages, models


def _set_static_shapes(
    stages: Sequence[PipelineStage],
    *,
    microbatch_size: int,
    seq_len: int,
    dtype: torch.dtype | None = None,
    config: Any = None,
    schedule: Any = None,
) -> None:
    """Give this rank's stages static shapes, so torch skips its shape-inference round trip.

    Inputs of the first stage are `[microbatch_size, seq_len]` int64, later ones `[microbatch_size, seq_len, H]`;
    outputs `[microbatch_size, seq_len, V]` on a stage with an LM head, else hidden states (a model's
    `get_pipeline_stage_metas` wins; see `stage_metas`). `config` gives H and V (default: each stage module's own);
    `dtype` defaults to each stage's parameter dtype. With the built `schedule`, its next `step()` re-initializes
    the stages for the new shapes (accumulated gradients are kept). Schedules built on stages with static shapes
    check every step's inputs against them before anything is sent (`check_step_shapes`).

    Raises:
        RuntimeError: this torch's stages take no static metadata.
    """
    metas = [
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
    for stage, (inputs, outputs) in zip(stages, metas, strict=True):
        _compat.set_stage_metas(stage, inputs, outputs)
        stage._am_static_shape = (microbatch_size, seq_len)  # type: ignore[attr-defined]
    if schedule is not None:
        _compat.reset_stage_shapes(schedule, list(stages))


def split_model_into_stages(
    model: nn.Module,
    pp_mesh: Any,
    pp_axis_name: str,
    pp_schedule: str | None,
    device: torch.device | str,
    module_names_per_stage: Sequence[Sequence[str]] | None = None,
    layers_per_stage: int | None = None,
    patch_inner_model: bool = True,
    patch_causal_lm_model: bool = True,
    round_to_pp_multiple: str | None = None,
    *,
    stages_per_rank: int | None = None,
    microbatch_size: int | None = None,
    seq_len: int | None = None,
    tensor_dtype: torch.dtype | None = None,
) -> tuple[list[PipelineStage], list[nn.Module]]:
    """Upstream's spelling: plan from these options (`plan_for_model`), then `build_stages`.

    Args:
        pp_mesh / pp_axis_name: a DeviceMesh with the pipeline axis (or a 1-D one, or a ProcessGroup).
        pp_schedule: schedule name (decides stages per rank and loop/V placement); None means a CSV runtime
            schedule with loop placement.
        module_names_per_stage: explicit FQN lists per global stage (validated).
        layers_per_stage / round_to_pp_multiple / stages_per_rank: the stage request (see `plan_pipeline`).
        microbatch_size / seq_len / tensor_dtype: with `seq_len`, static shapes `[microbatch_size (default 1),
            seq_len, ...]` in `tensor_dtype` (default: the stage's parameter dtype).

    Returns:
        (stages, models) for this rank.

    Raises:
        PipelinePlanError (ValueError): every planning problem (see `plan_pipeline`), and `build_stages`'s errors.
    """
    if seq_len is None and (microbatch_size is not None or tensor_dtype is not None):
        raise ValueError(
            "microbatch_size and tensor_dtype describe static stage shapes and need seq_len; give seq_len too, or "
            "drop them (shapes are then inferred at the first step)."
        )
    pp_mesh = _pipeline_axis(pp_mesh, pp_axis_name)
    pp_size = _pp_rank_size_group(pp_mesh)[1]
    check_forward_reproduction(model)  # first: a stage list cannot fix a forward the stages do not reproduce
    plan = plan_for_model(
        model,
        pp_size,
        pp_schedule,
        module_names_per_stage,
        stages_per_rank=stages_per_rank,
        layers_per_stage=layers_per_stage,
        round_to_pp_multiple=round_to_pp_multiple,
    )
    stages, models = build_stages(
        model,
        pp_mesh,
        plan,
        device=device,
        module_names_per_stage=module_names_per_stage,
        patch_inner_model=patch_inner_model,
        patch_causal_lm_model=patch_causal_lm_model,
    )
    if seq_len is not None:
        _set_static_shapes(stages, microbatch_size=microbatch_size or 1, seq_len=seq_len, dtype=tensor_dtype)
    return stages, models


def _attach_tied_embedding_copies(
    model: nn.Module,
    layout: DecoderLayers,
    names_per_stage: Sequence[Sequence[str]],
    stage_ids: Sequence[int],
    models: Sequence[nn.Module],
    plan: PipelinePlan,
    group: Any,
) -> None:
    """Mark the two copies of a tied embedding that landed on different stages and create their pair group."""
    tied = _find_tied_embedding(model, layout)
    if tied is None:
        return
    embed_fqn, head_fqn = tied

    def owner(fqn: str) -> int | None:
        return next((s for s, names in enumerate(names_per_stage) if fqn.rsplit(".", 1)[0] in names), None)

    first_stage, last_stage = owner(embed_fqn), owner(head_fqn)
    if first_stage is None or last_stage is None or first_stage == last_stage:
        return  # one stage holds both (deepcopy kept them tied) or one end is absent

    def rank_of(stage: int) -> int:
        local = plan.rank_of_stage(stage)
        return dist.get_global_rank(group, local) if dist.is_initialized() else local

    first_rank, last_rank = rank_of(first_stage), rank_of(last_stage)
    pair = pair_group(first_rank, last_rank) if dist.is_initialized() else None
    for stage_id, stage_model in zip(stage_ids, models, strict=True):
        if stage_id == first_stage:
            stage_model._pp_tied_embedding = TiedEmbeddingCopy(embed_fqn, "input", first_rank, last_rank, pair)  # type: ignore[assignment]
        elif stage_id == last_stage:
            stage_model._pp_tied_embedding = TiedEmbeddingCopy(head_fqn, "output", first_rank, last_rank, pair)  # type: ignore[assignment]
