"""Config helpers: per-layer head dims and KV heads, MoE fields, and validation listing every problem."""

from __future__ import annotations

import pytest
from _g4_configs import text_config

from am_models_gemma4 import layer_head_dim, layer_num_kv_heads, moe_intermediate_size, validate_text_config
from am_models_gemma4.config import kv_sharing_modes


def test_full_layers_use_global_head_dim_and_kv_heads() -> None:
    config = text_config()
    assert [layer_head_dim(config, i) for i in range(4)] == [8, 16, 8, 16]
    assert [layer_num_kv_heads(config, i) for i in range(4)] == [2, 1, 2, 1]


def test_moe_intermediate_size_accepts_the_older_spelling() -> None:
    config = text_config(moe=True)
    assert moe_intermediate_size(config) == 16


def test_validation_lists_every_problem() -> None:
    config = text_config(moe=True)
    config.top_k_experts = 9
    config.layer_types = ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]
    config.use_bidirectional_attention = "all"
    with pytest.raises(ValueError, match="unsupported Gemma 4 text config") as info:
        validate_text_config(config)
    message = str(info.value)
    assert "chunked_attention" in message
    assert "'all'" in message
    assert "top_k_experts=9" in message


def test_kv_sharing_roles_match_transformers_without_its_property() -> None:
    """Our fallback (for transformers versions without `kv_sharing_modes`) computes the same roles."""
    config = text_config(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3)
    config.num_kv_shared_layers = 3
    expected = list(config.kv_sharing_modes)

    class WithoutProperty:
        num_hidden_layers = 6
        num_kv_shared_layers = 3
        layer_types = config.layer_types

    assert kv_sharing_modes(WithoutProperty()) == expected
    assert expected == [None, "store", "store", "reuse", "reuse", "reuse"]
