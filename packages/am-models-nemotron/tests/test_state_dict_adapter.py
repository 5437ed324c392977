"""Name mapping between checkpoint naming and module names."""

from __future__ import annotations

import torch
from am_nemotron_helpers import tiny_hf_config

from am_models_nemotron import NemotronV3StateDictAdapter


def test_prefixes_holder_and_experts_map_both_ways() -> None:
    adapter = NemotronV3StateDictAdapter(tiny_hf_config("ME"))
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
    adapter = NemotronV3StateDictAdapter(tiny_hf_config("M*"))
    native = adapter.from_hf({"backbone.layers.1.mixer.D": torch.zeros(1)})
    assert list(native) == ["model.layers.1.mixer.D"]  # not a Mamba layer: left for the strict check to report
    assert adapter.forced_fp32("backbone.layers.0.mixer.dt_bias")
    assert adapter.forced_fp32("mtp.layers.1.mixer.gate.e_score_correction_bias")
    assert not adapter.forced_fp32("backbone.layers.0.mixer.in_proj.weight")
