"""Gemma 4 self-attention: QK-norm, value norm, per-layer-type RoPE and head dim, K=V, KV sharing, KV cache.

What it is for: `Gemma4Attention` computes what transformers' `Gemma4TextAttention` computes (same parameter
names): the projections, norms and RoPE of queries, keys and values, then one of two attention paths:
  1. ring — under context parallelism (an entered `RingAttentionContext`, from `AttentionInputs.ring` or, for a
     layer called alone by a pipeline stage, the entered context): `cp.ring_attention` over the contiguous shards.
     A 4-D mask a stage built from its local shard is then ignored — never local attention on one shard;
  2. local — `local_attention.local_attention` with the per-forward masks of `masks.AttentionInputs` (documents,
     padding, windows, vision groups), or a transformers 4-D mask handed in by a pipeline stage; a generation step
     after a prefill (`past_length > 0`) attends to the K/V its `Gemma4HybridCache` returns.
What it must not do: keep any state between forwards itself (the cache object the caller passes holds it), or route
other modules' attention (the vision tower keeps transformers' attention even under CP).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

from am_precision import AttentionKernel, BackendConfig, fused_rope, quack_rope

from .config import SLIDING, kv_sharing_modes, layer_head_dim, layer_num_kv_heads
from .cp import active_ring_context, attention_cp_problem, ring_attention
from .layers import Gemma4RMSNorm, make_linear, make_norm
from .local_attention import local_attention
from .masks import AttentionInputs, build_attention_mask

__all__ = ["Gemma4Attention", "SharedKVStates"]


class SharedKVStates(MutableMapping[str, tuple[torch.Tensor, torch.Tensor]]):
    """Per-forward store of the K/V a "store" layer publishes for the "reuse" layers of its type.

    Deliberately not a `dict` subclass: FSDP2 copies dict inputs when it casts forward arguments, which would give
    every layer its own empty copy.
    """

    def __init__(self) -> None:
        self._data: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __getitem__(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._data[key]

    def __setitem__(self, key: str, value: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        del self._data[key]

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class _RotaryEmbedding(torch.autograd.Function):
    """transformers' `apply_rotary_pos_emb` (`x·cos + rotate_half(x)·sin`) on `[B, S, H, d]` with cos/sin
    `[B or 1, S, d]`, in two passes and without `rotate_half`'s negated copy and concatenation; the backward
    (the transposed rotation) saves only cos/sin, not x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        out = grad * cos
        out[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        out[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1.0)
        return out, None, None


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of `[B, S, H, d]` queries/keys; transformers' op when cos/sin need a gradient (never in training)."""
    if cos.requires_grad or sin.requires_grad or x.shape[-1] % 2:
        return apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)
    return _RotaryEmbedding.apply(x, cos, sin)


