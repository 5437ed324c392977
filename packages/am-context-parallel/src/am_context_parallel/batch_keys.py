"""The sequence tensors of a CP batch: which keys are sharded, their pad values, and the keys synthesized before
sharding (position ids, document ids, the padding mask).

What it is for: one table of keys and pad values for both layouts (`batch.py`'s load-balanced path and
`contiguous.py`), so the two pad the same key the same way. What it must not do: check the batch (`batch_checks.py`
does, before anything changes here) or communicate.

Padding (to a multiple of 2C): input_ids → `padding_token_id`, labels → −100, padding_mask → True,
attention_mask → False, `_packed_seq_ids` → 0, loss_mask → 0, floats → 0, position_ids continue `last+1, ...`
(3-D mRoPE position ids `[3, B, S]` carry the sequence on dim 2), model-supplied keys with their own pad values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .layouts import Layout

_PRIMARY_KEYS = ("input_ids", "inputs_embeds")


@dataclass(frozen=True)
class _SeqKey:
    seq_dim: int
    batch_dim: int
    pad_value: Any


def _position_seq_dim(position_ids: torch.Tensor) -> int:
    return 2 if position_ids.dim() == 3 else 1


def _sequence_keys(
    batch: dict[str, Any], padding_token_id: int, extra_seq_buffers: list[str] | None, *model_keys: str
) -> dict[str, _SeqKey]:
    """The keys both paths pad and shard (with upstream's pad values), `model_keys` (pad 0), the batch's position
    ids (continuing, `[3, B, S]` mRoPE on dim 2) and every present `extra_seq_buffers` key."""
    keys = {
        "input_ids": _SeqKey(1, 0, padding_token_id),
        "inputs_embeds": _SeqKey(1, 0, 0),
        "labels": _SeqKey(1, 0, -100),
        "padding_mask": _SeqKey(1, 0, True),
        "_packed_seq_ids": _SeqKey(1, 0, 0),
        "loss_mask": _SeqKey(1, 0, 0),
        **{key: _SeqKey(1, 0, 0) for key in model_keys},
    }
    _add_position_key(batch, keys)
    # the keys above keep their pad values; any other buffer (an attention_mask included) pads with False / 0
    for key in extra_seq_buffers or []:
        if isinstance(batch.get(key), torch.Tensor):
            keys.setdefault(key, _SeqKey(1, 0, False if batch[key].dtype == torch.bool else 0))
    return keys


def _add_position_key(batch: dict[str, Any], keys: dict[str, _SeqKey]) -> None:
    if isinstance(batch.get("position_ids"), torch.Tensor):
        seq_dim = _position_seq_dim(batch["position_ids"])
        keys["position_ids"] = _SeqKey(seq_dim, seq_dim - 1, "continue")


def _padding_mask_from_attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """`[B, S]` True = pad, from a 2-D keep-mask or a 4-D `[B, 1, S, S]` mask (its diagonal)."""
    if mask.dim() == 4:
        diagonal = torch.diagonal(mask[:, 0], dim1=-2, dim2=-1)
        return ~diagonal if diagonal.dtype == torch.bool else diagonal != 0
    return ~mask.bool()


def _synthesize_single_document_seq_ids(batch: dict[str, Any]) -> None:
    """Add `_packed_seq_ids` `[B, S]` when missing: 1 for real tokens, 0 for padding (or all ones).

    Collators emit `_packed_seq_ids` only for rows with two or more packed documents, but the ring mask always
    needs document boundaries (0 marks padding that nothing attends to).
    """
    if "_packed_seq_ids" in batch:
        return
    if "padding_mask" in batch:
        batch["_packed_seq_ids"] = (~batch["padding_mask"].bool()).long()
        return
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    if primary is None:
        return
    batch["_packed_seq_ids"] = torch.ones(primary.shape[:2], dtype=torch.long, device=primary.device)


def _ensure_position_ids(batch: dict[str, Any], primary: torch.Tensor, *, synthesize: bool = True) -> None:
    """Expand `[1, S]` position ids to `[B, S]`; when missing, add `arange(S)` if `synthesize` (never overrides:
    packed sequences carry their own)."""
    b, s = primary.shape[0], primary.shape[1]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        if synthesize:
            batch["position_ids"] = torch.arange(s, device=primary.device).unsqueeze(0).expand(b, s).contiguous()
    elif position_ids.dim() == 2 and position_ids.shape[0] == 1 and b > 1:
        batch["position_ids"] = position_ids.expand(b, -1).contiguous()


def _shard_keys(batch: dict[str, Any], keys: dict[str, _SeqKey], layout: Layout) -> tuple[int, int]:
    """Pad and shard every key in `keys` (out of place), writing the local tensors back into `batch`."""
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    assert primary is not None
    seq_len = primary.shape[1]
    padded_len = layout.padded_length(seq_len)
    for key, spec in keys.items():
        if batch.get(key) is not None:
            batch[key] = layout.shard(batch[key], seq_dim=spec.seq_dim, pad_value=spec.pad_value)
    return seq_len, padded_len


def _doc_ids_for_ring(batch: dict[str, Any], padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Full-length `[B, S]` document ids for the ring mask, or None when every token is one real document."""
    if batch.get("_packed_seq_ids") is not None:
        return batch["_packed_seq_ids"].long()
    if padding_mask is not None:
        return (~padding_mask.bool()).long()
    return None
