"""The published configurations of Gemma 4 26B-A4B (MoE) and 31B (dense) as data (config only, no weights), and
their size.

What it is for: `PRESETS` maps a preset name to an HF `config.json` dict of the published image-text checkpoint
(`Gemma4ForConditionalGeneration`; one JSON file per preset in `preset_configs/`; the README cites the source of each
field); `preset_config(name)` gives the config object `from_pretrained` builds from that folder (`text_only=True`: its
`Gemma4TextConfig`, what `Gemma4ForCausalLM` takes); `save_preset_config(name, folder)` writes a `config.json`-only
folder; `count_parameters(...)` builds the model on the meta device and counts its parameters: the text model (what
Google's "Total Parameters" figures count), the vision tower apart, and the parameters active per token.
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

import torch

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

PRESET_NAMES: tuple[str, ...] = ("gemma4-26b-a4b", "gemma4-31b")

# What the vision-language model holds besides the text model (transformers' attribute names, see `vlm.py`).
_VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.")


def _read_preset(name: str) -> dict[str, Any]:
    text = resources.files(__package__).joinpath("preset_configs", f"{name}.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


PRESETS: dict[str, dict[str, Any]] = {name: _read_preset(name) for name in PRESET_NAMES}
"""Preset name -> the HF `config.json` dict (`model_type` "gemma4", text + vision sub-configs, no audio)."""


def preset_dict(name: str) -> dict[str, Any]:
    """A deep copy of the `config.json` dict of preset `name`.

    Raises:
        KeyError: `name` is not a preset (the known names are listed).
    """
    if name not in PRESETS:
        raise KeyError(f"unknown Gemma 4 preset {name!r}; known presets: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def preset_config(name: str, *, text_only: bool = False) -> Any:
    """The transformers config of preset `name`, as `from_pretrained` builds it from a folder with this config.json.

    Args:
        text_only: False: the `Gemma4Config` (text + vision) that `Gemma4ForConditionalGeneration` takes; True: its
            `Gemma4TextConfig`, for `Gemma4ForCausalLM`.

    Raises:
        KeyError: `name` is not a preset.
    """
    from transformers import Gemma4Config

    config = Gemma4Config.from_dict(preset_dict(name))
    return config.text_config if text_only else config


def save_preset_config(name: str, folder: str | os.PathLike[str], *, text_only: bool = False) -> Path:
    """Write preset `name`'s `config.json` into `folder` (created if needed); return the file's path.

    text_only: write the text sub-config alone (`model_type` "gemma4_text", `architectures` ["Gemma4ForCausalLM"]),
    the folder `Gemma4ForCausalLM.from_pretrained` reads. The folder loads like a checkpoint folder without weights
    (`AutoConfig.from_pretrained(folder)`, the reference trainer's `--model-path folder` for dry runs).
    """
    config = preset_dict(name)
    if text_only:
        config = {"architectures": ["Gemma4ForCausalLM"], **config["text_config"]}
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


@dataclass(frozen=True)
class ParameterCount:
    """Parameter counts of one Gemma 4 model (every tensor once: the tied LM head is the input embedding).

    total: the text model (embedding, decoder layers, final norm) — what Google's "Total Parameters" counts.
    active: what one token's forward uses in the text model: `total - routed_experts * (1 - top_k / num_experts)`
    (every expert has the same size); equal to `total` for a dense model.
    routed_experts: the parameters of all MoE experts (the dense MLP beside them, Google's "1 shared", is not routed).
    embedding: the input embedding table (also the LM head).
    vision: the vision tower and its projector into the text model (0 for a text-only config).
    """

    total: int
    active: int
    routed_experts: int
    embedding: int
    vision: int

    @property
    def total_with_vision(self) -> int:
        """Every parameter of the image-text model (`Gemma4ForConditionalGeneration`)."""
        return self.total + self.vision


def count_parameters(config: Any) -> ParameterCount:
    """Count the parameters of the Gemma 4 model `config` describes, without allocating them.

    Args:
        config: a preset name (`PRESET_NAMES`; the image-text model), a `Gemma4Config` (built as
            `Gemma4ForConditionalGeneration`) or a `Gemma4TextConfig` (built as `Gemma4ForCausalLM`).

    Builds the model under `torch.device("meta")` (no storage; under a second for the presets) and sums `numel`.

    Raises:
        KeyError: an unknown preset name. ValueError: a config this package cannot build (as the model raises it).
    """
    from .config import text_config_of
    from .model import Gemma4ForCausalLM
    from .vlm import Gemma4ForConditionalGeneration

    if isinstance(config, str):
        config = preset_config(config)
    model: torch.nn.Module
    with torch.device("meta"):
        if getattr(config, "text_config", None) is not None:
            model = Gemma4ForConditionalGeneration(config)
        else:
            model = Gemma4ForCausalLM(config)
    everything = 0
    vision = 0
    for name, param in model.named_parameters():  # each shared (tied) tensor once
        everything += param.numel()
        if name.startswith(_VISION_PREFIXES):
            vision += param.numel()
    routed = sum(
        p.numel()
        for module in model.modules()
        if isinstance(module, am_moe.GroupedExperts)
        for p in module.parameters(recurse=False)
    )
    unused = 0
    if routed:
        text = text_config_of(config)
        experts, top_k = int(text.num_experts), int(text.top_k_experts)
        # Exact in integers: the routed parameters are `experts` equal stacks, of which top_k run per token.
        unused = routed * (experts - top_k) // experts
    total = everything - vision
    embed_tokens = model.get_input_embeddings()
    embedding = sum(p.numel() for p in embed_tokens.parameters())
    return ParameterCount(total=total, active=total - unused, routed_experts=routed, embedding=embedding, vision=vision)