class Gemma4Attention(nn.Module):
    """Self-attention of decoder layer `layer_idx` (parameter names as in transformers' `Gemma4TextAttention`).

    hidden_states: `[B, S, H]` → `[B, S, H]`. Sliding layers use `head_dim` and the sliding window; full layers
    use `global_head_dim`, proportional RoPE (from the caller's cos/sin) and, with `attention_k_eq_v`,
    `num_global_key_value_heads` and values taken from the raw key projection (no `v_proj`). KV-shared ("reuse")
    layers have no K/V weights and read the K/V of the last "store" layer of their type.
    """

    def __init__(self, config: Any, layer_idx: int, *, backend: BackendConfig | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.is_sliding = self.layer_type == SLIDING
        self.sliding_window = int(config.sliding_window) if self.is_sliding else None
        self.head_dim = layer_head_dim(config, layer_idx)
        self.num_heads = int(config.num_attention_heads)
        self.num_key_value_heads = layer_num_kv_heads(config, layer_idx)
        self.use_alternative_attention = bool(getattr(config, "attention_k_eq_v", False)) and not self.is_sliding
        self.scaling = 1.0  # QK-norm replaces 1/sqrt(d)
        self.attention_dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        mode = kv_sharing_modes(config)[layer_idx]
        self.is_kv_shared_layer = mode == "reuse"
        self.store_full_length_kv = mode == "store"
        bias = bool(getattr(config, "attention_bias", False))
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)

        self.q_proj = make_linear(hidden, self.num_heads * self.head_dim, bias=bias, backend=backend)
        self.q_norm = make_norm(self.head_dim, eps=eps, backend=backend)
        self.k_proj: nn.Module | None = None
        self.v_proj: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.v_norm: Gemma4RMSNorm | None = None
        if not self.is_kv_shared_layer:
            self.k_norm = make_norm(self.head_dim, eps=eps, backend=backend)
            # weightless: no backend norm has that form (and a weight would add a key the checkpoint lacks)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps=eps, with_scale=False)
            self.k_proj = make_linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias, backend=backend)
            if not self.use_alternative_attention:
                self.v_proj = make_linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias, backend=backend)
        self.o_proj = make_linear(self.num_heads * self.head_dim, hidden, bias=bias, backend=backend)
        # RoPE through Transformer Engine's fused kernel (am_precision.fused_rope) on the angles the model's
        # Gemma4RotaryEmbedding(fused=True) hands over with cos/sin; the torch rotation otherwise.
        self.rope_fusion = bool(backend is not None and backend.rope_fusion)
        self.rope = "torch" if backend is None else backend.rope  # "quack": QuACK's rotary kernel (quack_rope)
        # The core attention `backend.attn` names (None: SDPA). No parameters, no state-dict keys.
        self.core_attention = AttentionKernel(
            "sdpa" if backend is None else backend.attn,
            num_heads=self.num_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            compile_attn=False if backend is None else backend.compile_attn,
        )

    def _keys_and_values(
        self, hidden_states: torch.Tensor, rotate: Callable[[torch.Tensor], torch.Tensor], shared: Any, cache: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's keys and values `[B, H_kv, S, d]` — with a cache, the cached ones first — or, on a "reuse"
        layer, those its store layer published in this forward."""
        if self.is_kv_shared_layer:
            if shared is None or self.layer_type not in shared:
                raise RuntimeError(
                    f"layer {self.layer_idx} reuses the K/V of an earlier '{self.layer_type}' layer, but none was "
                    "published in shared_kv_states; run the layers in order within one forward"
                )
            return shared[self.layer_type]
        assert self.k_proj is not None
        assert self.k_norm is not None
        assert self.v_norm is not None
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        keys = self.k_proj(hidden_states).view(shape)
        values = self.v_proj(hidden_states).view(shape) if self.v_proj is not None else keys
        keys = rotate(self.k_norm(keys)).transpose(1, 2)
        values = self.v_norm(values).transpose(1, 2)
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx)
        if self.store_full_length_kv and shared is not None:
            shared[self.layer_type] = (keys, values)
        return keys, values

    def cp_problem(self) -> str | None:
        """What this layer cannot honour under context parallelism in its current mode (None: nothing); the rule
        of the ring path's check and of the models' `cp_problems` hook, which trainers call before any collective."""
        return attention_cp_problem(
            dropout=self.attention_dropout if self.training else 0.0, attn=self.core_attention.attn
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        *,
        attention_mask: torch.Tensor | None = None,
        shared_kv_states: Any = None,
        attention_inputs: AttentionInputs | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """hidden_states `[B, S, H]`, cos/sin `[B or 1, S, d]` → `[B, S, H]`.

        `attention_inputs` (from our text model) wins; otherwise `attention_mask` is a transformers 4-D mask
        (bool "may attend" or additive float), and None means causal (plus the window on sliding layers).
        `cache`: a `Gemma4HybridCache` while generating (needs `attention_inputs` with the cache's past length).
        """
        if cache is not None and attention_inputs is None:
            raise ValueError(
                f"layer {self.layer_idx} got a KV cache without attention_inputs; generate through Gemma4TextModel "
                "(or Gemma4ForCausalLM), which builds the masks of cached steps"
            )
        cos, sin = position_embeddings
        rotate: Callable[[torch.Tensor], torch.Tensor]
        if self.rope_fusion:
            angles = getattr(position_embeddings, "angles", None)
            if angles is None:
                raise ValueError(
                    f"layer {self.layer_idx}: rope_fusion=True rotates with Transformer Engine's fused kernel, which "
                    "needs the rotary angles: pass the position embeddings of the model's own rotary_emb "
                    "(Gemma4RotaryEmbedding(config, fused=True)), not bare (cos, sin)"
                )
            rotate = functools.partial(fused_rope, angles=angles)
        elif self.rope == "quack":
            rotate = functools.partial(quack_rope, cos=cos, sin=sin)
        else:
            rotate = functools.partial(_rotary, cos=cos, sin=sin)
        batch, seq = hidden_states.shape[:2]
        queries = self.q_proj(hidden_states).view(batch, seq, -1, self.head_dim)
        queries = rotate(self.q_norm(queries)).transpose(1, 2)
        keys, values = self._keys_and_values(hidden_states, rotate, shared_kv_states, cache)
        dropout = self.attention_dropout if self.training else 0.0

        ring = attention_inputs.ring if attention_inputs is not None else active_ring_context()
        if ring is not None:
            kernel_problem = attention_cp_problem(dropout=0.0, attn=self.core_attention.attn)
            if kernel_problem is not None:  # the ring would silently replace the chosen kernel
                raise NotImplementedError(f"layer {self.layer_idx}: {kernel_problem}")
            out = ring_attention(
                ring, queries, keys, values, sliding_window=self.sliding_window, scale=self.scaling, dropout=dropout
            )
        elif attention_inputs is not None:
            out = self._attend(queries, keys, values, attention_inputs, dropout)
        else:  # a pipeline stage's transformers mask; None = causal (plus the window on sliding layers)
            mask, window = attention_mask, None
            if mask is None and self.sliding_window is not None:
                window = self.sliding_window
                mask, _ = build_attention_mask(
                    seq_len=seq, device=hidden_states.device, doc_ids=None, vision_group_ids=None, sliding_window=window
                )
            out = local_attention(
                queries,
                keys,
                values,
                mask=mask,
                scale=self.scaling,
                dropout=dropout,
                window=window,
                kernel=self.core_attention,
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def _attend(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, inputs: AttentionInputs, dropout: float
    ) -> torch.Tensor:
        """Local attention with the text model's masks of this layer type; rows that see nothing become 0."""
        mask, rows = inputs.mask_for(self.layer_type, self.sliding_window)
        if inputs.past_length:
            # A cached step: the keys are the cache's (at most the window on sliding layers) then the new ones, i.e.
            # the last columns of the mask over all tokens; None = every key visible (not causal: S = 1).
            if mask is not None:
                mask = mask[..., mask.shape[-1] - keys.shape[2] :]
            out = self.core_attention(
                queries,
                keys,
                values,
                attn_mask=mask,
                scale=self.scaling,
                dropout_p=dropout,
                enable_gqa=keys.shape[1] != queries.shape[1],
            )
        else:
            lookahead = inputs.vision_group_ids is not None  # image tokens may see keys ahead: no window blocks
            window = None if lookahead else self.sliding_window
            block_mask = None if window is None else inputs.window_block_mask_for(self.layer_type, window)
            out = local_attention(
                queries,
                keys,
                values,
                mask=mask,
                scale=self.scaling,
                dropout=dropout,
                window=window,
                block_mask=block_mask,
                kernel=self.core_attention,
            )
        return out if rows is None else out * rows.to(out.dtype)
