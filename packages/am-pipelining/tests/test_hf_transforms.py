"""The forward-level transforms table is what makes the pipeline forward equal the model's own forward, and the
refusals name every feature it cannot reproduce (single process; the 2-rank parity lives in
test_pipeline_archs_2ranks)."""

from __future__ import annotations

import copy

import _arch_models as A
import pytest
import torch
from torch import nn

from am_pipelining import (
    FORWARD_TRANSFORMS,
    LAYER_LEVEL_CONFIG_KEYS,
    forward_reproduction_problems,
    patch_hf_model_for_pp,
    validate_hf_model_for_pipeline_support,
)


def _max_error(model: nn.Module) -> float:
    ids = A.batch(2)["input_ids"]
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        patched = patch_hf_model_for_pp(copy.deepcopy(model))(ids)
    return float((patched - reference).abs().max())


@pytest.mark.parametrize("name", ["granite", "cohere", "gemma2", "gemma3-text"])
def test_transforms_table_is_what_reproduces_the_forward(name, monkeypatch):
    """With the table the patched forward equals the model's; without it (the old behaviour) it does not."""
    model = A.build(name)
    assert _max_error(model) == 0.0
    monkeypatch.setattr("am_pipelining.hf_transforms.FORWARD_TRANSFORMS", [])
    assert _max_error(model) > 1e-3, "this architecture's forward-level transform should matter"


def test_granite_embedding_multiplier_applies_on_the_embedding_stage_only():
    model = patch_hf_model_for_pp(A.build("granite"))
    ids = A.batch(1)["input_ids"]
    embedded = model.model.embed_tokens(ids)
    stage0 = copy.deepcopy(model.model)
    stage0.layers = nn.ModuleDict()
    stage0.norm = None
    torch.testing.assert_close(stage0(ids), embedded * 12.0)
    torch.testing.assert_close(stage0(inputs_embeds=embedded), embedded * 12.0)  # as Granite does
    later = copy.deepcopy(stage0)
    later.embed_tokens = None
    torch.testing.assert_close(later(embedded), embedded)  # hidden states from the previous stage


def test_returning_hidden_states_is_refused_when_logits_are_transformed():
    model = patch_hf_model_for_pp(A.build("cohere"))
    model._pp_return_hidden_states = True
    with pytest.raises(ValueError, match=r"logits multiplied by logit_scale \(Cohere\) \(logit_scale=0.25\)"):
        model(A.batch(1)["input_ids"])


def test_refusals_name_every_feature_at_once():
    model = A.build("phi")
    model.config.scale_emb = 12
    model.config.final_logits_multiplier = 2.0
    problems = forward_reproduction_problems(model)
    text = "\n".join(problems)
    for expected in (
        "model.embed_dropout (Dropout)",
        "model.final_layernorm (LayerNorm)",
        "MiniCPM embedding scaling (scale_emb)",
        "config.final_logits_multiplier=2.0",
    ):
        assert expected in text
    assert len(problems) == 4
    with pytest.raises(ValueError, match="not compatible with pipeline parallelism"):
        validate_hf_model_for_pipeline_support(model)


def test_inactive_values_and_declared_layer_keys_are_accepted(monkeypatch):
    model = A.build("llama")
    model.config.output_logits_scale = 1.0  # identity
    model.config.use_bidirectional_attention = False
    assert forward_reproduction_problems(model) == []
    model.config.output_logits_scale = 3.0
    assert len(forward_reproduction_problems(model)) == 1
    monkeypatch.setattr(
        "am_pipelining.hf_transforms.LAYER_LEVEL_CONFIG_KEYS", LAYER_LEVEL_CONFIG_KEYS | {"output_logits_scale"}
    )
    assert forward_reproduction_problems(model) == []


def test_unknown_top_level_module_is_refused():
    model = A.build("llama")
    model.extra_head = nn.Linear(16, 4)
    assert "extra_head (Linear)" in "\n".join(forward_reproduction_problems(model))
    model.extra_head = nn.Dropout(0.0)  # a no-op child changes nothing
    assert forward_reproduction_problems(model) == []


def test_table_keys_are_unique():
    keys = [t.config_key for t in FORWARD_TRANSFORMS]
    assert len(keys) == len(set(keys))
