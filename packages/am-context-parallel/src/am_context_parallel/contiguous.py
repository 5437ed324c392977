"""The contiguous CP layout: rank r keeps one contiguous block of every sequence, for models whose contract declares
`cp.layout="contiguous"` (they run their own ring attention on such blocks, e.g. Mamba2's state passing).

What it must not do: communicate (the CP rank comes from the mesh) or shard in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .batch_checks import _refuse_function_in_batch, _validate
from .batch_keys import (
    _add_position_key,
    _ensure_position_ids,
    _padding_mask_from_attention_mask,
    _SeqKey,
    _sequence_keys,
    _shard_keys,
    _synthesize_single_document_seq_ids,
)
from .context import RingAttentionContext
from .layouts import ContiguousLayout
from .mesh import cp_rank
from .model_protocol import ContiguousCPOptions

__all__ = ["ContextFactory", "contiguous_shard"]

ContextFactory = Callable[[], contextlib.AbstractContextManager[Any]]


def contiguous_shard(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None,
    padding_token_id: int,
    *,
    options: ContiguousCPOptions,
    extra_seq_buffers: list[str] | None,
    model: Any,
) -> tuple[ContextFactory, dict[str, Any]]:
    """Contiguous shard: rank r keeps tokens `[r·P/C, (r+1)·P/C)` of every sequence tensor; returns `(ctx, batch)`.

    The generic path of models whose contract declares `cp.layout="contiguous"` (`make_cp_batch_and_ctx(..., model=)`
    calls this with their `cp.options()`; upstream's `make_contiguous_shard_cp_batch_and_ctx` wraps it). Pops
    `attention_mask` (deriving `padding_mask` from it when missing); synthesizes `_packed_seq_ids`
    (`_synthesize_single_document_seq_ids`), and position_ids `arange(S)` when missing and C > 1 or `tp_mesh` has more
    than one rank (upstream's rule; a `[1, S]` tensor is expanded to B); labels come from the batch, else `loss_mask` is
    promoted to labels. Keys sharded: input_ids, inputs_embeds, labels, position_ids (continuing), padding_mask,
    `_packed_seq_ids`, mm_token_type_ids, per_layer_inputs (`[B, S, L, H]`), loss_mask, the model's
    `options.extra_seq_keys` (when present in the batch), and — required when named — upstream's
    `batch["_cp_metadata_seq_dims"]` / `batch["_cp_metadata_pad_values"]` (popped; pad default 0) and
    `extra_seq_buffers` (seq dim 1, padded like `make_cp_batch_and_ctx` pads them). Padded to a multiple of
    `options.pad_multiple · C` (2C by default). No collective.

    Returns:
        For C > 1 a `RingAttentionContext` (contiguous layout, the global positions of the local tokens, the local
        `_packed_seq_ids` as document ids, the lengths; kernel and HF routing from `options`) and the same dict,
        updated; run forward AND backward inside `with ctx():`. For C ≤ 1, `(contextlib.nullcontext, batch)`.

    Raises:
        ValueError: listing every problem with the batch.
    """
    _refuse_function_in_batch(batch)
    seq_dims: dict[str, int] = dict(batch.pop("_cp_metadata_seq_dims", None) or {})
    pad_values: dict[str, Any] = dict(batch.pop("_cp_metadata_pad_values", None) or {})
    if batch.get("labels") is None and loss_mask is not None:
        batch["labels"] = loss_mask
        loss_mask = None
    # upstream's contiguous shard also carries the VLM / per-layer-input keys (per_layer_inputs is [B, S, L, H])
    keys = _sequence_keys(batch, padding_token_id, extra_seq_buffers, "mm_token_type_ids", "per_layer_inputs")
    for key, (dim, pad_value) in options.extra_seq_keys.items():
        keys[key] = _SeqKey(dim, 0, pad_value)
    for key, dim in seq_dims.items():
        keys[key] = _SeqKey(dim, 0, pad_values.get(key, 0))
    _validate(batch, keys, required=[*seq_dims, *(extra_seq_buffers or [])], primary_keys=options.primary_keys)

    attention_mask = batch.pop("attention_mask", None)
    if "padding_mask" not in batch and attention_mask is not None:
        batch["padding_mask"] = _padding_mask_from_attention_mask(attention_mask)
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    assert primary is not None
    cp_size = cp_mesh.size() if cp_mesh is not None else 1
    tp_size = tp_mesh.size() if tp_mesh is not None else 1
    # Upstream's rule: position ids are synthesized when the sequence is sharded (C > 1) or tensor parallel
    # (TP > 1, whose sequence-parallel regions need explicit positions); at C = TP = 1 the model makes its own.
    _ensure_position_ids(batch, primary, synthesize=cp_size > 1 or tp_size > 1)
    _add_position_key(batch, keys)
    _synthesize_single_document_seq_ids(batch)
    layout = ContiguousLayout(
        cp_size=cp_size, cp_rank=cp_rank(cp_mesh) if cp_size > 1 else 0, pad_multiple=options.pad_multiple
    )
    seq_len, padded_len = _shard_keys(batch, keys, layout)
    if cp_size <= 1:
        return contextlib.nullcontext, batch
    ctx = RingAttentionContext(
        group=cp_mesh.get_group(),
        layout=layout,
        positions=layout.local_indices(padded_len, device=primary.device),
        doc_ids=batch["_packed_seq_ids"].long(),
        seq_len=seq_len,
        padded_len=padded_len,
        route_hf_attention=options.route_hf_attention,
        kernel=options.kernel_for(primary.device),
        model=model if options.route_hf_attention else None,
    )
    return ctx, batch
