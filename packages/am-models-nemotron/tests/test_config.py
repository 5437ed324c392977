"""Config normalization: the three block vocabularies give one list of kinds; bad values are all reported."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from am_nemotron_helpers import tiny_hf_config
from transformers import NemotronHConfig

from am_models_nemotron import NemotronConfig, as_hf_config, normalize_block_types

KINDS = ("mamba", "attention", "mlp", "moe")


def test_three_vocabularies_normalize_to_the_same_kinds() -> None:
    assert normalize_block_types("M*-E") == KINDS
    assert normalize_block_types(["mamba", "attention", "mlp", "moe"]) == KINDS
    assert normalize_block_types(["linear_attention", "full_attention", "mlp", "moe"]) == KINDS


def test_unknown_symbols_and_names_are_all_listed() -> None:
    with pytest.raises(ValueError, match=r"\['X', 'Z'\]"):
        normalize_block_types("MXZ")
    with pytest.raises(ValueError, match=r"\['conv', 'rnn'\]"):
        normalize_block_types(["mamba", "rnn", "conv"])
    with pytest.raises(ValueError, match="empty"):
        normalize_block_types("")


def test_reads_transformers_config_dict_and_attribute_object_alike() -> None:
    hf = tiny_hf_config("M*-E", mtp_depths=2, mtp_pattern="*E")
    from_hf = NemotronConfig.from_any(hf)
    as_dict = {k: v for k, v in hf.to_dict().items() if k != "layers_block_type"}
    as_dict["hybrid_override_pattern"] = "M*-E"
    from_dict = NemotronConfig.from_any(as_dict)
    nvidia_style = SimpleNamespace(**{**hf.to_dict(), "layers_block_type": ["mamba", "attention", "mlp", "moe"]})
    from_object = NemotronConfig.from_any(nvidia_style)
    assert from_hf.layers_block_type == KINDS
    assert from_hf == from_dict == from_object
    assert from_hf.mtp_layers_block_type == ("attention", "moe")
    assert from_hf.num_nextn_predict_layers == 2
    assert from_hf.time_step_limit == (0.001, math.inf)


def test_as_hf_config_translates_nvidia_names_to_transformers_names() -> None:
    hf = as_hf_config({"vocab_size": 10, "hidden_size": 8, "layers_block_type": ["mamba", "attention", "moe"]})
    assert isinstance(hf, NemotronHConfig)
    assert hf.layers_block_type == ["linear_attention", "full_attention", "moe"]
    same = as_hf_config(hf)
    assert same is hf


def test_inconsistent_sizes_are_reported_together() -> None:
    with pytest.raises(ValueError, match="Invalid Nemotron-H config") as info:
        NemotronConfig.from_any(
            tiny_hf_config("M*E", num_key_value_heads=3, mamba_num_heads=5, n_routed_experts=7, n_group=3)
        )
    message = str(info.value)
    for fragment in ("num_key_value_heads=3", "n_groups=2", "n_group=3"):
        assert fragment in message


def test_missing_layout_is_rejected() -> None:
    with pytest.raises(ValueError, match="no block layout"):
        NemotronConfig.from_any({"vocab_size": 10, "hidden_size": 8})


def test_a_transformers_config_without_its_list_is_refused_not_read_through_its_pattern_property() -> None:
    """transformers' `hybrid_override_pattern` is a property over `layers_block_type` (TypeError when the list is
    unset): it is not a layout of its own, so the error is ours, naming the fields to set."""
    config = NemotronHConfig()
    config.layers_block_type = None
    config.layer_types = None
    with pytest.raises(ValueError, match="no block layout"):
        NemotronConfig.from_any(config)
    # a plain attribute of that name (NVIDIA's remote-code config stores the string) is read as before
    assert (
        NemotronConfig.from_any(
            SimpleNamespace(
                **{
                    **tiny_hf_config("M*-E").to_dict(),
                    "layers_block_type": None,
                    "layer_types": None,
                    "hybrid_override_pattern": "M*-E",
                }
            )
        ).layers_block_type
        == KINDS
    )


def test_a_raw_transformers_config_works_wherever_our_config_does() -> None:
    """Every public class or function that takes a config accepts transformers' NemotronHConfig (its
    "linear_attention" / "full_attention" names included) and builds the same thing as from `NemotronConfig`."""
    import torch

    from am_models_nemotron import (
        Mamba2Mixer,
        MTPConfig,
        MTPModule,
        NemotronAttention,
        NemotronBlock,
        NemotronHForCausalLM,
        NemotronHybridCache,
        NemotronMoE,
        NemotronV3Model,
        default_backend,
        mamba_cp_bytes_per_layer,
    )

    raw = tiny_hf_config("ME*-", mtp_depths=1)
    ours = NemotronConfig.from_any(raw)
    backend = default_backend()
    builders = {
        "NemotronBlock": lambda c: NemotronBlock(c, 0, backend=backend),
        "Mamba2Mixer": lambda c: Mamba2Mixer(c, 0, backend=backend),
        "NemotronAttention": lambda c: NemotronAttention(c, 2, backend=backend),
        "NemotronMoE": lambda c: NemotronMoE(c, backend=backend),
        "MTPModule": lambda c: MTPModule(c, MTPConfig.from_config(c), backend=backend),
        "NemotronV3Model": lambda c: NemotronV3Model(c),
        "NemotronHForCausalLM": lambda c: NemotronHForCausalLM(c),
    }
    for name, build in builders.items():
        a, b = build(raw), build(ours)
        assert [(n, p.shape) for n, p in a.named_parameters()] == [(n, p.shape) for n, p in b.named_parameters()], name
    assert MTPConfig.from_config(raw) == MTPConfig.from_config(ours)
    assert MTPConfig.from_config(raw).layer_pattern == ("attention", "moe")
    kwargs = {"batch_size": 2, "cp_rank": 0, "cp_size": 2, "conv_dtype": torch.float32, "packed": True}
    assert mamba_cp_bytes_per_layer(raw, **kwargs) == mamba_cp_bytes_per_layer(ours, **kwargs)
    assert NemotronHybridCache(raw, 2).conv_states.keys() == NemotronHybridCache(ours, 2).conv_states.keys()
