"""Rename state dicts between transformers' Gemma 4 and this package.

What it is for: the MoE block is the only difference. transformers keeps `layers.N.router.{proj.weight, scale,
per_expert_scale}` and `layers.N.experts.{gate_up_proj [E, 2I, H], down_proj [E, H, I]}` directly in the decoder
layer; we keep the same tensors in the same layouts under `layers.N.moe.router.*` / `layers.N.moe.experts.*`
(`am_moe.GroupedExperts` stores transformers' `[E, out, in]` layout, so nothing is transposed). Every other key passes
through unchanged, with any prefix (`model.`, `model.language_model.`).
What it must not do: fold, drop or copy anything (the per-expert scale stays its own parameter, as in transformers;
every tensor is handed on as the same object).
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["Gemma4StateDictAdapter", "NativeStateDictLayout", "checkpoint_adapter"]

_HF_MOE = re.compile(r"^(?P<prefix>.*layers\.\d+\.)(?P<part>router|experts)\.(?P<rest>.+)$")
_OUR_MOE = re.compile(r"^(?P<prefix>.*layers\.\d+\.)moe\.(?P<part>router|experts)\.(?P<rest>.+)$")


class Gemma4StateDictAdapter:
    """`from_hf(state_dict)` / `to_hf(state_dict)`: pure functions of the keys; shapes are checked by the loader."""

    @staticmethod
    def internal_key(key: str) -> str:
        """Our name for the transformers key `key` (what `from_hf` renames it to)."""
        match = _HF_MOE.match(key)
        return key if match is None else f"{match['prefix']}moe.{match['part']}.{match['rest']}"

    @staticmethod
    def from_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers names → ours."""
        return {Gemma4StateDictAdapter.internal_key(key): tensor for key, tensor in state_dict.items()}

    @staticmethod
    def to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our names → transformers'."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            match = _OUR_MOE.match(key)
            out[key if match is None else f"{match['prefix']}{match['part']}.{match['rest']}"] = tensor
        return out


class NativeStateDictLayout:
    """The checkpoint layout of `BackendConfig(enable_hf_state_dict_adapter=False)`: the model's own state-dict keys
    (`layers.N.moe.router.*`, `layers.N.moe.experts.*`), written and read as they are (upstream: no adapter)."""

    @staticmethod
    def internal_key(key: str) -> str:
        return key

    @staticmethod
    def from_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state_dict)

    @staticmethod
    def to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state_dict)


def checkpoint_adapter(backend: Any) -> type[Gemma4StateDictAdapter] | type[NativeStateDictLayout]:
    """The layout `from_pretrained` / `save_pretrained` / `load_sharded_checkpoint` use: transformers' names
    (`Gemma4StateDictAdapter`), or the native keys when `backend.enable_hf_state_dict_adapter` is False."""
    if backend is not None and not backend.enable_hf_state_dict_adapter:
        return NativeStateDictLayout
    return Gemma4StateDictAdapter
