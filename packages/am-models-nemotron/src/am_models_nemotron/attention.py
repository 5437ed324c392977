"""Grouped-query attention without positional encoding (NoPE), as Nemotron-H uses, and its mask builder.

What it is for: `NemotronAttention` (q/k/v/o projections, the core attention `BackendConfig.attn` names — an
am-precision `AttentionKernel`: sdpa, eager, flex, cudnn or te — K/V appended to a `NemotronHybridCache` while
generating) and `build_attention_mask`, which turns padding, packed-document ids and a cache offset into one boolean
mask (or None when plain causal attention suffices, so SDPA can use `is_causal`).
What it must not do: apply rotary embeddings (the architecture has none), or produce a mask row with no allowed key
(SDPA would return NaN, which then leaks through the values of later layers): such rows attend causally instead;
their outputs belong to padding and are never used.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from am_precision import AttentionKernel, BackendConfig, attention_backend_problem, initialize_linear_module

from ._init import reset_linear_
from .config import NemotronConfig
from .tp_plan import ATTENTION_TP_PLAN

__all__ = ["NemotronAttention", "build_attention_mask"]


def build_attention_mask(
    *,
    batch_size: int,
    query_length: int,
    past_length: int = 0,
    attention_mask: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean attention mask [B, 1, q, past + q] (True = attend), or None for plain causal attention.

    Args:
        attention_mask: [B, past + q] (or [B, q] without a cache), 1 for real tokens, 0 for padding.
        seq_idx: [B, q] document ids of packed rows (no cache); tokens attend only within their document.
    """
    kv_length = past_length + query_length
    has_padding = attention_mask is not None and bool((attention_mask == 0).any())
    if not has_padding and seq_idx is None and (past_length == 0 or query_length == 1):
        return None
    query_pos = torch.arange(query_length, device=device)[:, None] + past_length
    key_pos = torch.arange(kv_length, device=device)[None, :]
    causal = key_pos <= query_pos
    mask = causal[None, None].expand(batch_size, 1, query_length, kv_length)
    if has_padding:
        assert attention_mask is not None
        keys = attention_mask[:, -kv_length:].to(torch.bool)
        mask = mask & keys[:, None, None, :]
    if seq_idx is not None:
        same = seq_idx[:, :, None] == seq_idx[:, None, :]
        if past_length:
            same = F.pad(same, (past_length, 0), value=True)
        mask = mask & same[:, None]
    empty_rows = ~mask.any(dim=-1, keepdim=True)
    if bool(empty_rows.any()):
        mask = mask | (empty_rows & causal[None, None])
    return mask


class NemotronAttention(nn.Module):
    """GQA self-attention, no positional encoding. hidden_states: [B, S, H] -> [B, S, H]."""

    _tp_plan: ClassVar[Any] = ATTENTION_TP_PLAN  # am-tensor-parallel: heads split over tp (tp_plan.py)

    def __init__(
        self,
        config: NemotronConfig | Any,
        layer_idx: int,
        *,
        backend: BackendConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        config = NemotronConfig.from_any(config)  # a raw transformers / NVIDIA config works too
        problem = attention_backend_problem(backend.attn)
        if problem is not None:
            raise ValueError(f"NemotronAttention layer {layer_idx}: {problem}")
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        hidden, bias = config.hidden_size, config.attention_bias

        def linear(n_in: int, n_out: int) -> nn.Module:
            return initialize_linear_module(backend.linear, n_in, n_out, bias=bias, device=device, dtype=dtype)

        self.q_proj = linear(hidden, self.num_heads * self.head_dim)
        self.k_proj = linear(hidden, self.num_kv_heads * self.head_dim)
        self.v_proj = linear(hidden, self.num_kv_heads * self.head_dim)
        self.o_proj = linear(self.num_heads * self.head_dim, hidden)
        # No parameters and no state-dict keys: the checkpoint layout does not depend on the attention backend.
        self.core_attention = AttentionKernel(
            backend.attn,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            compile_attn=backend.compile_attn,
        )

    @torch.no_grad()
    def init_weights(self) -> None:
        """Default linear init; zero biases."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            reset_linear_(proj)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
        ring: Any | None = None,
    ) -> torch.Tensor:
        """attention_mask: boolean [B, 1, q, kv] from `build_attention_mask`, or None (causal).

        ring: an entered `am_context_parallel.RingAttentionContext` (context parallelism): this rank's block attends
        causally over the whole sharded sequence within its documents (the context's positions and document ids);
        no mask and no cache then."""
        batch, seqlen, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seqlen, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(batch, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if ring is not None:
            if cache is not None or attention_mask is not None or (self.training and self.dropout):
                raise ValueError(
                    f"NemotronAttention layer {self.layer_idx} under context parallelism takes no cache, no mask and "
                    "no attention dropout (set attention_dropout=0)."
                )
            out = ring.attention(q, k, v, causal=True, scale=self.scaling)
            out = out.transpose(1, 2).reshape(batch, seqlen, self.num_heads * self.head_dim)
            ringed: torch.Tensor = self.o_proj(out)
            return ringed
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        is_causal = attention_mask is None and seqlen > 1 and seqlen == k.shape[2]
        out = self.core_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            scale=self.scaling,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(batch, seqlen, self.num_heads * self.head_dim)
        projected: torch.Tensor = self.o_proj(out)
        return projected
