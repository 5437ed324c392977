"""State-dict adapter: transformers' router/expert names ↔ ours (same tensors, same layouts), other keys untouched."""

from __future__ import annotations

import torch

from am_models_gemma4 import Gemma4StateDictAdapter


def _hf_state() -> dict[str, torch.Tensor]:
    return {
        "model.language_model.layers.3.router.proj.weight": torch.randn(4, 8),
        "model.language_model.layers.3.router.scale": torch.randn(8),
        "model.language_model.layers.3.router.per_expert_scale": torch.randn(4),
        "model.language_model.layers.3.experts.gate_up_proj": torch.randn(4, 6, 8),
        "model.language_model.layers.3.experts.down_proj": torch.randn(4, 8, 3),
        "model.language_model.layers.3.mlp.down_proj.weight": torch.randn(8, 5),
        "model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight": torch.randn(2, 2),
    }


def test_from_hf_moves_moe_under_moe_without_copies() -> None:
    hf = _hf_state()
    ours = Gemma4StateDictAdapter.from_hf(hf)
    prefix = "model.language_model.layers.3."
    # am_moe.GroupedExperts keeps transformers' [E, out, in] layout: the tensors are handed on, not transposed
    assert ours[prefix + "moe.experts.gate_up_proj"] is hf[prefix + "experts.gate_up_proj"]
    assert ours[prefix + "moe.experts.down_proj"] is hf[prefix + "experts.down_proj"]
    assert ours[prefix + "moe.router.per_expert_scale"] is hf[prefix + "router.per_expert_scale"]
    assert ours[prefix + "mlp.down_proj.weight"] is hf[prefix + "mlp.down_proj.weight"]
    key = "model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight"
    assert ours[key] is hf[key]


def test_round_trip_is_exact() -> None:
    hf = _hf_state()
    back = Gemma4StateDictAdapter.to_hf(Gemma4StateDictAdapter.from_hf(hf))
    assert set(back) == set(hf)
    for key, tensor in hf.items():
        assert torch.equal(back[key], tensor), key
