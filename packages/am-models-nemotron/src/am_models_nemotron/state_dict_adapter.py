"""Translating state dicts between checkpoint naming and this package's module names.

What it is for: `NemotronStateDictAdapter.from_hf` reads NVIDIA's published naming (`backbone.embeddings`,
`backbone.layers.{i}.mixer.A_log`, per-expert `mixer.experts.{e}.up_proj.weight`, `backbone.norm_f`, `mtp.layers.*`)
and transformers' in-memory naming (`model.` prefix, stacked `mixer.experts.up_proj` [E, I, D]) — which is also what
`transformers.NemotronHForCausalLM.state_dict()` returns; `to_hf` writes NVIDIA's naming (what
`transformers.save_pretrained` writes too). Internal names: `model.embed_tokens`, `model.layers.{i}`, `model.norm`,
`mixer._fp32_params.{A_log,dt_bias,D}`, stacked experts `mixer.experts.up_proj` [E, I, D] / `down_proj` [E, D, I].
Which tensors are fp32-pinned (`forced_fp32`) is not listed here: it is the model class's
`_keep_in_fp32_modules_strict` matched against the internal name, as the casts match it.
What it must not do: guess. A key it cannot place is returned unchanged, so the loader's strict key check reports it;
an incomplete expert set is reported with every missing expert.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch

from am_precision import fp32_keep_rules, match_keep_rule

from .config import NemotronConfig
from .model import NemotronHForCausalLM

__all__ = ["NemotronStateDictAdapter"]

_PEFT_PREFIX = "base_model.model."
_PER_EXPERT = re.compile(r"^(?P<owner>.*\.mixer\.experts)\.(?P<expert>\d+)\.(?P<proj>up_proj|down_proj)\.weight$")


class NemotronStateDictAdapter:
    """Name and layout conversion for one config (knows which layers are Mamba and how many experts exist).

    `dtype` None (default) keeps every tensor's dtype; a dtype casts the floating tensors `from_hf` and `to_hf` return
    to it, except the fp32-pinned ones (`forced_fp32`), which become fp32. The layout does not depend on the backend
    (every backend this package runs stores experts stacked).

    Raises:
        ValueError: a `dtype` that is not a floating torch dtype.
    """

    def __init__(self, config: Any, *, dtype: torch.dtype | None = None) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"{type(self).__name__}: dtype={dtype!r} must be a floating torch.dtype or None (keep each tensor's "
                "dtype)"
            )
        self.config = NemotronConfig.from_any(config)
        self.dtype = dtype
        self._fp32_rules = fp32_keep_rules(NemotronHForCausalLM)

    def _cast(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.dtype is None:
            return state_dict
        return {
            name: tensor.to(torch.float32 if self.forced_fp32(name) else self.dtype)
            if tensor.is_floating_point()
            else tensor
            for name, tensor in state_dict.items()
        }

    # ------------------------------------------------------------------------------------------------------------
    def from_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint names -> internal names; per-expert tensors are stacked.

        Raises:
            ValueError: an expert set is incomplete or ambiguous (every problem listed).
        """
        renamed: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
        for key, tensor in state_dict.items():
            name = self._internal_name(key)
            match = _PER_EXPERT.match(name)
            if match:
                experts[(match["owner"], match["proj"])][int(match["expert"])] = tensor
                continue
            renamed[name] = tensor
        problems: list[str] = []
        for (owner, proj), by_index in sorted(experts.items()):
            expected = self.config.n_routed_experts
            missing = [e for e in range(expected) if e not in by_index]
            extra = sorted(e for e in by_index if e >= expected)
            if missing or extra:
                problems.append(
                    f"{owner}.{{e}}.{proj}.weight: missing experts {missing}, unexpected experts {extra} "
                    f"(config n_routed_experts={expected})"
                )
                continue
            stacked_key = f"{owner}.{proj}"
            if stacked_key in renamed:
                problems.append(f"{stacked_key} is given both stacked and per expert")
                continue
            renamed[stacked_key] = torch.stack([by_index[e] for e in range(expected)])
        if problems:
            listed = "\n".join(f"  - {p}" for p in problems)
            raise ValueError(f"Cannot assemble the expert weights ({len(problems)} problem(s)):\n{listed}")
        return self._cast(renamed)

    def internal_key(self, key: str) -> str:
        """The internal name `key` (checkpoint naming) is loaded into; per-expert keys name the stacked tensor."""
        name = self._internal_name(key)
        match = _PER_EXPERT.match(name)
        return f"{match['owner']}.{match['proj']}" if match else name

    def expert_index(self, key: str) -> int | None:
        """The expert a per-expert checkpoint key holds (`...mixer.experts.{e}.up_proj.weight` -> e), else None;
        `from_hf` stacks the keys of one internal name in this order."""
        match = _PER_EXPERT.match(self._internal_name(key))
        return int(match["expert"]) if match else None

    def _internal_name(self, key: str) -> str:
        name = key.removeprefix(_PEFT_PREFIX)
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        if name in ("model.embeddings.weight",):
            return "model.embed_tokens.weight"
        if name == "model.norm_f.weight":
            return "model.norm.weight"
        match = re.match(r"^(?P<prefix>(?:model|mtp)\.layers\.\d+\.mixer)\.(?P<param>A_log|dt_bias|D)$", name)
        if match and self._is_mamba(match["prefix"]):
            return f"{match['prefix']}._fp32_params.{match['param']}"
        return name

    def _is_mamba(self, mixer_prefix: str) -> bool:
        parts = mixer_prefix.split(".")
        index = int(parts[2])
        if parts[0] == "model":
            kinds = self.config.layers_block_type
            return 0 <= index < len(kinds) and kinds[index] == "mamba"
        pattern = self.config.mtp_layers_block_type
        return bool(pattern) and pattern[index % len(pattern)] == "mamba"

    # ------------------------------------------------------------------------------------------------------------
    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Internal names -> NVIDIA naming (`backbone.*`, per-expert tensors, fp32 holder hidden)."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            name = key
            if name == "model.embed_tokens.weight":
                name = "backbone.embeddings.weight"
            elif name == "model.norm.weight":
                name = "backbone.norm_f.weight"
            elif name.startswith("model."):
                name = "backbone." + name.removeprefix("model.")
            name = name.replace("._fp32_params.", ".")
            if re.search(r"\.mixer\.experts\.(up_proj|down_proj)$", name):
                for expert, weight in enumerate(tensor.unbind(0)):
                    out[f"{name.rsplit('.', 1)[0]}.{expert}.{name.rsplit('.', 1)[1]}.weight"] = weight
                continue
            out[name] = tensor
        return self._cast(out)

    def forced_fp32(self, name: str) -> bool:
        """Whether tensor `name` (checkpoint or internal naming) is fp32-pinned, so it is loaded and stored as F32.

        Decided by `NemotronHForCausalLM._keep_in_fp32_modules_strict` on the internal name (e.g. checkpoint
        `backbone.layers.0.mixer.A_log` is `model.layers.0.mixer._fp32_params.A_log`, pinned by `_fp32_params`).
        """
        return match_keep_rule(self._internal_name(name), self._fp32_rules) is not None
