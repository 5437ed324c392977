"""The published Nemotron 3 Nano 30B-A3B configuration as a preset: its size matches NVIDIA's figures, it builds on
the meta device without memory, and it round-trips through the HF config.json path unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from am_models_nemotron import NemotronConfig, NemotronHForCausalLM, as_hf_config
from am_models_nemotron.presets import (
    PRESET_NAMES,
    PRESETS,
    count_parameters,
    preset_config,
    preset_dict,
    save_preset_config,
)

NANO = "nemotron-3-nano-30b-a3b"
# A published figure "31.6B" is rounded to 0.1B: the exact count lies within half of that step.
HALF_OF_LAST_DIGIT = 0.05e9


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_preset_has_the_published_layout() -> None:
    """52 blocks: 23 Mamba-2, 23 MoE (128 routed experts + 1 shared, top-6), 6 GQA attention (32 query / 2 KV heads)
    — NVIDIA's model card (huggingface.co/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16)."""
    cfg = NemotronConfig.from_any(preset_config(NANO))
    kinds = cfg.layers_block_type
    assert len(kinds) == 52
    assert (kinds.count("mamba"), kinds.count("moe"), kinds.count("attention")) == (23, 23, 6)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (128, 6)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 2)
    assert cfg.num_nextn_predict_layers == 0  # the published checkpoint has no MTP layers


def test_parameter_counts_match_nvidia() -> None:
    """31.6B total, 3.2B active (3.6B with embeddings): NVIDIA, "Nemotron 3 Nano is a 3.2B active (3.6B with
    embeddings), 31.6B total parameter model" (Nemotron 3 release / technical report, arXiv:2512.20848). "With
    embeddings" counts the input embedding table; the LM head is part of every token's compute in both figures."""
    counts = count_parameters(NANO)
    assert abs(counts.total - 31.6e9) <= HALF_OF_LAST_DIGIT, counts
    assert abs(counts.active - 3.6e9) <= HALF_OF_LAST_DIGIT, counts
    assert abs(counts.active_without_embedding - 3.2e9) <= HALF_OF_LAST_DIGIT, counts
    # The routed experts are 23 layers x 128 experts x (up [1856, 2688] + down [2688, 1856]), exactly.
    assert counts.routed_experts == 23 * 128 * 2 * 1856 * 2688
    assert counts.embedding == 131072 * 2688


def test_the_meta_build_allocates_nothing() -> None:
    """Every parameter and buffer of the full-size model lives on the meta device (no storage behind it)."""
    model = NemotronHForCausalLM(preset_config(NANO), device="meta")
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors
    assert all(t.device.type == "meta" for t in tensors)


def test_config_round_trips_through_the_hf_folder(tmp_path: Path) -> None:
    """config.json written by `save_preset_config` and by `save_pretrained` of the config object both load back (the
    path `from_pretrained` takes: `AutoConfig`, then `as_hf_config`) into the same config and the same model shape."""
    path = save_preset_config(NANO, tmp_path / "published")
    assert json.loads(path.read_text()) == PRESETS[NANO]

    direct = preset_config(NANO)
    from_file = as_hf_config(AutoConfig.from_pretrained(str(tmp_path / "published")))
    direct.save_pretrained(str(tmp_path / "resaved"))
    resaved = as_hf_config(AutoConfig.from_pretrained(str(tmp_path / "resaved")))

    expected = NemotronConfig.from_any(direct)
    assert NemotronConfig.from_any(from_file) == expected
    assert NemotronConfig.from_any(resaved) == expected
    shapes = _shapes(NemotronHForCausalLM(direct, device="meta"))
    assert _shapes(NemotronHForCausalLM(from_file, device="meta")) == shapes
    assert _shapes(NemotronHForCausalLM(resaved, device="meta")) == shapes


def test_presets_are_copies_and_unknown_names_are_named() -> None:
    """A caller cannot change a preset; an unknown name lists the known ones."""
    assert tuple(PRESETS) == PRESET_NAMES
    copy = preset_dict(NANO)
    copy["hidden_size"] = 1
    assert PRESETS[NANO]["hidden_size"] == 2688
    with pytest.raises(KeyError, match=NANO):
        preset_config("nemotron-nano-30b")
