"""`NemotronHybridCache`: generation state of a Nemotron-H model.

What it is for: a conv window [B, conv_dim, conv_kernel] and an SSM state [B, heads, head_dim, N] in the slot of
EVERY layer index (as NeMo AutoModel's cache: code that indexes `conv_states[i]` / `ssm_states[i]` by any layer finds
one; only the Mamba layers write theirs), and per attention layer growing K/V [B, kv_heads, T, head_dim].
`has_previous_state` tells the Mamba mixers to take the one-token decode step instead of a prefill;
`seen_tokens` counts the tokens the model has run through the cache (the sequence length of a model without
attention layers).
What it must not do: keep SSM states in a low-precision dtype — they accumulate over the whole sequence, so they are
fp32 whatever the model dtype (upstream keeps them in the model dtype; transformers keeps fp32).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import NemotronConfig

__all__ = ["NemotronHybridCache"]


class NemotronHybridCache:
    """Conv/SSM states for Mamba layers and K/V for attention layers.

    Args:
        config: any config `NemotronConfig.from_any` reads.
        batch_size: rows being generated.
        dtype: dtype of conv windows and K/V (the model's activation dtype).
        device: where the states live.
        ssm_state_dtype: dtype of the SSM states (fp32 by default; keep it).
    """

    is_compileable = False

    def __init__(
        self,
        config: Any,
        batch_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        ssm_state_dtype: torch.dtype = torch.float32,
    ) -> None:
        cfg = NemotronConfig.from_any(config)
        self.batch_size = batch_size
        self.dtype = dtype
        self.has_previous_state = False
        self.seen_tokens = 0
        conv_dim = cfg.mamba_intermediate_size + 2 * cfg.n_groups * cfg.ssm_state_size
        self.conv_states: dict[int, torch.Tensor] = {}
        self.ssm_states: dict[int, torch.Tensor] = {}
        self.key_cache: dict[int, torch.Tensor] = {}
        self.value_cache: dict[int, torch.Tensor] = {}
        self.attention_layers = [i for i, kind in enumerate(cfg.layers_block_type) if kind == "attention"]
        self.mamba_layers = [i for i, kind in enumerate(cfg.layers_block_type) if kind == "mamba"]
        for i in range(len(cfg.layers_block_type)):
            self.conv_states[i] = torch.zeros(batch_size, conv_dim, cfg.conv_kernel, dtype=dtype, device=device)
            self.ssm_states[i] = torch.zeros(
                batch_size,
                cfg.mamba_num_heads,
                cfg.mamba_head_dim,
                cfg.ssm_state_size,
                dtype=ssm_state_dtype,
                device=device,
            )

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key/value [B, kv_heads, q, d] of `layer_idx`; return the full [B, kv_heads, T, d] pair."""
        if layer_idx in self.key_cache:
            key = torch.cat([self.key_cache[layer_idx], key], dim=-2)
            value = torch.cat([self.value_cache[layer_idx], value], dim=-2)
        self.key_cache[layer_idx] = key
        self.value_cache[layer_idx] = value
        return key, value

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        """Tokens cached by `layer_idx` (default: the first attention layer, or `seen_tokens` without attention
        layers); 0 when empty."""
        if layer_idx is None:
            if not self.attention_layers:
                return self.seen_tokens
            layer_idx = self.attention_layers[0]
        cached = self.key_cache.get(layer_idx)
        return 0 if cached is None else int(cached.shape[-2])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder every state along the batch dim (beam search)."""
        for states in (self.conv_states, self.ssm_states, self.key_cache, self.value_cache):
            for i, tensor in states.items():
                states[i] = tensor.index_select(0, beam_idx.to(tensor.device))
