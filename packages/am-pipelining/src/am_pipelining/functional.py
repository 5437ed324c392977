"""Upstream import path (`...pipelining.functional`): the stage-splitting and schedule-building API, re-exported.

The code lives in modules with one job each: `planning` (the plan: stage counts, layer splits, placement,
microbatches), `stage_modules` (pruned stage modules, static shapes), `stages` (splitting into `PipelineStage`s) and
`schedules` (`build_pipeline_schedule`, `pipeline_model`). Besides the re-exports, only upstream's private
stage-metadata helper names are defined here, each a thin name over the function that does the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import _compat
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
