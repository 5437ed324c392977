"""`find_layers`: where the decoder layers of full models, VLMs, bare decoders and pruned stages live."""

from __future__ import annotations

import _models as M
import pytest
from torch import nn

from am_pipelining import build_stage_modules, find_layers
from am_pipelining.hf_utils import MULTIMODAL_SUFFIXES


def test_causal_lm():
    model = M.llama(4)
    found = find_layers(model)
    assert found.layers_prefix == "model."
    assert found.container is model.model.layers
    assert found.container_fqn == "model.layers"
    assert (found.num_layers, found.indices) == (4, (0, 1, 2, 3))
    assert found.layers == list(model.model.layers)
    assert found.lm_head_fqn == "lm_head"
    assert found.has_rotary_emb
    assert not found.nested
    assert found.extra_module_fqns == ()


def test_vlm_text_model_is_nested():
    model = M.mistral3_vlm(2)
    found = find_layers(model)
    assert found.layers_prefix == "model.language_model."
    assert found.text_model is model.model.language_model
    assert found.nested
    assert found.extra_module_fqns == tuple(f"model.{suffix}" for suffix in MULTIMODAL_SUFFIXES)
    assert found.lm_head_fqn == "lm_head"


def test_bare_decoder_and_pruned_stage():
    model = M.llama(4)
    bare = find_layers(model.model)
    assert (bare.layers_prefix, bare.num_layers, bare.lm_head_fqn) == ("", 4, None)
    names = [["model.embed_tokens", "model.layers.0", "model.rotary_emb"], ["model.layers.2", "model.layers.3"]]
    (stage,) = build_stage_modules(model, [*names, ["model.layers.1"]], [1])
    found = find_layers(stage)
    assert isinstance(found.container, nn.ModuleDict)
    assert (found.num_layers, found.indices) == (2, (2, 3))
    assert found.lm_head_fqn is None  # pruned away on this stage


def test_no_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="Cannot find the decoder layers of Linear"):
        find_layers(nn.Linear(2, 2))
