"""Declared capabilities: the static and dynamic declaration forms, MRO dispatch, every target kind of
``query_capabilities`` and its error cases. Dynamic declarations are evaluated on real HF config objects."""

from __future__ import annotations

import builtins
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.nn as nn

from am_capabilities import (
    ModelCapabilities,
    attach_capabilities_and_validate,
    declared_capabilities,
    query_capabilities,
    register_model,
    unregister_model,
)

# ---- model classes declaring capabilities the way model packages do (no am_capabilities import needed) --------


class StaticModel(nn.Module):
    class ModelCapabilities:
        supports_tp = True
        supports_cp = True
        supports_thd = True


class InheritsStatic(StaticModel):
    pass


class CanonicalInstanceModel(nn.Module):
    ModelCapabilities = ModelCapabilities(supports_pp=True, supports_ep=True)


class NemotronLikeModel(nn.Module):
    """Mirrors the NemotronH declaration: EP only when the checkpoint has routed experts / MoE layers."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    @classmethod
    def get_capabilities(cls, config: Any) -> Any:
        has_moe = bool(getattr(config, "n_routed_experts", 0)) and "moe" in list(config.layers_block_type)
        return SimpleNamespace(
            supports_tp=False, supports_cp=True, supports_pp=True, supports_ep=has_moe, supports_mtp_cp=True
        )


class Gemma4LikeModel(nn.Module):
    """Mirrors the Gemma4 VLM declaration: the answer depends on the checkpoint variant (MoE / audio / dense). The MoE
    variant pipelines (am_models_gemma4 0.x: the pipeline passes the padding mask to every stage's MoE layers)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    @classmethod
    def get_capabilities(cls, config: Any) -> dict[str, bool]:
        if config.text_config.enable_moe_block:
            return {"supports_tp": False, "supports_cp": True, "supports_pp": True, "supports_ep": True}
        if config.audio_config is not None:
            return {"supports_tp": True, "supports_cp": True, "supports_pp": False, "supports_ep": False}
        return {"supports_tp": True, "supports_cp": True, "supports_pp": True, "supports_ep": False}


class BothDeclarations(nn.Module):
    class ModelCapabilities:
        supports_tp = True

    @classmethod
    def get_capabilities(cls, config: Any) -> Any:
        return SimpleNamespace(supports_tp=True)


class Undeclared(nn.Module):
    pass


class TypoDeclaration(nn.Module):
    class ModelCapabilities:
        supports_ppp = True


class NonBoolDeclaration(nn.Module):
    class ModelCapabilities:
        supports_tp = 1


class SubOverridesWithDynamic(StaticModel):
    @classmethod
    def get_capabilities(cls, config: Any) -> Any:
        return {"supports_pp": True}


# ---- ModelCapabilities ------------------------------------------------------------------------------------------


def test_model_capabilities_defaults_false_and_is_frozen():
    caps = ModelCapabilities()
    assert all(getattr(caps, f.name) is False for f in dataclasses.fields(caps))
    assert len(dataclasses.fields(caps)) == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.supports_tp = True  # type: ignore[misc]


def test_model_capabilities_rejects_non_bool_flags():
    with pytest.raises(TypeError, match="supports_tp=1"):
        ModelCapabilities(supports_tp=1)  # type: ignore[arg-type]


# ---- static declarations and MRO dispatch -----------------------------------------------------------------------


def test_static_nested_class_is_canonicalised():
    assert query_capabilities(StaticModel) == ModelCapabilities(supports_tp=True, supports_cp=True, supports_thd=True)


def test_canonical_instance_declaration_is_returned_as_is():
    assert query_capabilities(CanonicalInstanceModel) is CanonicalInstanceModel.ModelCapabilities


def test_subclasses_inherit_the_declaration():
    assert query_capabilities(InheritsStatic) == query_capabilities(StaticModel)
    assert query_capabilities(InheritsStatic()) == query_capabilities(StaticModel)


def test_closest_declaration_in_the_mro_wins():
    config = SimpleNamespace()
    assert declared_capabilities(SubOverridesWithDynamic, config) == ModelCapabilities(supports_pp=True)


def test_runtime_wrapper_subclass_inherits_the_declaration():
    """A class swapped in at run time (as FSDP2's ``fully_shard`` does) still finds the declaration in its MRO."""
    model = attach_capabilities_and_validate(StaticModel())
    assert type(model) is StaticModel  # attaching itself does not re-class the model
    model.__class__ = type("FSDPStaticModel", (type("FSDPModuleStandIn", (nn.Module,), {}), StaticModel), {})
    assert query_capabilities(model) == query_capabilities(StaticModel)
    assert model.supports.declared_capabilities == query_capabilities(StaticModel)


def test_both_declarations_on_one_class_is_a_type_error():
    with pytest.raises(TypeError, match="exactly one"):
        query_capabilities(BothDeclarations)


def test_no_declaration_is_an_attribute_error():
    with pytest.raises(AttributeError, match="Undeclared declares no capabilities"):
        query_capabilities(Undeclared)
    assert declared_capabilities(Undeclared, None) is None


def test_unknown_flag_names_are_reported_not_ignored():
    with pytest.raises(TypeError, match=r"unknown capability flags \['supports_ppp'\]"):
        query_capabilities(TypoDeclaration)


def test_non_bool_flag_values_are_reported():
    with pytest.raises(TypeError, match=r"NonBoolDeclaration.ModelCapabilities.*supports_tp=1"):
        query_capabilities(NonBoolDeclaration)


# ---- dynamic declarations on real HF configs --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ({"moe": True}, dict(supports_tp=False, supports_cp=True, supports_pp=True, supports_ep=True)),
        ({"audio": True}, dict(supports_tp=True, supports_cp=True, supports_pp=False, supports_ep=False)),
        ({}, dict(supports_tp=True, supports_cp=True, supports_pp=True, supports_ep=False)),
    ],
)
def test_dynamic_declaration_per_gemma4_variant(gemma4_config, variant, expected):
    config = gemma4_config(**variant)
    assert query_capabilities(Gemma4LikeModel(config)) == ModelCapabilities(**expected)


