"""The seed API called as NeMo AutoModel documents it (`models/nemotron_v3/{model,cache,mtp}.py`): positional
constructor order, class attributes the infrastructure reads, the pipeline hooks, the cache, and the registry entry
point naming the defining module (so `is_custom_model` is True). Behaviour of the forward, MTP loss and CP lives in
the other test modules."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from am_nemotron_helpers import VOCAB, tiny_hf_config, tokens

from am_models_nemotron import ModelClass, NemotronHForCausalLM, NemotronHybridCache, default_backend, roll_tensor
from am_precision import cast_model_to_dtype


def test_entry_point_names_the_defining_module():
    points = {ep.name: ep for ep in importlib.metadata.entry_points(group="am_capabilities.models")}
    entry = points["NemotronHForCausalLM"]
    assert entry.module == NemotronHForCausalLM.__module__  # what is_custom_model matches, without importing
    assert entry.attr == NemotronHForCausalLM.__qualname__
    assert entry.load() is NemotronHForCausalLM
    assert ModelClass is NemotronHForCausalLM


def test_causal_lm_positional_backend_and_class_attributes():
    config = tiny_hf_config("M*-E")
    torch.manual_seed(0)
    model = NemotronHForCausalLM(config, default_backend())  # (config, backend)
    assert NemotronHForCausalLM._pp_keep_self_forward is True
    assert {"e_score_correction_bias", "_fp32_params"} <= set(NemotronHForCausalLM._keep_in_fp32_modules_strict)
    ids = tokens(2, 8)
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 8, VOCAB)
    assert torch.isfinite(out.loss)
    a_log = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("A_log")}
    assert a_log
    cast_model_to_dtype(model, torch.bfloat16, ("_fp32_params",))  # upstream's initialize_weights cast
    for name, param in model.named_parameters():
        if name in a_log:
            assert param.dtype == torch.float32
            assert torch.equal(param, a_log[name])


def test_hybrid_cache_positional():
    config = tiny_hf_config("M*")
    cache = NemotronHybridCache(config, 2, torch.float32, "cpu")  # (config, batch_size, dtype, device)
    assert cache.get_seq_length() == 0
    assert cache.has_previous_state is False
    conv = cache.conv_states[0]
    assert conv.shape[0] == 2
    assert conv.shape[-1] == config.conv_kernel


def test_pipeline_hooks_as_documented():
    model = NemotronHForCausalLM(tiny_hf_config("M*", mtp_depths=1), default_backend())
    names = model.customize_pipeline_stage_modules([["model.embed_tokens"], ["lm_head"]], layers_prefix="model.")
    assert names == [["model.embed_tokens"], ["lm_head", "mtp"]]
    inputs, outputs = model.get_pipeline_stage_metas(is_first=True, microbatch_size=2, seq_len=4, dtype=torch.bfloat16)
    assert inputs[0].shape == (2, 4)
    assert inputs[0].dtype == torch.int64
    assert all(t.device.type == "meta" for t in (*inputs, *outputs))


def test_gradient_checkpointing_enable_keeps_the_forward():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_hf_config("M*-"), default_backend())
    ids = tokens(1, 8)
    expected = model(ids).logits
    model.gradient_checkpointing_enable()
    torch.testing.assert_close(model(ids).logits, expected)


@pytest.mark.parametrize(("shifts", "expected"), [(-1, [11, 12, 13, 0]), (1, [0, 10, 11, 12])])
def test_roll_tensor_zero_fills(shifts, expected):
    assert roll_tensor(torch.tensor([10, 11, 12, 13]), shifts, -1).tolist() == expected
