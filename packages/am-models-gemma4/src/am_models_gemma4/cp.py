"""Context parallelism of the Gemma 4 models: the attention layers' ring path and what the models declare to it.

What it is for: `ring_attention`, the CP path of every attention layer (am-context-parallel's ring with the layer's
sliding window), and its one rule, `attention_cp_problem`. `ContextParallelHooks` declares `_cp_layout =
"contiguous"` and `get_cp_options()` (our ring kernel), so am-context-parallel's `make_cp_batch_and_ctx(mesh, batch,
model=model)` shards contiguously and returns the context our attention layers read (`active_ring_context`).
`tokens_before_this_rank` gives the offset of this rank's image tokens in the gathered image features (the vision
tower runs on the full images).
What it must not do: import am-pipelining or am-capabilities, shard a batch itself, or route transformers' attention.

Embedding gradients under CP: each rank embeds its own shard of `input_ids` (an embedding is per token), so the
embedding (and the vision tower, through the image rows a rank consumes) receives the gradient of the local tokens;
`all_reduce_cp_gradients` then sums the ranks into the full-sequence gradient.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from am_context_parallel import ContiguousCPOptions, RingAttentionContext, current_ring_context

from .kernels import default_ring_kernel

__all__ = [
    "ContextParallelHooks",
    "active_ring_context",
    "attention_cp_problem",
    "ring_attention",
    "tokens_before_this_rank",
]


def active_ring_context() -> RingAttentionContext | None:
    """The entered `RingAttentionContext` of a CP step with more than one rank, else None."""
    ctx = current_ring_context()
    if ctx is None or ctx.layout.cp_size <= 1:
        return None
    return ctx


def attention_cp_problem(*, dropout: float) -> str | None:
    """What an attention layer cannot honour under CP (None: nothing): attention dropout (the ring has none)."""
    if dropout:
        return f"attention_dropout={dropout} is not supported under context parallelism; set it to 0"
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


class ContextParallelHooks:
    """Mixin for the top-level Gemma 4 models: what they declare to am-context-parallel's contiguous CP path.

    `make_cp_batch_and_ctx(mesh, batch, model=model)` reads `_cp_layout` and `get_cp_options()` and returns the
    contiguous shard with the `RingAttentionContext` our attention layers read (forward AND backward inside
    `with ctx():`). Sliding windows come from each layer at call time.
    """

    _cp_layout = "contiguous"  # am-context-parallel: contiguous shards and the ring context, no sharder of our own
    _owns_cp_attention = True  # am-capabilities: the model runs its own CP attention

    def cp_problems(self, *, seq_len: int, local_seq_len: int, cp_size: int) -> list[str]:
        """What this model cannot honour under CP, asked before any collective (am-context-parallel's
        `model_cp_problems`): each decoder attention layer's `cp_problem()` (attention dropout while training), the
        rule its forward enforces. Sequence lengths set no limit: the ring fetches whichever ranks a sliding window
        reaches, however short the shards; image batches with `use_bidirectional_attention="vision"` are refused at
        forward time (they depend on the batch, not the configuration)."""
        from .attention import Gemma4Attention  # attention imports this module

        del seq_len, local_seq_len, cp_size
        where: dict[str, list[str]] = {}  # one line per problem, naming every layer that has it
        for name, module in cast(nn.Module, self).named_modules():
            problem = module.cp_problem() if isinstance(module, Gemma4Attention) else None
            if problem is not None:
                where.setdefault(problem, []).append(name)
        return [f"{problem} (in {', '.join(names)})" for problem, names in where.items()]

    def get_cp_options(self) -> ContiguousCPOptions:
        """The block-sparse ring kernel (`default_ring_kernel` for the batch's device); input_ids required, since
        each rank embeds its own shard (per-layer inputs and image positions come from the token ids); transformers'
        attention is not routed (the vision tower keeps its own attention on whole images)."""
        return ContiguousCPOptions(kernel=default_ring_kernel, primary_keys=("input_ids",))
