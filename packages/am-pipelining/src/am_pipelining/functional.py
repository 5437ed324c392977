"""Upstream import path (`...pipelining.functional`): the stage-splitting and schedule-building API, re-exported.

The code lives in modules with one job each: `planning` (the plan: stage counts, layer splits, placement,
microbatches), `stage_modules` (pruned stage modules, static shapes), `stages` (splitting into `PipelineStage`s) and
`schedules` (`build_pipeline_schedule`, `pipeline_model`). Nothing is defined here.
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
    build_pipeline_schedule,
    pipeline_model,
    reset_pp_stage_shapes,
    scale_grads_by_divisor,
)
from .stage_modules import build_stage_modules, stage_metas
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
]
