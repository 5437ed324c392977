"""Gemma 4 mixture-of-experts block: fp32 router on the raw residual, GeGLU experts from am-moe.

What it is for: `Gemma4Router` (RMSNorm without scale · `scale` · H^-0.5 → linear to E → softmax over all experts →
top-k → renormalize → per-expert scale, all in fp32), `Gemma4Experts` (`am_moe.GroupedExperts` with GeGLU,
transformers' layout `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`, one grouped GEMM per projection) and
`Gemma4MoE`, which routes on the un-normalized residual, computes the experts on the pre-normalized input and keeps
padding tokens out of the experts (their output is 0, they count in no expert's load).
Expert parallelism of these experts is am-moe's (`Gemma4PreTrainedModel.apply_expert_parallel`).
What it must not do: change routing with the storage dtype (the router casts its input and weights to fp32 and its
parameters are pinned fp32 by the model's `_keep_in_fp32_modules_strict`), or compute experts itself (dispatch,
grouped GEMMs, expert parallelism and load statistics are am-moe's).

Names versus transformers: HF keeps `router.*` and `experts.*` directly in the decoder layer; ours live under
`moe.router.*` / `moe.experts.*` with the same tensors and layouts (`state_dict_adapter.py` renames, nothing else).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from am_moe import GroupedExperts
from am_precision import BackendConfig

from .backend import experts_grouped_mm
from .config import moe_intermediate_size
from .layers import Gemma4RMSNorm, rms_norm

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


class Gemma4Experts(GroupedExperts):
    """The E GeGLU experts of a Gemma 4 config: `am_moe.GroupedExperts(num_experts, hidden_size,
    moe_intermediate_size, gated=True, activation="gelu_tanh")`, initialized normal(0, initializer_range).

    gate_up_proj: `[E, 2I, H]` (gate rows first), down_proj: `[E, H, I]` — transformers' `Gemma4TextExperts`
    layout. forward(hidden_states `[T, H]`, top_k_index `[T, K]`, top_k_weights `[T, K]`, *, token_mask `[T]`).
    """

    def __init__(self, config: Any, *, grouped_mm: str = "auto") -> None:
        intermediate = moe_intermediate_size(config)
        assert intermediate is not None
        super().__init__(
            int(config.num_experts),
            int(config.hidden_size),
            intermediate,
            gated=True,
            activation="gelu_tanh",
            grouped_mm=grouped_mm,
        )
        self.init_weights(std=float(getattr(config, "initializer_range", 0.02)))


class Gemma4MoE(nn.Module):
    """Router + experts of one decoder layer (no shared experts; the dense MLP runs beside it in the layer)."""

    def __init__(self, config: Any, *, backend: BackendConfig | None = None) -> None:
        super().__init__()
        self.router = Gemma4Router(config)
        # BackendConfig.experts: "torch" = am-moe's per-expert loop, "torch_mm" = its grouped GEMM (None: "auto").
        self.experts = Gemma4Experts(config, grouped_mm=experts_grouped_mm(backend))

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
        out = self.experts(hidden_states.reshape(-1, shape[-1]), indices, weights, token_mask=token_mask)
        return out.reshape(shape)
