"""Gemma 4 self-attention: QK-norm, value norm, per-layer-type RoPE and head dim, K=V, KV sharing, ring CP, KV cache.

What it is for: `Gemma4Attention` computes what transformers' `Gemma4TextAttention` computes (same parameter
names), and picks one of four attention paths:
  1. ring — under context parallelism (`AttentionInputs.ring` is am-context-parallel's `RingAttentionContext`):
     `ring_attention` over the contiguous shards with global positions, packed-document ids and the layer's
     sliding window, so sliding layers fetch only the neighbouring ranks their window reaches;
  2. local — our own boolean masks from sequence positions, documents (`_packed_seq_ids` / padding) and vision
     groups, built once per forward and layer type (`AttentionInputs.mask_for`);
  3. external mask — a 4-D mask handed in by a caller that built transformers' masks (pipeline stages). When a
     CP ring context is entered, such a mask (built from the local shard only) is ignored and the ring runs
     instead, with the context's global positions and document ids — never local attention on one shard;
  4. cached — a generation step after a prefill (`AttentionInputs.past_length > 0`): the new queries attend to the
     K/V a `Gemma4HybridCache` returns (the cached tokens, at most the window on sliding layers, then the new ones).
     The prefill itself (no past) takes path 2 and only stores its K/V in the cache.
What it must not do: keep any state between forwards itself (the cache object the caller passes holds it), or route
other modules' attention (the vision tower keeps transformers' attention even under CP).

Masking rules (shared by the local path and the ring): key k is visible to query q when k <= q (causal), q - k <
window on sliding layers, both tokens are in the same document and it is not padding (id 0). With vision groups
(`use_bidirectional_attention="vision"`, sliding layers only), tokens of one image also see each other. A query
that sees nothing (padding) outputs 0.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

from .config import SLIDING, kv_sharing_modes, layer_head_dim, layer_num_kv_heads
from .cp import active_ring_context
from .layers import Gemma4RMSNorm

__all__ = ["AttentionInputs", "Gemma4Attention", "SharedKVStates", "build_attention_mask"]


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


def build_attention_mask(
    *,
    seq_len: int,
    device: torch.device,
    doc_ids: torch.Tensor | None,
    vision_group_ids: torch.Tensor | None,
    sliding_window: int | None,
    past_length: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Boolean "may attend" mask `[B or 1, 1, S, past + S]` and the rows that see any key `[B, 1, S, 1]`.

    Queries are tokens `past .. past + S - 1` of the sequence, keys tokens `0 .. past + S - 1` (past > 0: a generation
    step after cached tokens; the caller keeps the mask's last columns when a sliding layer's cache returns fewer
    keys). Returns `(None, None)` when no mask is needed: without past, plain causal attention (SDPA's
    `is_causal`); with past, one query and no padding, which sees every key the cache returns. Rows that see nothing
    (padding queries) are given their own diagonal so softmax stays finite; the second value marks the real rows,
    whose outputs the caller keeps (the others become 0).

    doc_ids: `[B, past + S]` document ids, 0 = padding; vision_group_ids: `[B, S]` image-run ids, -1 = text (only
    without past: image tokens are in the prompt).
    """
    if past_length and vision_group_ids is not None:
        raise ValueError(
            "vision_group_ids (bidirectional image attention) apply to the prompt only; pass them with the prefill, "
            "not with a cached generation step"
        )
    if doc_ids is None and vision_group_ids is None:
        if past_length == 0 and sliding_window is None:
            return None, None
        if past_length and seq_len == 1:
            return None, None
    query = torch.arange(past_length, past_length + seq_len, device=device).view(-1, 1)
    key = torch.arange(past_length + seq_len, device=device).view(1, -1)
    allowed = (key <= query).unsqueeze(0)
    if vision_group_ids is not None:
        same_group = (vision_group_ids.unsqueeze(-1) == vision_group_ids.unsqueeze(-2)) & (
            vision_group_ids >= 0
        ).unsqueeze(-1)
        allowed = allowed | same_group
    if sliding_window is not None:
        allowed = allowed & (key > query - sliding_window).unsqueeze(0)
    if doc_ids is None:
        return allowed.unsqueeze(1), None
    query_docs = doc_ids[:, past_length:]
    same_doc = (query_docs.unsqueeze(-1) == doc_ids.unsqueeze(-2)) & (query_docs > 0).unsqueeze(-1)
    allowed = allowed & same_doc
    rows = allowed.any(dim=-1, keepdim=True)
    allowed = allowed | (~rows & (key == query).unsqueeze(0))
    return allowed.unsqueeze(1), rows.unsqueeze(1)


