"""The published configurations of real Nemotron-H models as data (config only, no weights), and their size.

What it is for: `PRESETS` maps a preset name to the model's HF `config.json` exactly as published (one JSON file per
preset in `preset_configs/`; the README cites each number's source); `preset_config(name)` gives the config object
`from_pretrained` builds from that folder; `save_preset_config(name, folder)` writes a `config.json`-only folder
(what `--model-path` and `from_pretrained(config=...)` read); `count_parameters(...)` builds the model on the meta
device and counts its parameters, total and active per token.
What it must not do: allocate parameter memory (the count builds on the meta device only), or let a caller change a
preset (every function returns a fresh copy).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import am_moe

__all__ = [
    "PRESETS",
    "PRESET_NAMES",
    "ParameterCount",
    "count_parameters",
    "preset_config",
    "preset_dict",
    "save_preset_config",
]

PRESET_NAMES: tuple[str, ...] = ("nemotron-3-nano-30b-a3b",)


def _read_preset(name: str) -> dict[str, Any]:
    text = resources.files(__package__).joinpath("preset_configs", f"{name}.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


PRESETS: dict[str, dict[str, Any]] = {name: _read_preset(name) for name in PRESET_NAMES}
"""Preset name -> the HF `config.json` dict as published (read it; `preset_config` / `preset_dict` give copies)."""


def preset_dict(name: str) -> dict[str, Any]:
    """A deep copy of the published `config.json` of preset `name`.

    Raises:
        KeyError: `name` is not a preset (the known names are listed).
    """
    if name not in PRESETS:
        raise KeyError(f"unknown Nemotron preset {name!r}; known presets: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def preset_config(name: str) -> Any:
    """The transformers `NemotronHConfig` of preset `name`: the object `NemotronHForCausalLM.from_pretrained` builds
    from a folder holding this `config.json` (`AutoConfig` reading, then `as_hf_config`).

    Raises:
        KeyError: `name` is not a preset.
    """
    from transformers import NemotronHConfig

    from .config import as_hf_config

    return as_hf_config(NemotronHConfig.from_dict(preset_dict(name)))


def save_preset_config(name: str, folder: str | os.PathLike[str]) -> Path:
    """Write preset `name`'s published `config.json` into `folder` (created if needed); return the file's path.

    The folder then loads like a checkpoint folder without weights: `AutoConfig.from_pretrained(folder)`, the
    reference trainer's `--model-path folder` (dry runs), `NemotronHForCausalLM.from_pretrained(..., config=...)`.
    """
    config = preset_dict(name)
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


@dataclass(frozen=True)
class ParameterCount:
    """Parameter counts of one model (every tensor once; Nemotron-H's input and output embeddings are separate).

    total: every parameter. routed_experts: the parameters of all routed experts (the shared expert is not routed).
    active: what one token's forward uses: `total - routed_experts * (1 - top_k / n_routed_experts)` (every routed
    expert has the same size, so top_k of them is that fraction). embedding: the input embedding table
    (`model.embed_tokens`), which a token reads one row of; NVIDIA quotes "active" with and without it.
    """

    total: int
    active: int
    routed_experts: int
    embedding: int

    @property
    def active_without_embedding(self) -> int:
        """Active parameters without the input embedding table (NVIDIA's "3.2B active"; the LM head counts)."""
        return self.active - self.embedding


def count_parameters(config: Any) -> ParameterCount:
    """Count the parameters of `NemotronHForCausalLM(config)` without allocating them.

    Args:
        config: a preset name (`PRESET_NAMES`), or any config the model accepts (transformers `NemotronHConfig`,
            NVIDIA's config, a dict).

    Builds the model on the meta device (no storage, no initialization; about 2 s for the 30B preset on one CPU
    core) and sums `numel` over its parameters.

    Raises:
        KeyError: an unknown preset name. ValueError: an invalid config (as the model raises it).
    """
    from .model import NemotronHForCausalLM

    if isinstance(config, str):
        config = preset_config(config)
    model = NemotronHForCausalLM(config, device="meta")
    total = sum(p.numel() for p in model.parameters())
    routed = sum(
        p.numel()
        for module in model.modules()
        if isinstance(module, am_moe.GroupedExperts)
        for p in module.parameters(recurse=False)
    )
    cfg = model.nemotron_config
    # Exact in integers: the routed parameters are n_routed_experts equal stacks, of which top_k run per token.
    unused = routed * (cfg.n_routed_experts - cfg.num_experts_per_tok) // cfg.n_routed_experts
    embed_tokens = model.get_input_embeddings()
    embedding = sum(p.numel() for p in embed_tokens.parameters()) if embed_tokens is not None else 0
    return ParameterCount(total=total, active=total - unused, routed_experts=routed, embedding=embedding)
