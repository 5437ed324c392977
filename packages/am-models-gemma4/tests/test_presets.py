"""The published Gemma 4 26B-A4B and 31B configurations as presets: their sizes match Google's figures, they build on
the meta device without memory, and they round-trip through the HF config.json path unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from am_models_gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from am_models_gemma4.presets import (
    PRESET_NAMES,
    PRESETS,
    count_parameters,
    preset_config,
    preset_dict,
    save_preset_config,
)

MOE = "gemma4-26b-a4b"
DENSE = "gemma4-31b"
# A published figure such as "25.2B" is rounded to 0.1B: the exact count lies within half of that step.
HALF_OF_LAST_DIGIT = 0.05e9


def _meta(config: object) -> torch.nn.Module:
    with torch.device("meta"):
        if getattr(config, "text_config", None) is not None:
            return Gemma4ForConditionalGeneration(config)
        return Gemma4ForCausalLM(config)


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("name", "published_total", "published_active"),
    [(MOE, 25.2e9, 3.8e9), (DENSE, 30.7e9, 30.7e9)],
)
def test_parameter_counts_match_google(name: str, published_total: float, published_active: float) -> None:
    """Google's Gemma 4 model card (huggingface.co/google/gemma-4-26B-A4B, huggingface.co/google/gemma-4-31B):
    26B A4B "Total Parameters 25.2B, Active Parameters 3.8B", 31B "Total Parameters 30.7B", each with a vision
    encoder of "~550M" parameters. The totals are the text model's (embedding counted once, it is tied to the LM
    head) without the vision encoder, which the model card lists apart."""
    counts = count_parameters(name)
    assert abs(counts.total - published_total) <= HALF_OF_LAST_DIGIT, counts
    assert abs(counts.active - published_active) <= HALF_OF_LAST_DIGIT, counts
    # "~550M": the tower plus its projector into the text model; "~" rounds to the 50M step it is written in.
    assert abs(counts.vision - 0.55e9) <= 0.05e9, counts
    assert counts.total_with_vision == sum(p.numel() for p in _meta(preset_config(name)).parameters())


def test_moe_counts_exactly() -> None:
    """26B A4B: 30 layers x 128 experts x (gate_up [1408, 2816] + down [2816, 704]) routed, top-8 of them active."""
    counts = count_parameters(MOE)
    routed = 30 * 128 * (2 * 704 * 2816 + 2816 * 704)
    assert counts.routed_experts == routed
    assert counts.total - counts.active == routed * 120 // 128
    assert counts.embedding == 262144 * 2816


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_text_only_model_is_the_text_part(name: str) -> None:
    """`Gemma4ForCausalLM` on the preset's text config has exactly the text parameters of the image-text model."""
    full = count_parameters(name)
    text = count_parameters(preset_config(name, text_only=True))
    assert (text.total, text.active, text.routed_experts, text.vision) == (
        full.total,
        full.active,
        full.routed_experts,
        0,
    )


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_the_meta_build_allocates_nothing(name: str) -> None:
    """Every parameter and buffer of the full-size image-text model lives on the meta device (no storage)."""
    model = _meta(preset_config(name))
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors
    assert all(t.device.type == "meta" for t in tensors)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_config_round_trips_through_the_hf_folder(name: str, tmp_path: Path) -> None:
    """config.json written by `save_preset_config` and by `save_pretrained` of the config object load back through
    `AutoConfig` (what `from_pretrained` reads) into configs that build the same model shape; the text-only folder
    builds the text part of it."""
    path = save_preset_config(name, tmp_path / "published")
    assert json.loads(path.read_text()) == PRESETS[name]
    direct = preset_config(name)
    direct.save_pretrained(str(tmp_path / "resaved"))
    save_preset_config(name, tmp_path / "text", text_only=True)

    shapes = _shapes(_meta(direct))
    for folder in ("published", "resaved"):
        loaded = AutoConfig.from_pretrained(str(tmp_path / folder))
        assert type(loaded) is type(direct)
        assert _shapes(_meta(loaded)) == shapes, folder

    text = AutoConfig.from_pretrained(str(tmp_path / "text"))
    assert type(text) is type(direct.text_config)
    text_shapes = {f"model.language_model.{k[len('model.') :]}": v for k, v in _shapes(_meta(text)).items()}
    assert text_shapes == {k: v for k, v in shapes.items() if k.startswith("model.language_model.")}


def test_presets_are_copies_and_unknown_names_are_named() -> None:
    """A caller cannot change a preset; an unknown name lists the known ones."""
    assert tuple(PRESETS) == PRESET_NAMES
    copy = preset_dict(MOE)
    copy["text_config"]["num_experts"] = 1
    assert PRESETS[MOE]["text_config"]["num_experts"] == 128
    with pytest.raises(KeyError, match=DENSE):
        preset_config("gemma4-27b")