@dataclass
class AttentionInputs:
    """What every attention layer of one forward needs besides its own tensors.

    doc_ids: `[B, past + S]` (0 = padding) or None when every token is real and in one document. vision_group_ids:
    `[B, S]` (-1 = text) for vision-bidirectional sliding layers, or None. ring: the `RingAttentionContext` of a
    CP step (then masks come from its global positions and doc ids, and the two fields above are unused).
    past_length: tokens already in the generation cache before these S (0 in training and for a prefill).
    """

    seq_len: int
    device: torch.device
    doc_ids: torch.Tensor | None = None
    vision_group_ids: torch.Tensor | None = None
    ring: Any = None
    past_length: int = 0
    _masks: dict[tuple[str, int | None], tuple[torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=dict, repr=False
    )
    _block_masks: dict[tuple[str, str, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_for(self, layer_type: str, sliding_window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The (mask, real rows) pair of a layer type, built on first use and reused by the other layers."""
        key = (layer_type, sliding_window)
        if key not in self._masks:
            self._masks[key] = build_attention_mask(
                seq_len=self.seq_len,
                device=self.device,
                doc_ids=self.doc_ids,
                vision_group_ids=self.vision_group_ids if layer_type == SLIDING else None,
                sliding_window=sliding_window,
                past_length=self.past_length,
            )
        return self._masks[key]

    def window_block_mask_for(self, layer_type: str, sliding_window: int) -> torch.Tensor | None:
        """The sliding-window path's per-block additive mask of a layer type (`_window_block_mask`), built once."""
        mask, _ = self.mask_for(layer_type, sliding_window)
        if mask is None or self.past_length or self.seq_len <= 2 * sliding_window:
            return None
        key = ("window_blocks", layer_type, sliding_window)
        if key not in self._block_masks:
            self._block_masks[key] = _window_block_mask(
                mask, window=sliding_window, block=_window_block(sliding_window)
            )
        return self._block_masks[key]


def _window_block(window: int) -> int:
    """Queries per block of the sliding-window path (each block reads `_window_keys(window, block)` keys)."""
    return max(min(window // 2, 32), 1)


def _window_keys(window: int, block: int) -> int:
    """Keys per query block: the `block + window - 1` it can see, rounded up to whole blocks (aligned windows)."""
    return -(-(block + window - 1) // block) * block


def _window_block_mask(mask: torch.Tensor, *, window: int, block: int) -> torch.Tensor:
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
) -> torch.Tensor:
    """Sliding-window SDPA as ONE call over all query blocks: blocks become the batch, K/V windows are views.

    q `[B, H, S, d]`, k/v `[B, H_kv, S, d]`, block_mask from `_window_block_mask` → `[B, H, S, d]`. The K/V windows
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
    out = F.scaled_dot_product_attention(
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


def _local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float,
    dropout: float,
    window: int | None = None,
    block_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of `[B, H, S, d]` tensors (K/V with fewer heads for GQA); `mask` None means causal.

    With `window` (a causal sliding window whose mask has no look-ahead), queries are processed in blocks of
    `_window_block(window)` tokens against only the keys their window reaches (`[start - window + 1, end)`), all
    blocks in one SDPA call (`_windowed_attention`): about block + window keys per query instead of S, the same
    result. `block_mask` is that path's mask when the caller cached it (built from `mask` otherwise).
    """
    gqa = k.shape[1] != q.shape[1]  # SDPA broadcasts K/V heads itself: no repeated copies
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    seq = q.shape[2]
    if window is None or mask is None or mask.dtype != torch.bool or seq <= 2 * window:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, dropout_p=dropout, enable_gqa=gqa
        )
    if block_mask is None:
        block_mask = _window_block_mask(mask, window=window, block=_window_block(window))
    return _windowed_attention(q, k, v, block_mask=block_mask, scale=scale, dropout=dropout)


class Gemma4Attention(nn.Module):
    """Self-attention of decoder layer `layer_idx` (parameter names as in transformers' `Gemma4TextAttention`).

    hidden_states: `[B, S, H]` → `[B, S, H]`. Sliding layers use `head_dim` and the sliding window; full layers
    use `global_head_dim`, proportional RoPE (from the caller's cos/sin) and, with `attention_k_eq_v`,
    `num_global_key_value_heads` and values taken from the raw key projection (no `v_proj`). KV-shared ("reuse")
    layers have no K/V weights and read the K/V of the last "store" layer of their type.
    """

    def __init__(self, config: Any, layer_idx: int) -> None:
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

        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps=eps)
        self.k_proj: nn.Linear | None = None
        self.v_proj: nn.Linear | None = None
        self.k_norm: Gemma4RMSNorm | None = None
        self.v_norm: Gemma4RMSNorm | None = None
        if not self.is_kv_shared_layer:
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps=eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps=eps, with_scale=False)
            self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
            if not self.use_alternative_attention:
                self.v_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def _keys_and_values(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shared: Any, cache: Any
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
        keys = _rotary(self.k_norm(keys), cos, sin).transpose(1, 2)
        values = self.v_norm(values).transpose(1, 2)
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx)
        if self.store_full_length_kv and shared is not None:
            shared[self.layer_type] = (keys, values)
        return keys, values

    def cp_problem(self) -> str | None:
        """What this layer cannot honour under context parallelism in its current mode (None: nothing): attention
        dropout while training (the ring has none). The rule of the forward's check and of the models' `cp_problems`
        hook, which trainers call before any collective."""
        dropout = self.attention_dropout if self.training else 0.0
        if dropout:
            return f"attention_dropout={dropout} is not supported under context parallelism; set it to 0"
        return None

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
        batch, seq = hidden_states.shape[:2]
        queries = self.q_proj(hidden_states).view(batch, seq, -1, self.head_dim)
        queries = _rotary(self.q_norm(queries), cos, sin).transpose(1, 2)
        keys, values = self._keys_and_values(hidden_states, cos, sin, shared_kv_states, cache)
        dropout = self.attention_dropout if self.training else 0.0

        ring = attention_inputs.ring if attention_inputs is not None else active_ring_context()
        if ring is not None:
            problem = self.cp_problem()  # the last line of defence; trainers ask `cp_problems` before any collective
            if problem is not None:
                raise NotImplementedError(problem)
            out = ring.attention(
                queries, keys, values, causal=True, sliding_window=self.sliding_window, scale=self.scaling
            )
        elif attention_inputs is not None and attention_inputs.past_length:
            # A cached step: the keys are the cache's (at most the window on sliding layers) then the new ones, i.e.
            # the last columns of the mask over all tokens; None = every key visible (not causal: S = 1).
            mask, rows = attention_inputs.mask_for(self.layer_type, self.sliding_window)
            if mask is not None:
                mask = mask[..., mask.shape[-1] - keys.shape[2] :]
            out = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=mask,
                scale=self.scaling,
                dropout_p=dropout,
                enable_gqa=keys.shape[1] != queries.shape[1],
            )
            if rows is not None:
                out = out * rows.to(out.dtype)
        elif attention_inputs is not None:
            mask, rows = attention_inputs.mask_for(self.layer_type, self.sliding_window)
            lookahead = attention_inputs.vision_group_ids is not None  # image tokens may see keys ahead
            window = None if lookahead else self.sliding_window
            block_mask = None if window is None else attention_inputs.window_block_mask_for(self.layer_type, window)
            out = _local_attention(
                queries,
                keys,
                values,
                mask=mask,
                scale=self.scaling,
                dropout=dropout,
                window=window,
                block_mask=block_mask,
            )
            if rows is not None:
                out = out * rows.to(out.dtype)
        else:
            mask = attention_mask
            if mask is None and self.sliding_window is not None:
                mask, _ = build_attention_mask(
                    seq_len=seq,
                    device=hidden_states.device,
                    doc_ids=None,
                    vision_group_ids=None,
                    sliding_window=self.sliding_window,
                )
                out = _local_attention(
                    queries, keys, values, mask=mask, scale=self.scaling, dropout=dropout, window=self.sliding_window
                )
            else:
                out = _local_attention(queries, keys, values, mask=mask, scale=self.scaling, dropout=dropout)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
