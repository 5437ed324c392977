"""Convert padded BSHD batches to packed THD form (one token dimension plus cumulative sequence lengths), and shard it.

What it is for: `process_input_for_thd` and `split_batch_into_thd_chunks`, the inputs of Transformer Engine's THD
attention, and `make_cp_batch_for_te`, the THD CP shard (the packed layout, `PackedLayout`, per sequence). Pure
tensor reshaping on one process (the CP rank comes from the mesh).
What it must not do: import transformer_engine, or communicate.

A row of `[B, S]` holds one or more packed sequences; `seq_lens` `[B, n]` gives their real lengths and
`seq_lens_padded` `[B, n]` their padded extents (rows right-padded with the sentinel −1000). Example: seq_lens
`[[3, 2], [6, −1000]]`, seq_lens_padded `[[4, 2], [6, −1000]]` → cu_seqlens `[0, 3, 5, 11]`, cu_seqlens_padded
`[0, 4, 6, 12]`, max_seqlen 6.
"""

from __future__ import annotations

from typing import Any

import torch

from .layouts import PackedLayout
from .mesh import cp_rank

__all__ = ["make_cp_batch_for_te", "process_input_for_thd", "split_batch_into_thd_chunks"]

# Keys this module reshapes; everything else passes through unchanged.
_FLAT_KEYS = ("input_ids", "labels", "padding_mask", "loss_mask")


def _lengths(rows: torch.Tensor, sentinel: int) -> torch.Tensor:
    flat = rows.reshape(-1).to(torch.int64)
    return flat[flat != sentinel]


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths.cpu(), 0)]).to(torch.int32)


def _positions_restarting(cu_padded: torch.Tensor, total: int) -> torch.Tensor:
    # Each packed sequence counts from 0 across its padded extent.
    starts = torch.repeat_interleave(cu_padded[:-1].long(), (cu_padded[1:] - cu_padded[:-1]).long())
    return torch.arange(total) - starts


def process_input_for_thd(
    batch: dict[str, Any], seq_lens_padding_value: int = -1000, padding_token_id: int = 0
) -> dict[str, Any]:
    """Flatten a `[B, S]` batch into THD form: `[T]` tokens (T = B·S) and cumulative sequence lengths.

    Reads input_ids `[B, S]` (or inputs_embeds `[B, S, H]` → `[T, H]`), labels, position_ids (`[B, S]` → `[T]`,
    mRoPE `[3, B, S]` → `[3, 1, T]`; missing → restarting at every packed sequence), padding_mask/loss_mask,
    seq_lens and seq_lens_padded (consumed; missing seq_lens → one sequence per row). attention_mask is dropped:
    sequence boundaries now live in cu_seqlens.

    Returns a new dict with the flattened tensors, `cu_seqlens` (int32, from the real lengths), `cu_seqlens_padded`
    (int32, dropped when padding sits only at the very end, in which case the last cu_seqlens entry is extended to
    T), `max_seqlen` (int32 scalar tensor, the longest segment of cu_seqlens), `padding_mask` (`input_ids ==
    padding_token_id`) and `qkv_format = "thd"`.
    """
    primary = "input_ids" if "input_ids" in batch else "inputs_embeds"
    if primary not in batch:
        raise KeyError("process_input_for_thd needs 'input_ids' [B, S] or 'inputs_embeds' [B, S, H] in the batch")
    tokens = batch[primary]
    b, s = tokens.shape[0], tokens.shape[1]
    total = b * s
    seq_lens = batch.get("seq_lens")
    if seq_lens is None:
        seq_lens = torch.full((b, 1), s, dtype=torch.int64)
    seq_lens_padded = batch.get("seq_lens_padded", seq_lens)
    real = _lengths(seq_lens, seq_lens_padding_value)
    padded = _lengths(seq_lens_padded, seq_lens_padding_value)
    cu_seqlens = _cumulative(real)
    cu_seqlens_padded: torch.Tensor | None = _cumulative(padded)
    assert cu_seqlens_padded is not None
    if cu_seqlens.numel() == cu_seqlens_padded.numel() and torch.equal(cu_seqlens[:-1], cu_seqlens_padded[:-1]):
        # Padding only after the last sequence: one unpadded stream whose last sequence absorbs the tail.
        cu_seqlens = cu_seqlens.clone()
        cu_seqlens[-1] = total
        cu_seqlens_padded = None

    out: dict[str, Any] = {
        key: value for key, value in batch.items() if key not in {"seq_lens", "seq_lens_padded", "attention_mask"}
    }
    out[primary] = tokens.reshape(total, *tokens.shape[2:])
    for key in _FLAT_KEYS:
        if key in batch and key != primary and isinstance(batch[key], torch.Tensor):
            out[key] = batch[key].reshape(total)
    position_ids = batch.get("position_ids")
    if position_ids is None:
        boundaries = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        out["position_ids"] = _positions_restarting(boundaries, total).to(tokens.device)
    elif position_ids.dim() == 3:
        out["position_ids"] = position_ids.reshape(position_ids.shape[0], 1, total)
    else:
        out["position_ids"] = position_ids.expand(b, s).reshape(total)
    if primary == "input_ids":
        out["padding_mask"] = out["input_ids"] == padding_token_id
    out["cu_seqlens"] = cu_seqlens.to(tokens.device)
    if cu_seqlens_padded is not None:
        out["cu_seqlens_padded"] = cu_seqlens_padded.to(tokens.device)
    else:
        out.pop("cu_seqlens_padded", None)
    out["max_seqlen"] = (cu_seqlens[1:] - cu_seqlens[:-1]).max().to(torch.int32)
    out["qkv_format"] = "thd"
    return out


