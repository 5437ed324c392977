"""Test reference: the per-expert loop that grouped experts must equal (written independently of am_moe).

For each expert e: find the (token, k) pairs routed to it with a boolean mask, run that expert's MLP on those
tokens with plain matmuls on its own weight slice, weight by the routing weight and add into the output — the
textbook dropless MoE, no sorting, no grouped GEMM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def reference_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    first: torch.Tensor,
    down: torch.Tensor,
    gated: bool,
    activation: Callable[[torch.Tensor], torch.Tensor],
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [T, H], top_k_index/top_k_weights [T, K], first [E, I or 2I, H], down [E, H, I] -> [T, H] (fp32 sum)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    routed = torch.ones(hidden.shape[0], dtype=torch.bool) if token_mask is None else token_mask
    for expert in range(first.shape[0]):
        hit = (top_k_index == expert) & routed.unsqueeze(-1)  # [T, K]
        tokens, slots = hit.nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = hidden[tokens] @ first[expert].T
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = activation(gate) * up
        else:
            h = activation(h)
        y = h @ down[expert].T
        out = out.index_add(0, tokens, y.float() * top_k_weights[tokens, slots].float().unsqueeze(-1))
    return out.to(hidden.dtype)


def random_routing(
    tokens: int, top_k: int, num_experts: int, *, generator: torch.Generator, skip: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token (never those in `skip`) and positive weights: `([T, K] int64, [T, K])`."""
    allowed = torch.tensor([e for e in range(num_experts) if e not in skip])
    scores = torch.rand(tokens, allowed.numel(), generator=generator)
    index = allowed[scores.topk(top_k, dim=-1).indices]
    weights = torch.rand(tokens, top_k, generator=generator) + 0.1
    return index, weights
