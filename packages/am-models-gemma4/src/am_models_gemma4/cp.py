"""Context-parallel hooks of the Gemma 4 models: the batch sharder they own and what their forward reads.

What it is for: `ContextParallelHooks.prepare_model_inputs_for_cp(batch)` attaches the model-owned sharder
(`batch["_cp_make_batch_fn"]`), so am-context-parallel's `make_cp_batch_and_ctx` picks the contiguous shard for
Gemma 4 and returns the context our attention layers read (`active_ring_context`). `tokens_before_this_rank` gives
the offset of this rank's image tokens in the gathered image features (the vision tower runs on the full images).
What it must not do: import am-pipelining or am-capabilities, or route transformers' attention.

Embedding gradients under CP: each rank embeds its own shard of `input_ids` (an embedding is per token), so the
embedding (and the vision tower, through the image rows a rank consumes) receives the gradient of the local tokens;
`all_reduce_cp_gradients` then sums the ranks into the full-sequence gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from am_context_parallel import RingAttentionContext, current_ring_context
from am_models_gemma4.cp_batch import make_gemma4_cp_batch_and_ctx

__all__ = ["ContextParallelHooks", "active_ring_context", "tokens_before_this_rank"]


def active_ring_context() -> RingAttentionContext | None:
    """The entered `RingAttentionContext` of a CP step with more than one rank, else None."""
    ctx = current_ring_context()
    if ctx is None or ctx.layout.cp_size <= 1:
        return None
    return ctx


def tokens_before_this_rank(count: torch.Tensor, *, group: Any) -> int:
    """Sum of `count` (a 0-d integer tensor) over the ranks of `group` before this one (all-gather of C scalars)."""
    world = dist.get_world_size(group)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count.contiguous(), group=group)
    return int(sum(int(c) for c in counts[: dist.get_rank(group)]))


class ContextParallelHooks:
    """Mixin for the top-level Gemma 4 models: the duck-typed CP protocol read by `make_cp_batch_and_ctx`."""

    _owns_cp_attention = True  # am-capabilities: the model runs its own CP attention

    def prepare_model_inputs_for_cp(self, batch: dict[str, Any], **_: Any) -> dict[str, Any]:
        """Attach the model-owned contiguous sharder to `batch` (in place) and return it.

        Then `ctx, batch = make_cp_batch_and_ctx(mesh, batch)` shards every sequence tensor contiguously and
        returns a context: run forward and backward inside `with ctx():`.

        Raises:
            ValueError: when the batch has no `input_ids` (the model embeds its own shard of them).
        """
        if batch.get("input_ids") is None:
            raise ValueError(
                "prepare_model_inputs_for_cp requires input_ids: Gemma 4 embeds each rank's shard of the token ids "
                "itself (precomputed inputs_embeds would not carry per-layer inputs or image positions)"
            )
        batch["_cp_make_batch_fn"] = make_gemma4_cp_batch_and_ctx
        return batch
