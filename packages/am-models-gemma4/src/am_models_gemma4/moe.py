"""Gemma 4 mixture-of-experts block: fp32 router on the raw residual, GeGLU experts, vectorised dispatch.

What it is for: `Gemma4Router` (RMSNorm without scale · `scale` · H^-0.5 → linear to E → softmax over all experts →
top-k → renormalize → per-expert scale, all in fp32), `Gemma4Experts` (gelu-tanh(gate) · up → down, weights stored
`[E, H, 2I]` / `[E, I, H]` so a token block is multiplied without a transpose) and `Gemma4MoE`, which routes on
the un-normalized residual, computes the experts on the pre-normalized input and leaves padding tokens out of the
dispatch (their output is 0).
What it must not do: change routing with the storage dtype (the router casts its input and weights to fp32 and its
parameters are pinned fp32 by the model's `_keep_in_fp32_modules_strict`), or loop over tokens.

Layout versus transformers: HF keeps `experts.gate_up_proj [E, 2I, H]` and `experts.down_proj [E, H, I]` next to
`router.*` in the decoder layer; ours are `moe.experts.gate_up_proj [E, H, 2I]`, `moe.experts.down_proj [E, I, H]`
and `moe.router.*`. `state_dict_adapter.py` converts between the two (a transpose; nothing is folded, so the
per-expert scale keeps its own gradient as in HF).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from am_models_gemma4.config import moe_intermediate_size
from am_models_gemma4.layers import Gemma4RMSNorm, rms_norm

__all__ = ["Gemma4Experts", "Gemma4MoE", "Gemma4Router"]


class Gemma4Router(nn.Module):
    """Top-k routing of `[T, H]` tokens over E experts, computed in fp32 whatever the input dtype.

    Returns `(weights [T, K] fp32, indices [T, K] int64)`: the top-k softmax probabilities renormalized to sum to
    1, times `per_expert_scale[index]`.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.top_k = int(config.top_k_experts)
        self.num_experts = int(config.num_experts)
        self.scalar_root_size = hidden**-0.5  # a Python float: never rounded to a storage dtype
        self.norm = Gemma4RMSNorm(hidden, eps=float(config.rms_norm_eps), with_scale=False)
        self.proj = nn.Linear(hidden, self.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(self.num_experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # scale · H^-0.5 folded into the norm's weight: one [H] multiply instead of two [T, H] passes (and backward)
        normed = rms_norm(hidden_states.float(), self.scale.float() * self.scalar_root_size, self.norm.eps)
        scores = F.linear(normed, self.proj.weight.float())
        probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probabilities, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale.float()[indices], indices


class Gemma4Experts(nn.Module):
    """E GeGLU experts: `down(gelu_tanh(x @ W_gate) * (x @ W_up))`, combined with the routing weights.

    gate_up_proj: `[E, H, 2I]` (gate columns first), down_proj: `[E, I, H]`.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        intermediate = moe_intermediate_size(config)
        assert intermediate is not None
        self.num_experts = int(config.num_experts)
        self.hidden_dim = int(config.hidden_size)
        self.intermediate_dim = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, intermediate, self.hidden_dim))
        nn.init.normal_(self.gate_up_proj, std=float(getattr(config, "initializer_range", 0.02)))
        nn.init.normal_(self.down_proj, std=float(getattr(config, "initializer_range", 0.02)))

    def forward(
        self,
        hidden_states: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states `[T, H]`, weights/indices `[T, K]`, token_mask `[T]` (True = route) → `[T, H]`.

        Token-expert pairs are sorted by expert once; each expert multiplies one contiguous block; results are
        weighted and summed back with one `index_add`.
        """
        num_tokens, top_k = indices.shape
        token_of_pair = torch.arange(num_tokens, device=indices.device).repeat_interleave(top_k)
        expert_of_pair = indices.reshape(-1)
        weight_of_pair = weights.reshape(-1)
        if token_mask is not None:
            keep = token_mask.reshape(-1).repeat_interleave(top_k)
            token_of_pair, expert_of_pair, weight_of_pair = (
                token_of_pair[keep],
                expert_of_pair[keep],
                weight_of_pair[keep],
            )
        order = torch.argsort(expert_of_pair, stable=True)
        token_of_pair, weight_of_pair = token_of_pair[order], weight_of_pair[order]
        counts = torch.bincount(expert_of_pair, minlength=self.num_experts).tolist()

        routed = hidden_states.index_select(0, token_of_pair)
        # unbind, not indexing: one backward (a stack) instead of a zero-filled [E, ...] gradient per expert
        gate_up_weights, down_weights = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        blocks = []
        for expert, block in enumerate(routed.split(counts)):
            if block.shape[0] == 0:
                continue
            gate, up = (block @ gate_up_weights[expert]).chunk(2, dim=-1)
            blocks.append((F.gelu(gate, approximate="tanh") * up) @ down_weights[expert])
        out = hidden_states.new_zeros(hidden_states.shape)
        if not blocks:
            return out
        expert_out = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        expert_out = (expert_out.float() * weight_of_pair.unsqueeze(-1)).to(hidden_states.dtype)
        return out.index_add(0, token_of_pair, expert_out)


class Gemma4MoE(nn.Module):
    """Router + experts of one decoder layer (no shared experts; the dense MLP runs beside it in the layer)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.router = Gemma4Router(config)
        self.experts = Gemma4Experts(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        router_input: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states (normalized) and router_input (raw residual) `[B, S, H]` → `[B, S, H]`.

        padding_mask: `[B, S]`, True = padding; those tokens are not dispatched and get 0.
        """
        shape = hidden_states.shape
        weights, indices = self.router(router_input.reshape(-1, shape[-1]))
        token_mask = None if padding_mask is None else ~padding_mask.reshape(-1).bool()
        out = self.experts(hidden_states.reshape(-1, shape[-1]), weights, indices, token_mask)
        return out.reshape(shape)
