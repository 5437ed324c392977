"""Backend resolution: `BackendConfig()` with a GPU machine's defaults (Transformer Engine + CUDA, DeepEP) builds a
working model, every field the model reads is mapped to an implemented choice in one logged line, and choices that
would change the math are refused. Availability is faked the way am-precision's tests fake it (its `flags` module
and `torch.cuda.is_available`); nothing imports transformer_engine."""

from __future__ import annotations

import logging

import pytest
import torch
from am_nemotron_helpers import tiny_hf_config, tokens

from am_models_nemotron import SUPPORTED_BACKENDS, NemotronHForCausalLM, NemotronV3Model, resolve_backend
from am_models_nemotron.backend import default_backend
from am_precision import BackendConfig, flags


@pytest.fixture
def gpu_machine_defaults(monkeypatch):
    """BackendConfig() as on a CUDA machine with Transformer Engine and DeepEP installed."""
    monkeypatch.setattr(flags, "HAVE_TE", True)
    monkeypatch.setattr(flags, "HAVE_DEEP_EP", True)
    monkeypatch.setattr(flags, "HAVE_UCCL_EP", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.usefixtures("gpu_machine_defaults")
def test_gpu_defaults_resolve_to_the_nearest_implemented_choices_in_one_log_line(caplog) -> None:
    backend = BackendConfig()
    assert (backend.attn, backend.linear, backend.experts, backend.dispatcher) == ("te", "te", "torch_mm", "deepep")
    with caplog.at_level(logging.WARNING, logger="am_models_nemotron"):
        resolved = resolve_backend(backend)
    assert (resolved.attn, resolved.linear, resolved.experts, resolved.dispatcher) == (
        "sdpa",
        "te",
        "torch_mm",
        "torch",
    )
    assert (backend.attn, backend.dispatcher) == ("te", "deepep")  # never mutated
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "attn 'te' -> 'sdpa'" in lines[0]
    assert "dispatcher 'deepep' -> 'torch'" in lines[0]
    assert "linear" not in lines[0]  # TE linears are built by am-precision: implemented, left alone


def test_a_model_built_from_te_defaults_runs_and_matches_the_plain_backend(monkeypatch, caplog) -> None:
    """The model side of the GPU defaults on this CPU machine: attention 'te' and an all-to-all dispatcher (linear
    left at 'torch', which TE would need CUDA for) build the SDPA / local-dispatch model with one log line."""
    monkeypatch.setattr(flags, "HAVE_DEEP_EP", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend = BackendConfig(attn="te", linear="torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = tiny_hf_config("ME*", mtp_depths=1)
    with caplog.at_level(logging.WARNING, logger="am_models_nemotron"):
        torch.manual_seed(0)
        model = NemotronHForCausalLM(config, backend).eval()
    assert len(caplog.records) == 1  # the LM resolves once; its backbone and blocks get the resolved config
    assert model.backend.attn == "sdpa"
    assert model.backend.dispatcher == "torch"
    torch.manual_seed(0)
    plain = NemotronHForCausalLM(config).eval()
    ids = tokens(1, 9)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_every_field_the_model_reads_has_one_rule() -> None:
    assert set(SUPPORTED_BACKENDS) == {"attn", "experts", "dispatcher"}
    resolved = resolve_backend(BackendConfig(attn="flex", experts="torch_mm_mxfp8"))
    assert (resolved.attn, resolved.experts) == ("sdpa", "torch_mm")
    gmm = resolve_backend(BackendConfig(experts="gmm", dispatcher="hybridep"))
    assert (gmm.experts, gmm.dispatcher) == ("torch_mm", "torch")
    implemented = default_backend()
    assert resolve_backend(implemented) is implemented
    assert resolve_backend(None) == implemented


@pytest.mark.parametrize(
    "fields",
    [
        {"compile_attn": True},
        {"enable_fsdp_optimizations": True},
        {"enable_hf_state_dict_adapter": False},
        {"linear": "torch", "experts": "te", "dispatcher": "deepep", "te_fp8": {"recipe": "current"}},
    ],
)
def test_fields_no_package_implements_are_refused_before_the_model_sees_them(fields) -> None:
    """One decision, one place: am-precision's BackendConfig refuses them, so the model has no rule of its own."""
    (name,) = [
        k
        for k in fields
        if k in {"compile_attn", "enable_fsdp_optimizations", "enable_hf_state_dict_adapter", "te_fp8"}
    ]
    with pytest.raises(ValueError, match=f"{name}=.* is not implemented by any am-\\* package"):
        BackendConfig(**fields)


def test_backbone_takes_a_raw_config_and_an_optional_positional_backend(caplog) -> None:
    config = tiny_hf_config("M*E")
    assert isinstance(NemotronV3Model(config).layers["0"].mixer, torch.nn.Module)
    with caplog.at_level(logging.WARNING, logger="am_models_nemotron"):
        model = NemotronV3Model(config, BackendConfig(attn="eager", linear="torch", experts="torch"))
    assert model.backend.attn == "sdpa"
    assert "NemotronV3Model" in caplog.records[0].getMessage()
