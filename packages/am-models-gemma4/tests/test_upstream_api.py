"""The seed API called as NeMo AutoModel documents it (`models/gemma4_moe/model.py`): the constructor's positional
order `(config, moe_config=None, backend=None, text_config=None)`, the `get_capabilities(config)` classmethod, tied
embeddings, and the registry entry points naming the defining modules (so `is_custom_model` is True)."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging

import _g4_configs as C
import pytest
import torch

from am_models_gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from am_precision import BackendConfig


def test_entry_points_name_the_defining_module():
    points = {ep.name: ep for ep in importlib.metadata.entry_points(group="am_capabilities.models")}
    for cls in (Gemma4ForCausalLM, Gemma4ForConditionalGeneration):
        entry = points[cls.__name__]
        assert entry.module == cls.__module__  # what is_custom_model matches, without importing anything
        assert entry.attr == cls.__qualname__
        assert entry.load() is cls


def test_constructor_positional_text_config_override():
    config = C.vlm_config()
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config, None, None, {"final_logit_softcapping": 2.0})
    assert model.config.text_config.final_logit_softcapping == 2.0
    assert config.text_config.final_logit_softcapping == 30.0  # the caller's config is not modified
    ids = torch.randint(0, C.IMAGE_TOKEN - 5, (1, 6))
    logits = model(input_ids=ids).logits
    assert logits.abs().max() <= 2.0  # soft-capped with the overridden cap
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # tied, as upstream
    with pytest.raises(ValueError, match="not_a_field"):
        Gemma4ForConditionalGeneration(config, text_config={"not_a_field": 1})


def test_constructor_backend_and_moe_config(caplog):
    config = C.vlm_config()
    torch.manual_seed(0)
    plain = Gemma4ForConditionalGeneration(config)
    with caplog.at_level(logging.INFO, logger="am_models_gemma4.vlm"):
        with_backend = Gemma4ForConditionalGeneration(config, None, BackendConfig(attn="sdpa", linear="torch"))
    assert "runs its own PyTorch kernels" in caplog.text
    with_backend.load_state_dict(plain.state_dict())
    ids = torch.randint(0, C.IMAGE_TOKEN - 5, (1, 6))
    torch.testing.assert_close(with_backend(input_ids=ids).logits, plain(input_ids=ids).logits)
    with pytest.raises(NotImplementedError, match="moe_config=None"):
        Gemma4ForConditionalGeneration(config, object())


def test_get_capabilities_classmethod():
    dense = Gemma4ForConditionalGeneration.get_capabilities(C.vlm_config())
    moe = Gemma4ForConditionalGeneration.get_capabilities(C.vlm_config(moe=True))
    assert dense["supports_cp"]
    assert moe["supports_cp"]
    assert dense["supports_pp"]


def test_package_modules_importable_by_upstream_style_paths():
    for name in ("model", "vlm", "moe", "state_dict_adapter", "cp"):
        importlib.import_module(f"am_models_gemma4.{name}")
