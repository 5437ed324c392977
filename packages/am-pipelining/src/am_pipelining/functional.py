"""Split an HF-style model into pipeline stages, place them on ranks and build a torch pipeline schedule.

Stages are built by construction, never by tracing: for each local stage the modules the stage does not keep are
detached from the model for the duration of one `copy.deepcopy`, so only the kept parts are copied (nothing is
allocated for a meta-device model) and the original is restored untouched. Layer containers become
`nn.ModuleDict`s keyed by the ORIGINAL layer index, so parameter names stay those of the unsplit model.

Errors that would otherwise surface as hangs (too few microbatches, indivisible batches, more stages than layers,
reentrant checkpointing, non-tensor stage outputs) are raised here, early, as ValueErrors naming the fix.

Model hooks are honoured by duck typing: `customize_pipeline_stage_modules`, `get_pipeline_stage_metas`,
`_pp_keep_self_forward` (and `get_pipeline_kwargs_chunk_dims` in `autopipeline`). Private torch pipelining
internals are reached only through `am_pipelining._compat`.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from am_pipelining import _compat
from am_pipelining.hf_utils import (
    MULTIMODAL_SUFFIXES,
    model_keeps_self_forward,
    patch_hf_model_for_pp,
    statically_defines,
)
from am_pipelining.planning import (
    PipelinePlan,
    calculate_virtual_stages,
    csv_problems,
    min_microbatches,
    plan_pipeline,
    schedule_placement_style,
    split_layers,
    stage_ids_this_rank,
)
from am_pipelining.tied import TiedEmbeddingCopy, pair_group

__all__ = [
    "ParallelizeFnProtocol",
    "stage_ids_this_rank",
    "generate_hf_model_fqn_per_model_part",
    "calculate_virtual_stages",
    "build_stage_modules",
    "split_model_into_stages",
    "build_pipeline_schedule",
    "pipeline_model",
    "stage_metas",
    "schedule_placement_style",
    "min_microbatches",
]

logger = logging.getLogger(__name__)


class ParallelizeFnProtocol(Protocol):
    """What `pipeline_model` calls on each stage module (e.g. to apply FSDP2); may return a new module."""

    def __call__(self, model: nn.Module, **kwargs: Any) -> nn.Module | None: ...


# ------------------------------------------------------------------------------------------------------------
# Placement and stage lists
# ------------------------------------------------------------------------------------------------------------


def generate_hf_model_fqn_per_model_part(
    num_stages: int,
    num_layers: int,
    include_embeddings: bool = True,
    include_lm_head: bool = True,
    include_rotary_emb: bool = True,
    include_multimodal_encoders: bool = True,
    extra_module_fqns: Sequence[str] | None = None,
    fqn_prefix: str = "model.",
    lm_head_fqn: str = "lm_head",
) -> list[list[str]]:
    """Module names kept by each stage: contiguous layer ranges, the first `L % n` stages one layer longer.

    Stage 0 adds the embeddings, multimodal encoders and `extra_module_fqns`; the last stage adds `norm` and
    the LM head; `rotary_emb` (buffers only) is replicated on every stage. Names absent from a model are harmless.

    Raises:
        ValueError: fewer than 1 stage or more stages than layers.
    """
    return _module_names_for_layers(
        split_layers(num_layers, num_stages),
        include_embeddings=include_embeddings,
        include_lm_head=include_lm_head,
        include_rotary_emb=include_rotary_emb,
        include_multimodal_encoders=include_multimodal_encoders,
        extra_module_fqns=extra_module_fqns,
        fqn_prefix=fqn_prefix,
        lm_head_fqn=lm_head_fqn,
    )


def _module_names_for_layers(
    stage_layers: Sequence[Sequence[int]],
    *,
    include_embeddings: bool,
    include_lm_head: bool,
    include_rotary_emb: bool,
    include_multimodal_encoders: bool,
    extra_module_fqns: Sequence[str] | None,
    fqn_prefix: str,
    lm_head_fqn: str,
) -> list[list[str]]:
    names_per_stage: list[list[str]] = []
    last = len(stage_layers) - 1
    for stage, layers in enumerate(stage_layers):
        names: list[str] = []
        if stage == 0:
            if include_embeddings:
                names.append(f"{fqn_prefix}embed_tokens")
            if include_multimodal_encoders:
                names.extend(f"{fqn_prefix}{suffix}" for suffix in MULTIMODAL_SUFFIXES)
            names.extend(extra_module_fqns or ())
        names.extend(f"{fqn_prefix}layers.{i}" for i in layers)
        if stage == last:
            names.append(f"{fqn_prefix}norm")
            if include_lm_head:
                names.append(lm_head_fqn)
        if include_rotary_emb:
            names.append(f"{fqn_prefix}rotary_emb")
        names_per_stage.append(names)
    return names_per_stage


# ------------------------------------------------------------------------------------------------------------
# Model layout
# ------------------------------------------------------------------------------------------------------------

_LAYER_PREFIX_CANDIDATES = (
    "model.language_model.model.",
    "model.language_model.",
    "model.text_model.",
    "model.text_decoder.",
    "model.",
    "language_model.model.",
    "language_model.",
    "backbone.",
    "",
)


def _module_at(model: nn.Module, prefix: str) -> nn.Module | None:
    module: Any = model
    for part in prefix.rstrip(".").split(".") if prefix else []:
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def _layout(model: nn.Module) -> dict[str, Any]:
    """Where the layers, the LM head and the multimodal encoders of `model` live (FQN prefixes)."""
    text_model: Any = None
    for prefix in _LAYER_PREFIX_CANDIDATES:
        text_model = _module_at(model, prefix)
        if text_model is not None and isinstance(getattr(text_model, "layers", None), (nn.ModuleList, nn.ModuleDict)):
            break
    else:
        raise ValueError(
            f"Cannot find the decoder layers of {type(model).__name__}: looked for a ModuleList/ModuleDict `layers` "
            f"under {[p or '<root>' for p in _LAYER_PREFIX_CANDIDATES]}. Pass module_names_per_stage explicitly."
        )
    base = "model." if isinstance(getattr(model, "model", None), nn.Module) else ""
    if isinstance(getattr(model, "lm_head", None), nn.Module):
        lm_head_fqn: str | None = "lm_head"
    elif isinstance(getattr(text_model, "lm_head", None), nn.Module):
        lm_head_fqn = f"{prefix}lm_head"
    else:
        lm_head_fqn = None
    nested = prefix != base
    owner = base if nested else prefix
    extra = [f"{owner}{suffix}" for suffix in MULTIMODAL_SUFFIXES] if nested else []
    return {
        "layers_prefix": prefix,
        "text_model": text_model,
        "num_layers": len(text_model.layers),
        "lm_head_fqn": lm_head_fqn,
        "nested": nested,
        "extra_module_fqns": extra,
        "has_rotary_emb": hasattr(text_model, "rotary_emb"),
    }


def _default_module_names(
    model: Any, stage_layers: Sequence[Sequence[int]], layout: dict[str, Any] | None = None
) -> tuple[list[list[str]], dict[str, Any]]:
    """Module names per stage for a plan's layer split, passed through the model's
    `customize_pipeline_stage_modules` hook."""
    layout = layout if layout is not None else _layout(model)
    names = _module_names_for_layers(
        stage_layers,
        include_embeddings=True,
        include_lm_head=layout["lm_head_fqn"] is not None,
        include_rotary_emb=layout["has_rotary_emb"],
        include_multimodal_encoders=not layout["nested"],
        extra_module_fqns=layout["extra_module_fqns"],
        fqn_prefix=layout["layers_prefix"],
        lm_head_fqn=layout["lm_head_fqn"] or "lm_head",
    )
    if statically_defines(model, "customize_pipeline_stage_modules"):
        customized = model.customize_pipeline_stage_modules(
            names, layers_prefix=layout["layers_prefix"], text_model=layout["text_model"]
        )
        if customized is not None:
            names = [list(stage) for stage in customized]
    return names, layout


def _stage_layers_from_names(names_per_stage: Sequence[Sequence[str]], layout: dict[str, Any]) -> list[list[int]]:
    """The decoder layer indices each explicit stage list keeps (`<prefix>layers` keeps them all)."""
    container = f"{layout['layers_prefix']}layers"
    all_layers = list(range(layout["num_layers"]))
    stage_layers = []
    for names in names_per_stage:
        layers: list[int] = []
        for name in names:
            if name == container:
                layers.extend(all_layers)
            elif name.startswith(container + ".") and name[len(container) + 1 :].isdigit():
                layers.append(int(name[len(container) + 1 :]))
        stage_layers.append(layers)
    return stage_layers


# ------------------------------------------------------------------------------------------------------------
# Building stage modules without copying the whole model
# ------------------------------------------------------------------------------------------------------------


def _has_kept_descendant(fqn: str, keep: set[str]) -> bool:
    prefix = fqn + "."
    return any(name.startswith(prefix) for name in keep)


def _detach_unkept(module: nn.Module, prefix: str, keep: set[str], undo: list[tuple[nn.Module, str, Any]]) -> None:
    """Replace, in place and reversibly, every child of `module` the stage does not keep (see `build_stage_modules`)."""
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        fqn = f"{prefix}{name}"
        if fqn in keep:
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            keys = list(child._modules.keys())
            kept = [k for k in keys if f"{fqn}.{k}" in keep or _has_kept_descendant(f"{fqn}.{k}", keep)]
            replacement = nn.ModuleDict({k: child._modules[k] for k in kept})
            undo.append((module, name, child))
            module._modules[name] = replacement
            for k in kept:
                if f"{fqn}.{k}" not in keep:
                    _detach_unkept(child._modules[k], f"{fqn}.{k}.", keep, undo)
            continue
        if not _has_kept_descendant(fqn, keep):
            undo.append((module, name, child))
            module._modules[name] = None
            continue
        _detach_unkept(child, f"{fqn}.", keep, undo)


def _copy_kept(model: nn.Module, keep: set[str]) -> nn.Module:
    undo: list[tuple[nn.Module, str, Any]] = []
    try:
        _detach_unkept(model, "", keep, undo)
        return copy.deepcopy(model)
    finally:
        for parent, name, child in reversed(undo):
            parent._modules[name] = child


def _check_activation_checkpointing(model: nn.Module) -> None:
    from am_pipelining.hf_utils import _uses_reentrant_checkpointing

    reentrant = _uses_reentrant_checkpointing(model)
    if reentrant:
        raise ValueError(
            f"Reentrant activation checkpointing is enabled on {', '.join(reentrant[:4])}: pipeline stages run "
            "torch.autograd.grad on their inputs, which reentrant checkpointing cannot serve (the stage backward "
            "fails or hangs on stages 1..N-1). Fix: enable checkpointing with use_reentrant=False "
            "(HF: activation_checkpointing_kwargs={'use_reentrant': False}; torch: "
            "checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.NO_REENTRANT))."
        )


def _wrap_stage_forward_to_emit_tensor(stage_model: nn.Module, *, stage_index: int = -1) -> nn.Module:
    """Make the stage return tensors only: `ModelOutput` -> `.logits`; anything else that is not a tensor or a
    tuple of tensors raises a ValueError (it could not travel to the next stage). Idempotent."""
    original = stage_model.forward
    if getattr(original, "_pp_unwraps_model_output", False):
        return stage_model

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        output = original(*args, **kwargs)
        if isinstance(output, torch.Tensor):
            return output
        logits = getattr(output, "logits", None)
        if logits is not None and not isinstance(output, tuple) and hasattr(output, "keys"):
            return logits
        if isinstance(output, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in output):
            return tuple(output)
        described = (
            f"a {type(output).__name__} holding {[type(o).__name__ for o in output]}"
            if isinstance(output, (tuple, list))
            else f"a {type(output).__name__}"
        )
        raise ValueError(
            f"Pipeline stage {stage_index} returned {described}; only tensors (or a tuple of tensors) can travel "
            "between stages. Fix: return masks/caches/metadata as tensors, or rebuild them on each stage "
            "(e.g. causal masks are rebuilt and cached per stage)."
        )

    forward._pp_unwraps_model_output = True  # type: ignore[attr-defined]
    stage_model.forward = forward
    return stage_model


def _find_tied_embedding(model: nn.Module, layout: dict[str, Any]) -> tuple[str, str] | None:
    """(embedding weight FQN, lm_head weight FQN) when they share storage by identity, else None."""
    lm_head_fqn = layout.get("lm_head_fqn")
    if lm_head_fqn is None:
        return None
    embed = _module_at(model, layout["layers_prefix"] + "embed_tokens")
    head = _module_at(model, lm_head_fqn)
    embed_weight = getattr(embed, "weight", None)
    if embed_weight is None or getattr(head, "weight", None) is not embed_weight:
        return None
    return f"{layout['layers_prefix']}embed_tokens.weight", f"{lm_head_fqn}.weight"


def build_stage_modules(
    model: nn.Module,
    module_names_per_stage: Sequence[Sequence[str]],
    stage_ids: Sequence[int],
    *,
    patch_inner_model: bool = True,
    patch_causal_lm_model: bool = True,
) -> list[nn.Module]:
    """One pruned, patched copy of `model` per stage id (no process group needed).

    Only the modules a stage keeps are copied: the others are detached from `model` during the copy and put back
    after, so `model` is unchanged and a meta-device model allocates nothing. In each copy, modules not kept are
    `None`, `ModuleList`s become `ModuleDict`s keyed by the original index strings, and tied weights stay tied
    when both ends are kept.
    """
    _check_activation_checkpointing(model)
    keep_self_forward = model_keeps_self_forward(model)
    stage_models = []
    for stage_id in stage_ids:
        keep = set(module_names_per_stage[stage_id])
        stage_model = _copy_kept(model, keep)
        for module in stage_model.modules():
            module.__dict__.pop("_pp_causal_mask_cache", None)
            module.__dict__.pop("_pp_mask_builds", None)
        if not keep_self_forward:
            patch_hf_model_for_pp(
                stage_model, patch_inner_model=patch_inner_model, patch_causal_lm_model=patch_causal_lm_model
            )
        stage_model._pp_stage_index = stage_id  # type: ignore[assignment]
        _wrap_stage_forward_to_emit_tensor(stage_model, stage_index=stage_id)
        stage_models.append(stage_model)
    return stage_models


# ------------------------------------------------------------------------------------------------------------
# Static stage shapes
# ------------------------------------------------------------------------------------------------------------


def _get_hidden_and_vocab_size(config: Any) -> tuple[int, int]:
    text_config = getattr(config, "text_config", None)
    sizes = []
    for field in ("hidden_size", "vocab_size"):
        value = getattr(config, field, None)
        if value is None and text_config is not None:
            value = getattr(text_config, field, None)
        if value is None:
            raise ValueError(
                f"Cannot determine {field} from {type(config).__name__}. Expected either model_config.{field} or "
                f"model_config.text_config.{field}."
            )
        sizes.append(int(value))
    return sizes[0], sizes[1]


def stage_metas(
    stage_model: Any,
    *,
    is_first: bool,
    is_last: bool,
    microbatch_size: int,
    seq_len: int,
    dtype: torch.dtype | None = None,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Meta tensors describing a stage's input and output, so torch skips its shape-inference round trip.

    A model's `get_pipeline_stage_metas(*, is_first, microbatch_size, seq_len, dtype)` wins when defined.
    Otherwise: first stage input `[mb, S]` int64, others `[mb, S, H]`; output `[mb, S, V]` when the stage has
    an `lm_head` (and does not return hidden states), else `[mb, S, H]`.
    """
    if dtype is None:
        first_param = next(stage_model.parameters(), None)
        dtype = first_param.dtype if first_param is not None else torch.float32
    if statically_defines(stage_model, "get_pipeline_stage_metas"):
        hook_inputs, hook_outputs = stage_model.get_pipeline_stage_metas(
            is_first=is_first, microbatch_size=microbatch_size, seq_len=seq_len, dtype=dtype
        )
        return tuple(hook_inputs), tuple(hook_outputs)
    hidden, vocab = _get_hidden_and_vocab_size(stage_model.config)
    meta = torch.device("meta")
    if is_first:
        inputs: tuple[torch.Tensor, ...] = (torch.empty(microbatch_size, seq_len, dtype=torch.long, device=meta),)
    else:
        inputs = (torch.empty(microbatch_size, seq_len, hidden, dtype=dtype, device=meta, requires_grad=True),)
    has_head = getattr(stage_model, "lm_head", None) is not None and is_last
    returns_hidden = getattr(stage_model, "_pp_return_hidden_states", False) is True
    width = vocab if has_head and not returns_hidden else hidden
    outputs = (torch.empty(microbatch_size, seq_len, width, dtype=dtype, device=meta, requires_grad=True),)
    return inputs, outputs


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
            reentrant checkpointing.

    NOTE: call it on every rank of the default process group (SPMD). When tied input/output embeddings land on
    different ranks, the first/last-stage pair groups of all pipeline replicas are created here, collectively.
    """
    pp_rank, pp_size, group = _pp_rank_size_group(pp_mesh, pp_axis_name)
    if seq_len is None and (microbatch_size is not None or tensor_dtype is not None):
        raise ValueError(
            "microbatch_size and tensor_dtype describe static stage shapes and need seq_len; give seq_len too, or "
            "drop them (shapes are then inferred at the first step)."
        )
    layout = _layout(model)
    explicit = None if module_names_per_stage is None else [list(stage) for stage in module_names_per_stage]
    if plan is None:
        plan = plan_pipeline(
            layout["num_layers"],
            pp_size,
            pp_schedule,
            stages_per_rank=stages_per_rank,
            layers_per_stage=layers_per_stage,
            round_to_pp_multiple=round_to_pp_multiple,
            stage_layers=None if explicit is None else _stage_layers_from_names(explicit, layout),
            option_labels={"stage_layers": "module_names_per_stage"},
        )
    else:
        _check_given_plan(plan, pp_size, layout["num_layers"], stages_per_rank, layers_per_stage, round_to_pp_multiple)
    names = explicit if explicit is not None else _default_module_names(model, plan.stage_layers or (), layout)[0]
    stage_ids = plan.stage_ids(pp_rank)
    models = build_stage_modules(
        model,
        names,
        stage_ids,
        patch_inner_model=patch_inner_model,
        patch_causal_lm_model=patch_causal_lm_model,
    )
    _attach_tied_embedding_copies(model, layout, names, stage_ids, models, plan, group)
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
    layout: dict[str, Any],
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
    return schedule


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
) -> tuple[Any, list[nn.Module], bool, bool, list[PipelineStage]]:
    """Plan, split, parallelize each stage module (e.g. FSDP2 over the dp axes), and build the schedule.

    The whole layout is planned first (`plan_pipeline`: stages, layers, placement, microbatches), so a request
    that cannot run is refused before any collective. `stages_per_rank` runs exactly that many stages per rank.

    Returns:
        (schedule, model_parts, has_first_stage, has_last_stage, stages) for this rank.

    Raises:
        ValueError: the pipeline axis has size 1, or any error of `split_model_into_stages` /
            `build_pipeline_schedule`.
    """
    names = getattr(world_mesh, "mesh_dim_names", None)
    pp_mesh = world_mesh[pp_axis_name] if names is not None and len(names) > 1 else world_mesh
    pp_size = pp_mesh.size() if hasattr(pp_mesh, "size") else dist.get_world_size(pp_mesh)
    if pp_size <= 1:
        raise ValueError(f"Pipeline parallelism is not enabled: the {pp_axis_name!r} mesh axis has size {pp_size}.")
    # With a CSV, the schedule name (if any) still decides stages per rank and placement; without one, the CSV
    # runtime's defaults apply (2 stages per rank, loop placement).
    layout = _layout(model)
    explicit = None if module_fqns_per_model_part is None else [list(s) for s in module_fqns_per_model_part]
    plan = plan_pipeline(
        layout["num_layers"],
        pp_size,
        pipeline_parallel_schedule,
        csv=pipeline_parallel_schedule_csv,
        stages_per_rank=stages_per_rank,
        layers_per_stage=layers_per_stage,
        round_to_pp_multiple=round_to_pp_multiple,
        stage_layers=None if explicit is None else _stage_layers_from_names(explicit, layout),
        local_batch_size=local_batch_size,
        microbatch_size=microbatch_size,
        option_labels={"stage_layers": "module_fqns_per_model_part"},
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
