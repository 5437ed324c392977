"""Rename and re-layout state dicts between transformers' Gemma 4 and this package.

What it is for: the MoE block is the only difference. transformers keeps `layers.N.router.{proj.weight, scale,
per_expert_scale}` and `layers.N.experts.gate_up_proj [E, 2I, H]` / `layers.N.experts.down_proj [E, H, I]`; we keep
`layers.N.moe.router.*` and `layers.N.moe.experts.gate_up_proj [E, H, 2I]` / `down_proj [E, I, H]` (transposed, so a
block of tokens is multiplied without a transpose). Every other key passes through unchanged, with any prefix
(`model.`, `model.language_model.`).
What it must not do: fold or drop anything (the per-expert scale stays its own parameter, as in transformers), or
copy tensors that need no change.
"""

from __future__ import annotations

import re

import torch

__all__ = ["Gemma4StateDictAdapter"]

_HF_MOE = re.compile(r"^(?P<prefix>.*layers\.\d+\.)(?P<part>router|experts)\.(?P<rest>.+)$")
_OUR_MOE = re.compile(r"^(?P<prefix>.*layers\.\d+\.)moe\.(?P<part>router|experts)\.(?P<rest>.+)$")
_TRANSPOSED = ("gate_up_proj", "down_proj")


class Gemma4StateDictAdapter:
    """`from_hf(state_dict)` / `to_hf(state_dict)`: pure functions of the keys; shapes are checked by the loader."""

    @staticmethod
    def internal_key(key: str) -> str:
        """Our name for the transformers key `key` (what `from_hf` renames it to)."""
        match = _HF_MOE.match(key)
        return key if match is None else f"{match['prefix']}moe.{match['part']}.{match['rest']}"

    @staticmethod
    def from_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers names and layouts → ours."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            match = _HF_MOE.match(key)
            if match is None:
                out[key] = tensor
                continue
            part, rest = match["part"], match["rest"]
            if part == "experts" and rest in _TRANSPOSED:
                tensor = tensor.transpose(-2, -1).contiguous()
            out[f"{match['prefix']}moe.{part}.{rest}"] = tensor
        return out

    @staticmethod
    def to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our names and layouts → transformers'."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            match = _OUR_MOE.match(key)
            if match is None:
                out[key] = tensor
                continue
            part, rest = match["part"], match["rest"]
            if part == "experts" and rest in _TRANSPOSED:
                tensor = tensor.transpose(-2, -1).contiguous()
            out[f"{match['prefix']}{part}.{rest}"] = tensor
        return out
