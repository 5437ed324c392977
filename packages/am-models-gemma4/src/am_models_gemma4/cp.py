"""Context parallelism inside the Gemma 4 models: the attention layers' ring path and the entered ring context.

What it is for: `ring_attention`, the CP path of every attention layer (am-context-parallel's ring with the layer's
sliding window), and its one rule, `attention_cp_problem`; `active_ring_context`, the context entered by the caller
(`make_cp_batch_and_ctx(mesh, batch, model=model)`, which reads the models' declarations in `pretrained.py`);
`tokens_before_this_rank`, the offset of this rank's image tokens in the image features (the vision tower runs on
the full images).
What it must not do: import am-pipelining or am-capabilities, shard a batch itself, or route transformers' attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from am_context_parallel import RingAttentionContext, current_ring_context

__all__ = ["active_ring_context", "attention_cp_problem", "ring_attention", "tokens_before_this_rank"]


def active_ring_context() -> RingAttentionContext | None:
    """The entered `RingAttentionContext` of a CP step with more than one rank, else None."""
    ctx = current_ring_context()
    if ctx is None or ctx.layout.cp_size <= 1:
        return None
    return ctx


def attention_cp_problem(*, dropout: float, attn: str = "sdpa") -> str | None:
    """What an attention layer cannot honour under CP (None: nothing): attention dropout (the ring has none), or an
    attention backend other than SDPA (the ring computes every chunk with am-context-parallel's own kernel)."""
    if dropout:
        return f"attention_dropout={dropout} is not supported under context parallelism; set it to 0"
    if attn != "sdpa":
        return (
            f"BackendConfig.attn={attn!r}: under context parallelism attention runs am-context-parallel's ring with "
            "its own per-chunk kernel; use attn='sdpa' with cp > 1"
        )
    return None


def ring_attention(
    ring: RingAttentionContext,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    sliding_window: int | None,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """The CP path of an attention layer: queries `[B, H, S_local, d]`, keys/values `[B, H_kv, S_local, d]` of this
    rank's contiguous shard → `[B, H, S_local, d]`, attending over every rank's tokens.

    The ring context carries the global positions and packed-document ids (0 = padding) of the batch; a sliding
    layer fetches only the ranks its window reaches (the previous one when the window is shorter than a shard).

    Raises:
        NotImplementedError: dropout > 0 (`attention_cp_problem`; trainers ask `cp_problems` before any collective,
            this is the last line of defence).
    """
    problem = attention_cp_problem(dropout=dropout)
    if problem is not None:
        raise NotImplementedError(problem)
    return ring.attention(queries, keys, values, causal=True, sliding_window=sliding_window, scale=scale)


def tokens_before_this_rank(count: torch.Tensor, *, group: Any) -> int:
    """Sum of `count` (a 0-d integer tensor) over the ranks of `group` before this one (all-gather of C scalars)."""
    world = dist.get_world_size(group)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count.contiguous(), group=group)
    return int(sum(int(c) for c in counts[: dist.get_rank(group)]))