def _batch_dim(key: str, value: torch.Tensor) -> int:
    return 1 if key == "position_ids" and value.dim() == 3 else 0


def split_batch_into_thd_chunks(
    batch: dict[str, Any], num_chunks: int, seq_lens_padding_value: int = -1000, padding_token_id: int = 0
) -> dict[str, Any]:
    """Split the batch dim into `num_chunks` equal chunks, convert each with `process_input_for_thd`, and stack.

    num_chunks ≤ 1 is `process_input_for_thd`. Stacked tensors get a leading `[num_chunks]` dim; ragged
    `cu_seqlens` / `cu_seqlens_padded` rows are right-padded with `seq_lens_padding_value`.

    Raises:
        ValueError: when the batch size is not divisible by `num_chunks`.
    """
    if num_chunks <= 1:
        return process_input_for_thd(batch, seq_lens_padding_value, padding_token_id)
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    if primary is None:
        raise KeyError("split_batch_into_thd_chunks needs 'input_ids' or 'inputs_embeds' in the batch")
    b = primary.shape[0]
    if b % num_chunks != 0:
        raise ValueError(
            f"batch size {b} is not divisible by num_chunks={num_chunks}; use a batch size that is a multiple of it"
        )
    size = b // num_chunks
    chunks = []
    for index in range(num_chunks):
        part = {
            key: value.narrow(_batch_dim(key, value), index * size, size)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[_batch_dim(key, value)] == b
            else value
            for key, value in batch.items()
        }
        chunks.append(process_input_for_thd(part, seq_lens_padding_value, padding_token_id))
    if any("cu_seqlens_padded" in c for c in chunks):
        for c in chunks:
            # A chunk padded only at its end dropped the padded variant; its extended cu_seqlens is the same thing.
            c.setdefault("cu_seqlens_padded", c["cu_seqlens"])
    # every chunk has the same shapes but for the ragged cu_seqlens rows, right-padded with the sentinel
    return {
        key: _stack_ragged([c[key] for c in chunks], seq_lens_padding_value)
        if isinstance(first, torch.Tensor)
        else first
        for key, first in chunks[0].items()
    }


def make_cp_batch_for_te(
    cp_mesh: Any,
    batch: dict[str, Any],
    qkv_format: str = "thd",
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
) -> dict[str, Any]:
    """THD batch for Transformer Engine's CP attention: convert to THD, then keep this rank's per-sequence head-tail.

    The partition is `PackedLayout` (TE's `thd_get_partitioned_indices`, in torch). Output: int64 input_ids, labels,
    position_ids; `cu_seqlens` = the GLOBAL padded cumulative lengths (int32; TE divides by C itself), `max_seqlen`
    (int32), `padding_mask = input_ids == padding_token_id`, `qkv_format`, `cp_size`, `cp_rank`. For
    `num_chunks > 1` the per-chunk results are stacked on a leading dim.

    Raises:
        ValueError: for a format other than "thd", or padded sequence lengths not divisible by 2C.
    """
    if qkv_format != "thd":
        raise ValueError(f"Currently only 'thd' format is supported, got: {qkv_format}")
    thd = split_batch_into_thd_chunks(batch, num_chunks, seq_lens_padding_value, padding_token_id)
    cp_size = cp_mesh.size() if cp_mesh is not None else 1
    if cp_size <= 1:
        return thd
    rank = cp_rank(cp_mesh)
    if num_chunks <= 1:
        return _shard_thd_chunk(thd, cp_size, rank, padding_token_id, seq_lens_padding_value)
    chunks = []
    for index in range(num_chunks):
        chunk = {k: (v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in thd.items()}
        chunks.append(_shard_thd_chunk(chunk, cp_size, rank, padding_token_id, seq_lens_padding_value))
    out = dict(chunks[0])
    for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "padding_mask"):
        if key in chunks[0]:
            out[key] = _stack_ragged([c[key] for c in chunks], seq_lens_padding_value)
    return out


def _stack_ragged(values: list[torch.Tensor], fill: int) -> torch.Tensor:
    if values[0].dim() == 0 or all(v.shape == values[0].shape for v in values):
        return torch.stack(values)
    width = max(v.shape[-1] for v in values)
    return torch.stack([torch.cat([v, v.new_full((width - v.shape[-1],), fill)]) for v in values])


def _shard_thd_chunk(
    thd: dict[str, Any], cp_size: int, rank: int, padding_token_id: int, sentinel: int
) -> dict[str, Any]:
    cu = thd.get("cu_seqlens_padded", thd.get("cu_seqlens"))
    if cu is None:
        raise ValueError(
            "BSHD format is not supported by the THD CP path: 'cu_seqlens' (and 'cu_seqlens_padded' when sequences "
            "are padded) must be present; convert the batch with process_input_for_thd first"
        )
    cu = cu[cu != sentinel].to(torch.int64)
    layout = PackedLayout(cp_size=cp_size, cp_rank=rank, cu_seqlens_padded=cu)
    out = {k: v for k, v in thd.items() if k != "cu_seqlens_padded"}
    for key in ("input_ids", "labels", "position_ids", "padding_mask"):
        value = thd.get(key)
        if isinstance(value, torch.Tensor):
            out[key] = layout.shard(value, seq_dim=-1)
            if key != "padding_mask":
                out[key] = out[key].long()
    if isinstance(out.get("input_ids"), torch.Tensor):
        out["padding_mask"] = out["input_ids"] == padding_token_id
    out["cu_seqlens"] = cu.to(torch.int32)
    out["max_seqlen"] = (cu[1:] - cu[:-1]).max().to(torch.int32)
    out["qkv_format"] = "thd"
    out["cp_size"] = cp_size
    out["cp_rank"] = rank
    return out
