"""The seed API called exactly as NeMo AutoModel documents it (`_transformers/capabilities.py`): positional order,
flag names and aliases, the key phrases of `validate_for_mesh`, and two behaviours upstream users rely on:
`ModelSupports(make())` works without another reference, and `is_custom_model` recognises a model class whose entry
point names the package that re-exports it."""

from __future__ import annotations

import dataclasses
import gc
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from am_capabilities import (
    ENTRY_POINT_GROUP,
    ModelCapabilities,
    ModelSupports,
    attach_capabilities_and_validate,
    clear_registry_cache,
    query_capabilities,
    validate_for_mesh,
)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Declared(Plain):
    class ModelCapabilities:
        supports_pp = True
        supports_cp = True
        supports_thd = True

    _owns_cp_attention = True
    supports_gradient_checkpointing = True


def test_model_supports_positional_and_upstream_flags():
    supports = ModelSupports(Declared(), SimpleNamespace(cp_size=2, pp_size=2))
    assert supports.supports_pp
    assert supports.supports_pp_plan  # upstream alias
    assert not supports.supports_tp
    assert not supports.supports_tp_plan
    assert supports.supports_cp
    assert supports.supports_thd
    assert supports.supports_gradient_checkpointing
    assert not supports.supports_generate
    assert not supports.mtp_enabled
    assert (supports.cp_size, supports.pp_size, supports.tp_size, supports.ep_size) == (2, 2, 1, 1)
    text = repr(supports)
    for flag in ("tp=False", "pp=True", "cp=True", "is_custom_model=False"):
        assert flag in text


def test_model_supports_of_a_temporary_model():
    """`ModelSupports(make())`: the caller holds no other reference to the model, and every flag still answers."""
    supports = ModelSupports(Declared())
    gc.collect()
    assert supports.supports_cp
    assert isinstance(supports.model, Declared)
    # A model's own `supports` refers to it weakly (as upstream's does; a strong one would be a reference cycle):
    # once the temporary model is gone it says so, with the fix, instead of answering.
    attached = attach_capabilities_and_validate(Declared(), SimpleNamespace(pp_size=2)).supports
    gc.collect()
    assert attached.pp_size == 2
    with pytest.raises(ReferenceError, match="underlying model has been garbage-collected"):
        _ = attached.supports_pp


def test_validate_for_mesh_upstream_calls_and_phrases():
    validate_for_mesh(Plain(), None)  # no mesh: no checks
    validate_for_mesh(Plain(), SimpleNamespace(tp_size=1, pp_size=1, cp_size=1, ep_size=1))  # size 1 never errors
    with pytest.raises(ValueError, match=r"^Unsupported configuration for Plain \(3 problems\):") as info:
        validate_for_mesh(Plain(), SimpleNamespace(tp_size=2, pp_size=2, cp_size=2))
    message = str(info.value)
    assert "has no TP plan" in message
    assert "requires a _pp_plan attribute" in message
    assert "_supports_sdpa" in message


def test_attach_capabilities_and_validate_returns_the_model():
    model = Declared()
    assert attach_capabilities_and_validate(model, SimpleNamespace(pp_size=2, cp_size=2)) is model
    assert type(model) is Declared
    assert model.supports.supports_pp
    assert model.supports.supports_cp
    assert model.supports.is_custom_model is False
    with pytest.raises(ValueError, match="Unsupported configuration for Plain"):
        attach_capabilities_and_validate(Plain(), SimpleNamespace(pp_size=2))


def test_model_capabilities_and_query_capabilities():
    defaults = dataclasses.asdict(ModelCapabilities())
    assert set(defaults) == {
        "supports_tp",
        "supports_cp",
        "supports_pp",
        "supports_ep",
        "supports_thd",
        "supports_mtp_cp",
        "supports_mtp_cp_pp",
        "supports_cp_vision_frame_sharding",
    }
    assert not any(defaults.values())
    assert ModelCapabilities(supports_pp=True).supports_pp
    declared = query_capabilities(Declared)
    assert declared.supports_pp
    assert declared.supports_thd
    assert not declared.supports_ep
    assert query_capabilities(Declared(), trust_remote_code=False) == declared


