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

import torch

__all__ = ["Gemma4StateDictAdapter"]

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
