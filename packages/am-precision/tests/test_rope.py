"""get_rope_config on real transformers v5 configs and duck-typed ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from am_precision import get_rope_config

transformers = pytest.importorskip("transformers", reason="transformers (the 'hf' extra) is not installed")


def test_llama_config_theta_same_dict_and_default_partial_factor():
    config = transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    theta, params, partial = get_rope_config(config)
    assert theta == 12345.0
    assert params is config.rope_parameters
    assert partial == 1.0


def test_partial_rotary_factor_from_rope_parameters():
    config = transformers.PhiConfig(partial_rotary_factor=0.25)
    _, params, partial = get_rope_config(config)
    assert params is config.rope_parameters
    assert partial == 0.25


def test_yarn_parameters_are_preserved():
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024}
    config = transformers.LlamaConfig(max_position_embeddings=4096, rope_parameters=dict(yarn))
    theta, params, _ = get_rope_config(config)
    assert theta == 1e6
    assert {k: params[k] for k in yarn} == yarn


def test_per_layer_type_rope_parameters_need_a_layer_type():
    config = transformers.Gemma3TextConfig()
    with pytest.raises(ValueError, match="keyed by layer type") as err:
        get_rope_config(config)
    assert "full_attention" in str(err.value)
    theta, params, _ = get_rope_config(config, layer_type="full_attention")
    assert params is config.rope_parameters["full_attention"]
    assert theta == config.rope_parameters["full_attention"]["rope_theta"]


def test_partial_factor_falls_back_to_config_attribute():
    config = SimpleNamespace(rope_parameters={"rope_theta": 10.0}, partial_rotary_factor=0.5)
    assert get_rope_config(config)[2] == 0.5


@pytest.mark.parametrize("params", [None, {"rope_type": "default"}])
def test_missing_theta_is_a_clear_error(params):
    with pytest.raises(ValueError, match="rope_theta"):
        get_rope_config(SimpleNamespace(rope_parameters=params))
