"""NeMo AutoModel's private stage-metadata helpers (`pipelining.functional`), as thin names over this package.

Upstream's calling conventions: `_get_hidden_and_vocab_size(config)`, `_wrap_stage_forward_to_emit_tensor(
stage_model)`, `_set_stage_metas(stage, inputs_meta, outputs_meta)`, `_precompute_stage_shapes(stages, model_config,
microbatch_size, seq_len, tensor_dtype=None)`, `_preserve_grads_across_stage_reinit(stages)`. They keep upstream's
leading underscore, so they are imported by name (no `__all__`). Upstream's public names are at the package root.
What it must not do: hold a second implementation of anything, or be imported by the rest of the package.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import _compat
from .stage_modules import _emit_tensors_only, _hidden_and_vocab_size
from .stages import _set_static_shapes

logger = logging.getLogger(__name__)


def _get_hidden_and_vocab_size(config: Any) -> tuple[int, int]:
    """(hidden_size, vocab_size), each from `config.text_config` when the top level lacks it (else ValueError)."""
    return _hidden_and_vocab_size(config)


def _wrap_stage_forward_to_emit_tensor(stage_model: nn.Module) -> nn.Module:
    """Make `stage_model` return `output.logits` for a `ModelOutput` (a forward hook, not a rebound forward); tensors
    and tuples pass. Idempotent."""
    return _emit_tensors_only(stage_model)


def _set_stage_metas(stage: Any, inputs_meta: tuple[torch.Tensor, ...], outputs_meta: tuple[torch.Tensor, ...]) -> None:
    """Static input/output meta tensors for one stage ("Unsupported PipelineStage metadata API" RuntimeError)."""
    _compat.set_stage_metas(stage, tuple(inputs_meta), tuple(outputs_meta))


def _precompute_stage_shapes(
    stages: Sequence[Any],
    model_config: Any,
    microbatch_size: int,
    seq_len: int,
    tensor_dtype: torch.dtype | None = None,
) -> None:
    """Static shapes for stages built without them; on a torch whose stages take none, log and leave them to torch."""
    if not all(_compat.has_static_meta_api(stage) for stage in stages):
        logger.info("PipelineStage takes no static metadata in torch %s; shapes are inferred", torch.__version__)
        return
    _set_static_shapes(
        stages, microbatch_size=microbatch_size, seq_len=seq_len, dtype=tensor_dtype, config=model_config
    )


def _preserve_grads_across_stage_reinit(stages: Sequence[Any]) -> None:
    """Keep accumulated gradients when a schedule re-initializes stages in static mode (others skipped)."""
    for stage in stages:
        _compat.preserve_grads_across_stage_reinit(stage)
