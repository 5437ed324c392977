"""Name mapping between checkpoint naming and module names."""

from __future__ import annotations

import torch
from am_nemotron_helpers import tiny_hf_config

from am_models_nemotron import NemotronStateDictAdapter


def test_prefixes_holder_and_experts_map_both_ways() -> None:
    adapter = NemotronStateDictAdapter(tiny_hf_config("ME"))
    hf = {
        "backbone.embeddings.weight": torch.zeros(1),
        "model.norm_f.weight": torch.zeros(1),
        "base_model.model.backbone.layers.0.mixer.A_log": torch.zeros(1),
        "backbone.layers.0.mixer.D": torch.zeros(1),
        **{f"backbone.layers.1.mixer.experts.{e}.down_proj.weight": torch.full((2, 3), float(e)) for e in range(6)},
    }
    native = adapter.from_hf(hf)
    assert set(native) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.mixer._fp32_params.A_log",
        "model.layers.0.mixer._fp32_params.D",
        "model.layers.1.mixer.experts.down_proj",
    }
    stacked = native["model.layers.1.mixer.experts.down_proj"]
    assert stacked.shape == (6, 2, 3)
    assert stacked[4].eq(4).all()
    back = adapter.to_hf(native)
    assert "backbone.layers.1.mixer.experts.5.down_proj.weight" in back
    assert "backbone.layers.0.mixer.A_log" in back
    assert "backbone.embeddings.weight" in back


def test_only_mamba_layers_get_the_fp32_holder_and_forced_dtypes() -> None:
    adapter = NemotronStateDictAdapter(tiny_hf_config("M*"))
    native = adapter.from_hf({"backbone.layers.1.mixer.D": torch.zeros(1)})
    assert list(native) == ["model.layers.1.mixer.D"]  # not a Mamba layer: left for the strict check to report
    assert adapter.forced_fp32("backbone.layers.0.mixer.dt_bias")
    assert adapter.forced_fp32("mtp.layers.1.mixer.gate.e_score_correction_bias")
    assert not adapter.forced_fp32("backbone.layers.0.mixer.in_proj.weight")


def test_forced_fp32_follows_the_model_classes_keep_list(monkeypatch) -> None:
    """The adapter lists no names of its own: it reads `_keep_in_fp32_modules_strict` from the model class."""
    from am_models_nemotron import NemotronHForCausalLM, NemotronV3Model

    assert NemotronHForCausalLM._keep_in_fp32_modules_strict is NemotronV3Model._keep_in_fp32_modules_strict
    config = tiny_hf_config("M*E")
    assert NemotronStateDictAdapter(config).forced_fp32("backbone.layers.2.mixer.gate.e_score_correction_bias")
    monkeypatch.setattr(NemotronHForCausalLM, "_keep_in_fp32_modules_strict", ["_fp32_params", "in_proj"])
    adapter = NemotronStateDictAdapter(config)
    assert not adapter.forced_fp32("backbone.layers.2.mixer.gate.e_score_correction_bias")
    assert adapter.forced_fp32("backbone.layers.0.mixer.in_proj.weight")
    assert adapter.forced_fp32("backbone.layers.0.mixer.A_log")
