"""The model registry: explicit ``register_model`` and real entry points read from a ``*.dist-info`` folder
written into ``tmp_path`` (the same metadata an installed model package ships)."""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.nn as nn

from am_capabilities import (
    ENTRY_POINT_GROUP,
    ModelRegistryError,
    ModelSupports,
    clear_registry_cache,
    find_model_class,
    get_model_class,
    is_registered_model_class,
    query_capabilities,
    register_model,
    registered_architectures,
    unregister_model,
)

# Module names unique to this test so a leftover import cannot satisfy an assertion by accident.
GOOD_MODULE = "am_cap_test_fake_models"
MISSING_MODULE = "am_cap_test_missing_module"

FAKE_MODELS_SOURCE = textwrap.dedent(
    """
    import torch.nn as nn

    class TinyCustomForCausalLM(nn.Module):
        class ModelCapabilities:
            supports_tp = True
            supports_thd = True

    class LlamaForCausalLM(nn.Module):
        '''Same architecture name as HuggingFace's class, different implementation.'''

    def not_a_class():
        return None
    """
)


def _write_distribution(root: Path, dist_name: str, entry_points: dict[str, str]) -> None:
    info = root / f"{dist_name}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1.0\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}\n")


@pytest.fixture
def installed_fake_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put a module and two distributions declaring entry points on ``sys.path``."""
    (tmp_path / f"{GOOD_MODULE}.py").write_text(FAKE_MODELS_SOURCE)
    _write_distribution(
        tmp_path,
        "am_cap_test_models",
        {
            "TinyCustomForCausalLM": f"{GOOD_MODULE}:TinyCustomForCausalLM",
            "LlamaForCausalLM": f"{GOOD_MODULE}:LlamaForCausalLM",
            "BrokenImportArch": f"{MISSING_MODULE}:Model",
            "NotAClassArch": f"{GOOD_MODULE}:not_a_class",
            "MissingAttrArch": f"{GOOD_MODULE}:DoesNotExist",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, GOOD_MODULE, raising=False)
    clear_registry_cache()
    yield tmp_path
    sys.modules.pop(GOOD_MODULE, None)


class ExplicitModel(nn.Module):
    class ModelCapabilities:
        supports_pp = True


class OtherModel(nn.Module):
    pass


@pytest.fixture
def explicit_registration():
    register_model(ExplicitModel)
    yield
    unregister_model("ExplicitModel")
    unregister_model("Alias")


# ---- explicit registration --------------------------------------------------------------------------------------


def test_register_model_makes_class_findable_by_name(explicit_registration):
    assert get_model_class("ExplicitModel") is ExplicitModel
    assert "ExplicitModel" in registered_architectures()
    assert is_registered_model_class(ExplicitModel)
    assert not is_registered_model_class(OtherModel)


def test_register_model_under_an_architecture_alias(explicit_registration):
    register_model(ExplicitModel, architecture="Alias")
    assert get_model_class("Alias") is ExplicitModel


def test_register_model_refuses_silent_replacement(explicit_registration):
    register_model(ExplicitModel)  # same class again: fine
    with pytest.raises(ValueError, match=r"already registered.*replace=True"):
        register_model(OtherModel, architecture="ExplicitModel")
    register_model(OtherModel, architecture="ExplicitModel", replace=True)
    assert get_model_class("ExplicitModel") is OtherModel


def test_register_model_rejects_non_modules():
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        register_model(dict)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        register_model(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_unknown_architecture_is_a_key_error_with_the_remedy():
    with pytest.raises(KeyError, match=r"NoSuchArch.*not registered.*register_model"):
        get_model_class("NoSuchArch")


def test_subclass_of_registered_class_counts_as_custom(explicit_registration):
    class Sub(ExplicitModel):
        pass

    model = Sub()
    assert is_registered_model_class(Sub)
    assert ModelSupports(model).is_custom_model


# ---- entry points -----------------------------------------------------------------------------------------------


def test_entry_points_are_listed_without_importing_them(installed_fake_models):
    names = registered_architectures()
    assert {"TinyCustomForCausalLM", "BrokenImportArch", "NotAClassArch", "MissingAttrArch"} <= set(names)
    assert GOOD_MODULE not in sys.modules
    assert MISSING_MODULE not in sys.modules


def test_entry_point_loads_the_class_lazily(installed_fake_models):
    cls = get_model_class("TinyCustomForCausalLM")
    assert cls.__module__ == GOOD_MODULE
    assert cls.__name__ == "TinyCustomForCausalLM"
    assert issubclass(cls, nn.Module)
    assert get_model_class("TinyCustomForCausalLM") is cls  # cached


def test_query_capabilities_by_config_goes_through_the_entry_point(installed_fake_models):
    config = SimpleNamespace(architectures=["TinyCustomForCausalLM"])
    caps = query_capabilities(config)
    assert caps.supports_tp
    assert caps.supports_thd
    assert not caps.supports_pp


@pytest.mark.parametrize(
    ("arch", "value", "why"),
    [
        ("BrokenImportArch", f"{MISSING_MODULE}:Model", "ModuleNotFoundError"),
        ("NotAClassArch", f"{GOOD_MODULE}:not_a_class", "not an nn.Module subclass"),
        ("MissingAttrArch", f"{GOOD_MODULE}:DoesNotExist", "AttributeError"),
    ],
)
def test_broken_entry_point_names_itself_and_spares_other_queries(installed_fake_models, arch, value, why):
    with pytest.raises(ModelRegistryError) as info:
        query_capabilities(SimpleNamespace(architectures=[arch]))
    message = str(info.value)
    assert f"'{arch} = {value}'" in message
    assert "am_cap_test_models" in message  # the distribution that ships it
    assert why in message
    if why != "not an nn.Module subclass":  # the loading error is chained, not swallowed
        assert type(info.value.__cause__).__name__ == why
    # Unrelated lookups keep working after the failure.
    assert query_capabilities(SimpleNamespace(architectures=["TinyCustomForCausalLM"])).supports_tp
    assert arch in registered_architectures()


def test_is_custom_model_matches_entry_points_by_module_and_qualname(installed_fake_models, tiny_llama):
    hf_llama = tiny_llama()
    # An entry point named LlamaForCausalLM exists, but it points at another implementation.
    assert not ModelSupports(hf_llama).is_custom_model
    assert GOOD_MODULE not in sys.modules  # matching did not import the model package
    fake_module = __import__(GOOD_MODULE)
    assert ModelSupports(fake_module.LlamaForCausalLM()).is_custom_model
    assert ModelSupports(fake_module.TinyCustomForCausalLM()).is_custom_model


def test_explicit_registration_wins_over_entry_point(installed_fake_models):
    register_model(ExplicitModel, architecture="TinyCustomForCausalLM")
    try:
        assert get_model_class("TinyCustomForCausalLM") is ExplicitModel
    finally:
        unregister_model("TinyCustomForCausalLM")
    assert get_model_class("TinyCustomForCausalLM").__module__ == GOOD_MODULE


def test_conflicting_entry_points_warn_and_keep_the_first(installed_fake_models):
    _write_distribution(
        installed_fake_models, "am_cap_test_rival", {"TinyCustomForCausalLM": f"{GOOD_MODULE}:LlamaForCausalLM"}
    )
    clear_registry_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registered_architectures()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "TinyCustomForCausalLM" in messages[0]
    assert "two entry points" in messages[0]
    kept = get_model_class("TinyCustomForCausalLM")
    assert kept.__name__ in {"TinyCustomForCausalLM", "LlamaForCausalLM"}  # discovery order is the path order
    assert f"{kept.__module__}:{kept.__qualname__}" in messages[0].split("keeping")[1].split("ignoring")[0]


def test_clear_registry_cache_forgets_uninstalled_entry_points(installed_fake_models, monkeypatch):
    assert "TinyCustomForCausalLM" in registered_architectures()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(installed_fake_models)])
    assert "TinyCustomForCausalLM" in registered_architectures()  # cached until cleared
    clear_registry_cache()
    assert "TinyCustomForCausalLM" not in registered_architectures()


# ---- find_model_class: a checkpoint config.json's architectures / model_type --------------------------------------


def test_find_model_class_takes_the_first_registered_architecture(installed_fake_models):
    assert find_model_class(["SomethingElse", "TinyCustomForCausalLM", "BrokenImportArch"]).__module__ == GOOD_MODULE
    assert MISSING_MODULE not in sys.modules  # a later, broken entry point is never imported
    assert find_model_class(["SomethingElse"]) is None
    assert find_model_class([]) is None
    assert find_model_class(None) is None


def test_find_model_class_raises_for_a_broken_matching_entry_point(installed_fake_models):
    with pytest.raises(ModelRegistryError, match="BrokenImportArch"):
        find_model_class(["BrokenImportArch"])


def test_find_model_class_resolves_a_bare_model_type_through_transformers(installed_fake_models, hf):
    """Without architectures, transformers' causal-LM mapping names the architecture ("llama" ->
    "LlamaForCausalLM"), which the fake package registers; an unregistered or unknown type gives None."""
    assert find_model_class(None, "llama").__module__ == GOOD_MODULE
    assert find_model_class([], "mistral") is None  # MistralForCausalLM is not registered
    assert find_model_class([], "no_such_model_type") is None


def test_find_model_class_prefers_architectures_over_model_type(installed_fake_models, hf, explicit_registration):
    # The architectures name the exact head: a registered class for the model_type is not substituted.
    assert find_model_class(["LlamaForSequenceClassification"], "llama") is None
    assert find_model_class(["ExplicitModel"], "llama") is ExplicitModel