@pytest.mark.parametrize(
    ("layers", "expected_ep"),
    [(["linear_attention", "moe", "full_attention"], True), (["linear_attention", "mlp", "full_attention"], False)],
)
def test_dynamic_declaration_on_nemotron_h_configs(hf, layers, expected_ep):
    config = hf.NemotronHConfig(layers_block_type=layers, n_routed_experts=4)
    caps = query_capabilities(NemotronLikeModel(config))
    assert caps.supports_ep is expected_ep
    assert caps.supports_cp
    assert caps.supports_pp
    assert caps.supports_mtp_cp
    assert not caps.supports_tp


def test_dynamic_declaration_needs_a_config():
    with pytest.raises(ValueError, match="config is required"):
        query_capabilities(Gemma4LikeModel)


# ---- target kinds -----------------------------------------------------------------------------------------------


@pytest.fixture
def registered_gemma4_like():
    register_model(Gemma4LikeModel)
    register_model(StaticModel)
    yield
    unregister_model("Gemma4LikeModel")
    unregister_model("StaticModel")


def test_config_target_resolves_architecture_through_the_registry(registered_gemma4_like, gemma4_config):
    config = gemma4_config(moe=True)
    config.architectures = ["Gemma4LikeModel"]
    assert query_capabilities(config).supports_ep
    assert query_capabilities(SimpleNamespace(architectures=["StaticModel"])).supports_thd


def test_config_without_architectures_is_a_value_error(gemma4_config):
    config = gemma4_config()
    assert not config.architectures
    with pytest.raises(ValueError, match="Gemma4Config has no 'architectures'"):
        query_capabilities(config)


def test_config_with_unregistered_architecture_is_a_key_error():
    with pytest.raises(KeyError, match="'NotRegisteredArch' is not registered"):
        query_capabilities(SimpleNamespace(architectures=["NotRegisteredArch"]))


def test_model_id_target_reads_config_with_autoconfig(registered_gemma4_like, hf, tmp_path: Path):
    config = hf.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    config.architectures = ["StaticModel"]
    config.save_pretrained(tmp_path)
    assert query_capabilities(str(tmp_path)) == query_capabilities(StaticModel)


def test_model_id_without_transformers_is_a_clear_import_error(monkeypatch):
    real_import = builtins.__import__

    def no_transformers(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(ImportError, match=r"pip install am-capabilities\[hf\]"):
        query_capabilities("org/some-model")


def test_instance_of_undeclared_hf_model_is_an_attribute_error(tiny_llama):
    with pytest.raises(AttributeError, match="LlamaForCausalLM declares no capabilities"):
        query_capabilities(tiny_llama())


def test_non_module_class_is_a_type_error():
    with pytest.raises(TypeError, match=r"not an nn\.Module subclass"):
        query_capabilities(dict)


@pytest.mark.parametrize("target", [42, 3.5, None, ["StaticModel"]])
def test_unsupported_target_is_a_type_error(target):
    with pytest.raises(TypeError, match="cannot read capabilities"):
        query_capabilities(target)


def test_import_and_class_queries_never_import_transformers_or_model_packages():
    # Checked in a fresh interpreter, independent of what the suite has imported.
    import subprocess

    code = (
        "import sys, torch.nn as nn\n"
        "import am_capabilities\n"
        "from am_capabilities import ModelSupports, query_capabilities\n"
        "class M(nn.Module):\n"
        "    class ModelCapabilities:\n"
        "        supports_tp = True\n"
        "m = M()\n"
        "assert query_capabilities(M).supports_tp and ModelSupports(m).supports_tp\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('transformers', 'am_models_nemotron', "
        "'am_models_gemma4', 'am_pipelining', 'transformer_engine')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300).stdout
    assert out.strip() == "[]"
