"""`NemotronBlock`: the pre-norm residual block `x + mixer(norm(x))` with one of four mixers.

What it is for: choosing the mixer per layer kind — "mamba" (`Mamba2Mixer`), "attention" (`NemotronAttention`),
"mlp" (`NemotronMLP`), "moe" (`NemotronMoE`) — and routing to each only the inputs it uses (padding mask to Mamba
and MoE, the boolean attention mask to attention, `seq_idx` to Mamba, the cache to Mamba and attention).
What it must not do: mutate the `BackendConfig` it is given (upstream sets `gate_precision` on the shared object);
the MoE reads the gate precision and keeps its own default.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from am_precision import BackendConfig, initialize_rms_norm_module

from ._init import reset_linear_
from .attention import NemotronAttention
from .backend import resolve_backend
from .config import BLOCK_KINDS, NemotronConfig
from .mamba2 import Mamba2Mixer
from .moe import NemotronMLP, NemotronMoE

__all__ = ["NemotronBlock"]


class NemotronBlock(nn.Module):
    """Pre-norm residual block. hidden_states: [B, S, H] -> [B, S, H].

    Args:
        config: the normalized config (or any config `NemotronConfig.from_any` reads); the MoE is built from its MoE
            fields.
        layer_idx: global index (cache slot; MTP sublayers use num_hidden_layers + their index).
        backend: kernel choices (`linear`, `rms_norm`, `attn`, `experts`, `te_fp8`); None -> `default_backend()`;
            a value that cannot run is refused (`resolve_backend`). With `te_fp8` the block's forward runs inside
            `te_fp8.maybe_te_autocast()`, so its Transformer Engine modules compute in FP8.
        block_type: the kind; default `config.layers_block_type[layer_idx]`.

    Raises:
        ValueError: an unknown `block_type`.
    """

    def __init__(
        self,
        config: NemotronConfig | Any,
        layer_idx: int,
        *,
        backend: BackendConfig | None = None,
        block_type: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        config = NemotronConfig.from_any(config)  # a raw transformers / NVIDIA config works too
        backend = resolve_backend(backend, owner=type(self).__name__)
        self.te_fp8 = backend.te_fp8
        kind = block_type if block_type is not None else config.layers_block_type[layer_idx]
        if kind not in BLOCK_KINDS:
            raise ValueError(f"Invalid block_type {kind!r} for layer {layer_idx}; expected one of {BLOCK_KINDS}.")
        self.block_type = kind
        self.layer_idx = layer_idx
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = initialize_rms_norm_module(
            backend.rms_norm, config.hidden_size, eps=config.layer_norm_epsilon, device=device, dtype=dtype
        )
        self.mixer: nn.Module
        if kind == "mamba":
            self.mixer = Mamba2Mixer(config, layer_idx, backend=backend, device=device, dtype=dtype)
        elif kind == "attention":
            self.mixer = NemotronAttention(config, layer_idx, backend=backend, device=device, dtype=dtype)
        elif kind == "mlp":
            self.mixer = NemotronMLP(
                config.hidden_size,
                config.intermediate_size,
                bias=config.mlp_bias,
                activation=config.mlp_hidden_act,
                backend=backend,
                device=device,
                dtype=dtype,
            )
        else:
            self.mixer = NemotronMoE(config, backend=backend, device=device, dtype=dtype)

    @property
    def layer_type(self) -> str:
        """transformers-style kind: "full_attention" for attention, else the block kind."""
        return "full_attention" if self.block_type == "attention" else self.block_type

    @torch.no_grad()
    def init_weights(self, *, num_hidden_layers: int, rescale_prenorm_residual: bool) -> None:
        reset_linear_(self.norm)
        if isinstance(self.mixer, Mamba2Mixer):
            self.mixer.init_weights(
                num_hidden_layers=num_hidden_layers, rescale_prenorm_residual=rescale_prenorm_residual
            )
        else:
            self.mixer.init_weights()  # type: ignore[operator]

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        mamba_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        cache: Any | None = None,
        cp: Any | None = None,
    ) -> torch.Tensor:
        """attention_mask: boolean [B, 1, q, kv] or None; mamba_mask: [B, S] 1 keep / 0 pad;
        padding_mask: [B, S] True = pad (MoE routing); seq_idx: [B, S] packed document ids; cp: context
        parallelism (`cp.NemotronCPContext`): Mamba passes states over `cp.mamba`, attention runs `cp.ring`'s ring,
        MLP / MoE are token-local."""
        fp8 = self.te_fp8.maybe_te_autocast() if self.te_fp8 is not None else contextlib.nullcontext()
        with fp8:
            residual = hidden_states
            normed = self.norm(hidden_states)
            if self.block_type == "mamba":
                mamba_cp = cp.mamba if cp is not None else None
                out = self.mixer(normed, cache=cache, attention_mask=mamba_mask, seq_idx=seq_idx, cp=mamba_cp)
            elif self.block_type == "attention":
                ring = cp.ring if cp is not None else None
                out = self.mixer(normed, attention_mask=attention_mask, cache=cache, ring=ring)
            elif self.block_type == "moe":
                out = self.mixer(normed, padding_mask=padding_mask)
            else:
                out = self.mixer(normed)
            if self.residual_in_fp32:
                return (residual.float() + out.float()).to(hidden_states.dtype)
            return residual + out
