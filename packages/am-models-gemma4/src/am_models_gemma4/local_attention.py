"""Attention over the tokens one device holds: SDPA, and a blocked SDPA for long sequences on sliding layers.

What it is for: `local_attention` is the non-CP attention of `Gemma4Attention` (training, prefill, pipeline stages
with transformers' masks). On a sliding layer with a sequence longer than twice the window it cuts the queries into
blocks of `window_block(window)` tokens and runs ONE SDPA call over all blocks, each against only the keys its window
reaches (`window_block_mask`; overlapping K/V windows are strided views): about block + window keys per query
instead of S, the same result.
What it must not do: communicate (the ring under context parallelism is am-context-parallel's, see `cp.py`), or
build the per-forward masks (`masks.py` does, once per layer type).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["local_attention", "window_block", "window_block_mask"]


def window_block(window: int) -> int:
    """Queries per block of the sliding-window path (each block reads `_window_keys(window, block)` keys)."""
    return max(min(window // 2, 32), 1)


def _window_keys(window: int, block: int) -> int:
    """Keys per query block: the `block + window - 1` it can see, rounded up to whole blocks (aligned windows)."""
    return -(-(block + window - 1) // block) * block


def window_block_mask(mask: torch.Tensor, *, window: int, block: int) -> torch.Tensor:
    """Additive float mask `[B·n, 1, block, keys]` of every query block against its key window.

    `mask` is the boolean `[B or 1, 1, S, S]` mask; block n covers queries `[n·block, (n+1)·block)` and keys
    `[(n+1)·block - keys, (n+1)·block)` with `keys = _window_keys(window, block)` (keys before 0 and past S are
    masked out; the query rows past S, which are dropped afterwards, see every key so that their softmax stays
    finite).
    """
    batch, seq = mask.shape[0], mask.shape[-1]
    blocks = -(-seq // block)
    padded_len = blocks * block
    keys = _window_keys(window, block)
    front = keys - block
    full = F.pad(mask[:, 0], (front, padded_len - seq), value=False)
    full = F.pad(full, (0, 0, 0, padded_len - seq), value=True).contiguous()  # [B, P, front + P]
    row = full.shape[-1]
    windows = full.as_strided(
        (batch, blocks, block, keys), (full.stride(0), block * row + block, row, 1), full.storage_offset()
    )
    additive = torch.zeros(windows.shape, dtype=torch.float32, device=mask.device)
    additive.masked_fill_(~windows, float("-inf"))
    return additive.reshape(batch * blocks, 1, block, keys)


class _KeyWindows(torch.autograd.Function):
    """`[B, H, S, d]` → the overlapping block-aligned key windows `[B·n, H, keys, d]` (a strided view for B = 1).

    Window n is rows `[n·block - front, (n+1)·block)` of the sequence padded with `front = keys - block` zero rows
    in front (and to a whole number of blocks at the end). The backward adds each of the `keys / block` block
    columns of the window gradients onto the padded gradient (one strided add each) instead of torch's generic
    `unfold_backward`.
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, keys: int, block: int) -> torch.Tensor:
        batch, heads, seq, dim = t.shape
        blocks = -(-seq // block)
        front = keys - block
        padded = F.pad(t, (0, 0, front, blocks * block - seq))  # [B, H, front + P, d]
        windows = padded.unfold(2, keys, block)  # [B, H, n, d, keys]
        ctx.shape = (batch, heads, seq, dim, blocks, front)
        ctx.keys, ctx.block = keys, block
        return windows.permute(0, 2, 1, 4, 3).reshape(batch * blocks, heads, keys, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        batch, heads, seq, dim, blocks, front = ctx.shape
        keys, block = ctx.keys, ctx.block
        columns = keys // block
        grad = grad.reshape(batch, blocks, heads, columns, block, dim)
        out = grad.new_zeros(batch, heads, blocks + columns - 1, block, dim)
        for column in range(columns):
            out[:, :, column : column + blocks] += grad[:, :, :, column].transpose(1, 2)
        return out.view(batch, heads, -1, dim)[:, :, front : front + seq], None, None


def _windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_mask: torch.Tensor,
    scale: float,
    dropout: float,
    kernel: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Sliding-window SDPA as ONE call over all query blocks: blocks become the batch, K/V windows are views.

    q `[B, H, S, d]`, k/v `[B, H_kv, S, d]`, block_mask from `window_block_mask` → `[B, H, S, d]`. The K/V windows
    of the blocks overlap in memory (`_KeyWindows`: a strided view of the front-padded K/V, no copy for B = 1);
    their backward sums the overlapping gradients once, instead of one zero-filled full-size gradient per block
    and K/V tensor.
    """
    batch, heads, seq, dim = q.shape
    block = block_mask.shape[-2]
    keys = block_mask.shape[-1]
    blocks = -(-seq // block)
    padded_len = blocks * block

    queries = F.pad(q, (0, 0, 0, padded_len - seq)) if padded_len != seq else q
    queries = queries.view(batch, heads, blocks, block, dim).transpose(1, 2).reshape(batch * blocks, heads, block, dim)
    keys_w = _KeyWindows.apply(k, keys, block)
    values_w = keys_w if v is k else _KeyWindows.apply(v, keys, block)
    mask = block_mask
    if mask.shape[0] != batch * blocks:  # one mask for every sequence of the batch
        mask = mask.repeat(batch, 1, 1, 1)
    out = kernel(
        queries,
        keys_w,
        values_w,
        attn_mask=mask.to(q.dtype),
        scale=scale,
        dropout_p=dropout,
        enable_gqa=k.shape[1] != heads,
    )  # [B·n, H, block, d]
    out = out.transpose(1, 2).reshape(batch, padded_len, heads, dim)
    if padded_len != seq:
        out = out[:, :seq]
    return out.transpose(1, 2)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float,
    dropout: float,
    window: int | None = None,
    block_mask: torch.Tensor | None = None,
    kernel: Callable[..., torch.Tensor] = F.scaled_dot_product_attention,
) -> torch.Tensor:
    """SDPA of `[B, H, S, d]` tensors (K/V with fewer heads for GQA); `mask` None means causal.

    With `window` (a causal sliding window whose mask has no look-ahead), queries are processed in blocks of
    `window_block(window)` tokens against only the keys their window reaches (`[start - window + 1, end)`), all
    blocks in one SDPA call (`_windowed_attention`): about block + window keys per query instead of S, the same
    result. `block_mask` is that path's mask when the caller cached it (built from `mask` otherwise). `kernel` runs
    the attention itself, with SDPA's signature (the layer's `am_precision.AttentionKernel`; default SDPA).
    """
    gqa = k.shape[1] != q.shape[1]  # SDPA broadcasts K/V heads itself: no repeated copies
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    seq = q.shape[2]
    if window is None or mask is None or mask.dtype != torch.bool or seq <= 2 * window:
        return kernel(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, dropout_p=dropout, enable_gqa=gqa)
    if block_mask is None:
        block_mask = window_block_mask(mask, window=window, block=window_block(window))
    return _windowed_attention(q, k, v, block_mask=block_mask, scale=scale, dropout=dropout, kernel=kernel)
