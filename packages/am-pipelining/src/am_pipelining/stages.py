"""Split a model into this rank's `PipelineStage`s, as `plan_pipeline` plans them.

What it is for: planning the split (or taking a given plan), the module lists of the stages (`stage_names`: generated
from the plan's layer split, or given explicitly and validated), building this rank's stage modules
(`stage_modules`), marking tied-embedding copies, and wrapping each stage module into a `PipelineStage` (with static
shapes when a sequence length is given).

What it must not do: re-derive a stage count, a placement or a layer split (ask `planning`), or import a model
package. Errors that would otherwise surface as hangs are raised here, early, naming the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from . import _compat
from .hf_validation import check_forward_reproduction
from .layers import DecoderLayers, find_layers, module_at
from .outputs import output_names_problems, pipeline_output_names
from .planning import PipelinePlan, plan_pipeline
from .stage_modules import build_stage_modules, stage_metas
from .stage_names import (
    _default_module_names,
    generate_hf_model_fqn_per_model_part,
    module_names_problems,
    plan_for_module_names,
)
from .tied import TiedEmbeddingCopy, pair_group

__all__ = ["generate_hf_model_fqn_per_model_part", "split_model_into_stages"]


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


def _pp_rank_size_group(pp_mesh: Any, pp_axis_name: str | None) -> tuple[int, int, Any]:
    """(rank, size, process group) from a 1-D DeviceMesh (or a mesh with `pp_axis_name`) or a ProcessGroup."""
    if isinstance(pp_mesh, dist.ProcessGroup):
        return dist.get_rank(pp_mesh), dist.get_world_size(pp_mesh), pp_mesh
    names = getattr(pp_mesh, "mesh_dim_names", None)
    if names is not None and pp_axis_name is not None and len(names) > 1:
        if pp_axis_name not in names:
            raise ValueError(f"Mesh axes {names} have no pipeline axis {pp_axis_name!r}.")
        pp_mesh = pp_mesh[pp_axis_name]
    return pp_mesh.get_local_rank(), pp_mesh.size(), pp_mesh.get_group()


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
    plan: PipelinePlan | None = None,
    microbatch_size: int | None = None,
    seq_len: int | None = None,
    tensor_dtype: torch.dtype | None = None,
) -> tuple[list[PipelineStage], list[nn.Module]]:
    """Build this rank's `PipelineStage`s and their modules, in stage order, as `plan_pipeline` plans them.

    Args:
        model: the full model (meta device is fine; it is left unchanged).
        pp_mesh: a DeviceMesh with the pipeline axis (or a ProcessGroup) — needs an initialized process group.
        pp_axis_name: name of the pipeline mesh axis.
        pp_schedule: schedule name (decides stages per rank and loop/V placement); None means a CSV runtime
            schedule with loop placement.
        device: device the stages compute on.
        module_names_per_stage: explicit FQN lists per global stage (default: generated from the plan's layer
            split, then passed through the model's `customize_pipeline_stage_modules` hook).
        layers_per_stage / round_to_pp_multiple: upstream's stage-count request (see `plan_pipeline`).
        stages_per_rank: run exactly this many stages per rank (layers split as evenly as possible).
        plan: an already computed `PipelinePlan` (then give none of the stage requests above).
        microbatch_size / seq_len / tensor_dtype: with `seq_len`, stages get static shapes
            `[microbatch_size (default 1), seq_len, ...]` in `tensor_dtype` (default: the stage's parameter dtype).

    Returns:
        (stages, models) for this rank.

    Raises:
        PipelinePlanError (ValueError): every planning problem (see `plan_pipeline`).
        ValueError: a plan for another pipeline size or layer count, shape options without `seq_len`,
            reentrant checkpointing, a model whose own forward the pipeline forwards do not reproduce
            (`check_forward_reproduction`).

    NOTE: call it on every rank of the default process group (SPMD). When tied input/output embeddings land on
    different ranks, the first/last-stage pair groups of all pipeline replicas are created here, collectively.
    """
    if seq_len is None and (microbatch_size is not None or tensor_dtype is not None):
        raise ValueError(
            "microbatch_size and tensor_dtype describe static stage shapes and need seq_len; give seq_len too, or "
            "drop them (shapes are then inferred at the first step)."
        )
    pp_rank, pp_size, group = _pp_rank_size_group(pp_mesh, pp_axis_name)
    check_forward_reproduction(model)  # first: a stage list cannot fix a forward the stages do not reproduce
    layout = find_layers(model)
    explicit = None if module_names_per_stage is None else [list(stage) for stage in module_names_per_stage]
    if plan is None and explicit is not None:
        plan = plan_for_module_names(
            model,
            layout,
            pp_size,
            pp_schedule,
            explicit,
            stages_per_rank=stages_per_rank,
            layers_per_stage=layers_per_stage,
            round_to_pp_multiple=round_to_pp_multiple,
        )
    elif plan is None:
        plan = plan_pipeline(
            layout.num_layers,
            pp_size,
            pp_schedule,
            stages_per_rank=stages_per_rank,
            layers_per_stage=layers_per_stage,
            round_to_pp_multiple=round_to_pp_multiple,
        )
    else:
        _check_given_plan(plan, pp_size, layout.num_layers, stages_per_rank, layers_per_stage, round_to_pp_multiple)
    if explicit is not None:
        names = explicit
    else:  # generated from the plan, then edited by the model's hook: the hook must keep the model whole
        names = _default_module_names(model, plan.stage_layers or (), layout)[0]
        problems = module_names_problems(model, layout, names, explicit=False)
        if problems:
            raise ValueError(
                f"{type(model).__name__}.customize_pipeline_stage_modules returned stage lists that do not run the "
                "model as one: " + " ".join(problems)
            )
    stage_ids = plan.stage_ids(pp_rank)
    models = build_stage_modules(
        model,
        names,
        stage_ids,
        patch_inner_model=patch_inner_model,
        patch_causal_lm_model=patch_causal_lm_model,
    )
    _attach_tied_embedding_copies(model, layout, names, stage_ids, models, plan, group)
    declared = pipeline_output_names(model)
    if declared is not None and output_names_problems(declared):
        raise ValueError(
            f"{type(model).__name__}.pipeline_output_names is invalid: " + "; ".join(output_names_problems(declared))
        )
    device = torch.device(device)
    stages = []
    for stage_id, stage_model in zip(stage_ids, models, strict=True):
        static: dict[str, Any] = {}
        if seq_len is not None:
            inputs, outputs = stage_metas(
                stage_model,
                is_first=stage_id == 0,
                is_last=stage_id == plan.num_stages - 1,
                microbatch_size=microbatch_size or 1,
                seq_len=seq_len,
                dtype=tensor_dtype,
            )
            static = {"input_args": inputs, "output_args": outputs}
        stage = PipelineStage(stage_model, stage_id, plan.num_stages, device, group=group, **static)
        _compat.preserve_grads_across_stage_reinit(stage)
        stage._am_pipeline_plan = plan  # type: ignore[attr-defined]  # build_pipeline_schedule reads it back
        if seq_len is not None:  # checked against every step's inputs (see schedules.check_step_shapes)
            stage._am_static_shape = (microbatch_size or 1, seq_len)  # type: ignore[attr-defined]
        stages.append(stage)
    return stages, models


def _check_given_plan(
    plan: PipelinePlan,
    pp_size: int,
    num_layers: int,
    stages_per_rank: int | None,
    layers_per_stage: int | None,
    round_to_pp_multiple: str | None,
) -> None:
    problems = []
    if plan.pp_size != pp_size:
        problems.append(f"the plan is for {plan.pp_size} pipeline ranks but the pipeline group has {pp_size}")
    if plan.num_layers != num_layers:
        problems.append(f"the plan is for {plan.num_layers} layers but the model has {num_layers}")
    extra = [
        name
        for name, value in (
            ("stages_per_rank", stages_per_rank),
            ("layers_per_stage", layers_per_stage),
            ("round_to_pp_multiple", round_to_pp_multiple),
        )
        if value is not None
    ]
    if extra:
        problems.append(f"{', '.join(extra)} given together with a plan: the plan already fixes the stages")
    if problems:
        raise ValueError("split_model_into_stages(plan=...): " + "; ".join(problems) + ".")


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
    owner = {}
    for fqn in (embed_fqn, head_fqn):
        module_fqn = fqn.rsplit(".", 1)[0]
        owner[fqn] = next(
            (s for s, names in enumerate(names_per_stage) if module_fqn in names),
            None,
        )
    first_stage, last_stage = owner[embed_fqn], owner[head_fqn]
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