_PACKAGE = "am_cap_test_reexport_pkg"


@pytest.fixture
def reexporting_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A package defining `ReexportedForCausalLM` in `<pkg>.model`, re-exported by `<pkg>/__init__.py`, whose entry
    point names the package; and `DefinedForCausalLM` whose entry point names the defining module."""
    package = tmp_path / _PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text(f"from {_PACKAGE}.model import DefinedForCausalLM, ReexportedForCausalLM\n")
    (package / "model.py").write_text(
        textwrap.dedent(
            """
            import torch.nn as nn

            class ReexportedForCausalLM(nn.Module):
                pass

            class DefinedForCausalLM(nn.Module):
                pass
            """
        )
    )
    info = tmp_path / "am_cap_test_reexport-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: am_cap_test_reexport\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        f"ReexportedForCausalLM = {_PACKAGE}:ReexportedForCausalLM\n"
        f"DefinedForCausalLM = {_PACKAGE}.model:DefinedForCausalLM\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    clear_registry_cache()
    yield _PACKAGE
    for name in (_PACKAGE, f"{_PACKAGE}.model"):
        sys.modules.pop(name, None)


def test_is_custom_model_for_classes_named_by_package_or_defining_module(reexporting_package):
    package = __import__(reexporting_package)
    assert package.ReexportedForCausalLM.__module__ == f"{_PACKAGE}.model"
    assert ModelSupports(package.ReexportedForCausalLM()).is_custom_model
    assert ModelSupports(package.DefinedForCausalLM()).is_custom_model
    assert not ModelSupports(Plain()).is_custom_model


def test_upstream_attach_forwards_the_flags_from_a_swapped_class():
    """`am_capabilities.upstream.attach_capabilities_and_validate` gives code written against upstream its
    `model.supports_cp` names: a same-named subclass forwarding to `model.supports`, live; the core attach patches no
    class, so other instances and the original class stay unchanged."""
    import copy

    from am_capabilities import upstream

    class Backend:
        attn = "sdpa"

    class Hybrid(Plain):
        _supports_sdpa = True
        supports_gradient_checkpointing = True  # the class's own meaning (HF's) is never shadowed

        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(hybrid_override_pattern="M*")
            self.backend = Backend()

    model = Hybrid()
    assert upstream.attach_capabilities_and_validate(model, SimpleNamespace(cp_size=2)) is model
    cls = type(model)
    assert cls is not Hybrid
    assert issubclass(cls, Hybrid)
    assert (cls.__name__, cls.__qualname__, cls.__module__) == (Hybrid.__name__, Hybrid.__qualname__, Hybrid.__module__)
    assert model.supports_cp is True
    assert model.supports_pp is False
    assert model.is_custom_model is False
    assert {"supports_cp", "supports_tp_plan", "supports_sequence_packing"} <= set(upstream.FORWARDED_FLAGS)
    assert model.supports_tp_plan is model.supports.supports_tp
    model.backend.attn = "eager"  # live: read through model.supports on every access
    assert model.supports_cp is False
    assert model.supports_gradient_checkpointing is True  # the class attribute, not ours
    upstream.attach_capabilities_and_validate(model, SimpleNamespace(cp_size=1))  # idempotent: no second swap
    assert type(model) is cls
    twin = copy.deepcopy(model)
    assert twin.supports_cp is False
    assert twin.supports.describes(twin)
    assert not hasattr(Hybrid(), "supports_cp")  # the original class is untouched
    with pytest.raises(ValueError, match="Unsupported configuration"):
        upstream.attach_capabilities_and_validate(Plain(), SimpleNamespace(pp_size=2))
