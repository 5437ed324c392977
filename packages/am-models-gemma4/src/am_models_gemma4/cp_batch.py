"""Model-owned contiguous CP shard for Gemma 4 (the seed name) and the ring context our layers read.

What it is for: `make_contiguous_shard_cp_batch_and_ctx` keeps upstream's name and contract — rank r keeps tokens
`[r·P/C, (r+1)·P/C)` of every sequence tensor, padded to a multiple of 2C, `(nullcontext, batch)` — by delegating
to am-context-parallel's generic contiguous shard. `make_gemma4_cp_batch_and_ctx` does the same shard and returns
a `RingAttentionContext` describing it (global positions of the local tokens, packed-document ids, lengths) that
our attention layers use while it is entered; it does not route transformers' attention (the vision tower keeps
its own attention on the full image).
What it must not do: communicate (the CP rank comes from the mesh), or shard anything the generic shard does not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from am_context_parallel import ContiguousLayout, RingAttentionContext
from am_context_parallel import make_contiguous_shard_cp_batch_and_ctx as _generic_contiguous_shard
from am_models_gemma4.kernels import default_ring_kernel

__all__ = ["make_contiguous_shard_cp_batch_and_ctx", "make_gemma4_cp_batch_and_ctx"]

ContextFactory = Callable[[], contextlib.AbstractContextManager[Any]]


def make_contiguous_shard_cp_batch_and_ctx(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
) -> tuple[ContextFactory, dict[str, Any]]:
    """Contiguous shard of `batch` for `cp_mesh` (upstream's Gemma 4 seed); returns `(nullcontext, batch)`.

    See `am_context_parallel.make_contiguous_shard_cp_batch_and_ctx` for the keys, pad values and errors: labels
    are required (or `loss_mask` promoted to labels), `attention_mask` becomes `padding_mask`, `_packed_seq_ids` is
    synthesized when missing, position_ids continue through the padding.
    """
    return _generic_contiguous_shard(cp_mesh, tp_mesh, batch, loss_mask=loss_mask, padding_token_id=padding_token_id)


def _cp_rank(group: Any) -> int:
    return dist.get_rank(group=group) if dist.is_available() and dist.is_initialized() else 0


def make_gemma4_cp_batch_and_ctx(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
) -> tuple[ContextFactory, dict[str, Any]]:
    """Contiguous shard plus the `RingAttentionContext` our layers read (forward AND backward inside `with ctx():`).

    The context's per-chunk kernel is `default_ring_kernel` (block-sparse; torch's fused flash op on the CPU); set
    `ctx.kernel` to any `AttentionKernel` to change it.

    Returns `(nullcontext, batch)` unchanged-in-spirit when there is no CP mesh or it has one rank (the shard then
    only adds position ids, document ids and padding_mask).
    """
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    seq_len = int(primary.shape[1]) if isinstance(primary, torch.Tensor) and primary.dim() >= 2 else 0
    _, batch = make_contiguous_shard_cp_batch_and_ctx(
        cp_mesh, tp_mesh, batch, loss_mask=loss_mask, padding_token_id=padding_token_id
    )
    cp_size = cp_mesh.size() if cp_mesh is not None else 1
    if cp_size <= 1:
        return contextlib.nullcontext, batch
    group = cp_mesh.get_group()
    local = batch.get("input_ids", batch.get("inputs_embeds"))
    assert isinstance(local, torch.Tensor)
    padded_len = int(local.shape[1]) * cp_size
    layout = ContiguousLayout(cp_size=cp_size, cp_rank=_cp_rank(group))
    ctx = RingAttentionContext(
        group=group,
        layout=layout,
        positions=layout.local_indices(padded_len, device=local.device),
        doc_ids=batch["_packed_seq_ids"].long(),
        seq_len=seq_len,
        padded_len=padded_len,
        route_hf_attention=False,
        kernel=default_ring_kernel(local.device),
    )
    return ctx, batch
