"""NeMo AutoModel's private stage-metadata helper names (`pipelining.functional`), as thin names over this package.

What it is for: code written against upstream's `functional` helpers keeps working with upstream's calling
conventions: `_get_hidden_and_vocab_size(config)`, `_wrap_stage_forward_to_emit_tensor(stage_model)`,
`_set_stage_metas(stage, inputs_meta, outputs_meta)`, `_precompute_stage_shapes(stages, model_config,
microbatch_size, seq_len, tensor_dtype=None)` and `_preserve_grads_across_stage_reinit(stages)`. Every public name
upstream's `functional`, `hf_utils`, `autopipeline` and `loss.mtp` document is at the package root instead.
The names keep upstream's leading underscore, so they are imported by name and not listed in an `__all__`.

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
    """(hidden_size, vocab_size) of `config`, each from `config.text_config` when the top level lacks it.

    Raises:
        ValueError: "Cannot determine hidden_size from <Type>. ..." (hidden first, then vocab).
    """
    return _hidden_and_vocab_size(config)


def _wrap_stage_forward_to_emit_tensor(stage_model: nn.Module) -> nn.Module:
    """Make `stage_model.forward` return `output.logits` for a `ModelOutput`; tensors and tuples pass. Idempotent."""
    return _emit_tensors_only(stage_model)


def _set_stage_metas(stage: Any, inputs_meta: tuple[torch.Tensor, ...], outputs_meta: tuple[torch.Tensor, ...]) -> None:
    """Give one `PipelineStage` static input/output meta tensors.

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
    """Static shapes for stages built without them (`_set_static_shapes`); on a torch whose stages take no static
    metadata, log and leave the shapes to torch's inference, as upstream does."""
    if not all(_compat.has_static_meta_api(stage) for stage in stages):
        logger.info("PipelineStage takes no static metadata in torch %s; shapes are inferred", torch.__version__)
        return
    _set_static_shapes(
        stages, microbatch_size=microbatch_size, seq_len=seq_len, dtype=tensor_dtype, config=model_config
    )


def _preserve_grads_across_stage_reinit(stages: Sequence[Any]) -> None:
    """Keep accumulated gradients when the schedule re-initializes each stage in static mode (stages without
    torch's cleanup hook are skipped). Idempotent."""
    for stage in stages:
        _compat.preserve_grads_across_stage_reinit(stage)
