"""Upstream import path (`...pipelining.functional`): the stage-splitting and schedule-building API, re-exported.

The code lives in modules with one job each: `planning` (the plan: stage counts, layer splits, placement,
microbatches), `stage_modules` (pruned stage modules, static shapes), `stages` (splitting into `PipelineStage`s) and
`schedules` (`build_pipeline_schedule`, `pipeline_model`, and upstream's private stage-metadata helper names).
Nothing is defined here.
"""

from __future__ import annotations

from .planning import (
    calculate_virtual_stages,
    min_microbatches,
    schedule_placement_style,
    stage_ids_this_rank,
)
from .schedules import (
    ParallelizeFnProtocol,
    _precompute_stage_shapes,
    _preserve_grads_across_stage_reinit,
    _set_stage_metas,
    build_pipeline_schedule,
    pipeline_model,
    precompute_stage_shapes,
    reset_pp_stage_shapes,
    scale_grads_by_divisor,
)
from .stage_modules import (
    _get_hidden_and_vocab_size,
    _wrap_stage_forward_to_emit_tensor,
    build_stage_modules,
    stage_metas,
)
from .stages import generate_hf_model_fqn_per_model_part, split_model_into_stages

__all__ = [
    "ParallelizeFnProtocol",
    "stage_ids_this_rank",
    "generate_hf_model_fqn_per_model_part",
    "calculate_virtual_stages",
    "build_stage_modules",
    "split_model_into_stages",
    "build_pipeline_schedule",
    "pipeline_model",
    "reset_pp_stage_shapes",
    "scale_grads_by_divisor",
    "stage_metas",
    "schedule_placement_style",
    "min_microbatches",
    "precompute_stage_shapes",
    # upstream's private stage-metadata helpers (thin names)
    "_get_hidden_and_vocab_size",
    "_wrap_stage_forward_to_emit_tensor",
    "_set_stage_metas",
    "_precompute_stage_shapes",
    "_preserve_grads_across_stage_reinit",
]
