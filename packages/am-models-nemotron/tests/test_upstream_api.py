"""The seed API called as NeMo AutoModel documents it (`models/nemotron_v3/{model,layers,cache,mtp,
state_dict_adapter}.py`, `common/mtp`): positional constructor order, upstream class names (from
`am_models_nemotron.upstream`), class attributes the infrastructure reads, the pipeline and CP hooks, the cache, the
state dict adapter, and the registry entry point naming the defining module (so `is_custom_model` is True); and the
split itself: one root name per thing, and a core that never imports `upstream`. Behaviour of the forward, MTP loss
and CP lives in the other test modules."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import types

import pytest
import torch
from am_nemotron_helpers import VOCAB, hf_model, randomize_, tiny_hf_config, tokens
from torch import nn

import am_models_nemotron
from am_model_contract import contract_of
from am_models_nemotron import (
    Mamba2FP32Params,
    Mamba2Mixer,
    MambaRMSNormGated,
    MTPConfig,
    MTPSublayer,
    NemotronAttention,
    NemotronBlock,
    NemotronHForCausalLM,
    NemotronHybridCache,
    NemotronStateDictAdapter,
    default_backend,
    roll_tensor,
    upstream,
)
from am_models_nemotron import MTPModule as CoreMTPModule
from am_models_nemotron.upstream import (
    ModelClass,
    MTPModule,
    NemotronV3Attention,
    NemotronV3Block,
    NemotronV3Mamba2Mixer,
    NemotronV3MambaFP32Params,
    NemotronV3MambaRMSNormGated,
    NemotronV3MTPSublayer,
    NemotronV3StateDictAdapter,
    build_mtp_config_from_hf,
    parse_mtp_layer_pattern,
)
from am_precision import cast_model_to_dtype
from am_testing import root_api_problems


def test_the_root_has_one_name_per_thing_and_no_private_names():
    """No two names of the root's `__all__` are bound to the same object, none is `_private`, and none of
    upstream's extra spellings is at the root."""
    assert root_api_problems(am_models_nemotron) == []
    assert not set(upstream.__all__) & set(am_models_nemotron.__all__) - {"MTPModule", "NemotronHForCausalLM"}
    assert upstream.MTPModule is not CoreMTPModule
    assert upstream.NemotronHForCausalLM is not NemotronHForCausalLM
    for name in upstream.__all__:
        assert hasattr(upstream, name), name


def test_the_core_never_imports_upstream():
    code = (
        "import sys, am_models_nemotron, am_models_nemotron.model, am_models_nemotron.checkpoint; "
        "print('am_models_nemotron.upstream' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert result.stdout.strip() == "False"


def test_entry_point_names_the_defining_module():
    points = {ep.name: ep for ep in importlib.metadata.entry_points(group="am_capabilities.models")}
    entry = points["NemotronHForCausalLM"]
    assert entry.module == NemotronHForCausalLM.__module__  # what is_custom_model matches, without importing
    assert entry.attr == NemotronHForCausalLM.__qualname__
    assert entry.load() is NemotronHForCausalLM
    assert issubclass(ModelClass, NemotronHForCausalLM)  # upstream's registry name: the core + upstream's hooks


def test_causal_lm_positional_backend_and_class_attributes():
    config = tiny_hf_config("M*-E")
    torch.manual_seed(0)
    model = NemotronHForCausalLM(config, default_backend())  # (config, backend)
    assert upstream.NemotronHForCausalLM._pp_keep_self_forward is True  # NeMo's spelling lives in the upstream layer
    assert contract_of(model).pp.keeps_own_forward  # what am-pipelining reads
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


def _model(pattern: str = "M*-E", *, mtp_depths: int = 0) -> NemotronHForCausalLM:
    torch.manual_seed(0)
    return randomize_(NemotronHForCausalLM(tiny_hf_config(pattern, mtp_depths=mtp_depths), default_backend()))


def test_block_with_upstream_arguments_matches_the_models_block():
    """`NemotronV3Block(config, layer_idx, moe_config, backend, block_type)` positionally, with the weights of the
    model's own block of that index, computes what the model's block computes."""
    model = _model("M*-E")
    config = model.config
    hidden = torch.randn(2, 8, config.hidden_size)
    for index in range(4):
        ours = model.model.layers[str(index)]
        block = NemotronV3Block(config, index, None, default_backend(), None)
        assert block.block_type == ours.block_type
        block.load_state_dict(ours.state_dict())
        torch.testing.assert_close(block(hidden), ours(hidden), rtol=0, atol=0)
    assert NemotronV3Block(config, 0).block_type == "mamba"  # backend=None: the plain-PyTorch default
    assert NemotronV3Block(config, 0, None, None, "mlp").block_type == "mlp"  # block_type override (MTP)
    assert isinstance(NemotronV3Block(config, 0), NemotronBlock)
    assert NemotronV3Block(config, 3, types.SimpleNamespace(n_routed_experts=6)).block_type == "moe"  # agrees
    with pytest.raises(ValueError, match="moe_config=None"):
        NemotronV3Block(config, 3, types.SimpleNamespace(n_routed_experts=4))


def test_layer_classes_under_upstream_names_and_signatures():
    model = _model("M*")
    config = model.config
    hidden = torch.randn(2, 8, config.hidden_size)
    assert NemotronV3Mamba2Mixer is Mamba2Mixer
    assert NemotronV3MambaRMSNormGated is MambaRMSNormGated
    assert NemotronV3MambaFP32Params is Mamba2FP32Params
    assert NemotronV3MTPSublayer is MTPSublayer
    mixer = NemotronV3Mamba2Mixer(config, 0)  # (config, layer_idx)
    mixer.load_state_dict(model.model.layers["0"].mixer.state_dict())
    torch.testing.assert_close(mixer(hidden), model.model.layers["0"].mixer(hidden), rtol=0, atol=0)
    attention = NemotronV3Attention(config, default_backend())  # (config, backend)
    assert isinstance(attention, NemotronAttention)
    attention.load_state_dict(model.model.layers["1"].mixer.state_dict())
    torch.testing.assert_close(attention(hidden), model.model.layers["1"].mixer(hidden), rtol=0, atol=0)
    norm = NemotronV3MambaRMSNormGated(16, 8, 1e-5)  # (hidden, group_size, eps)
    x, gate = torch.randn(3, 16), torch.randn(3, 16)
    gated = (x * torch.nn.functional.silu(gate)).view(3, 2, 8)
    expected = (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)).view(3, 16)
    torch.testing.assert_close(norm(x, gate), expected)
    a_log, dt_bias, d = NemotronV3MambaFP32Params(4)()  # (num_heads); forward -> (A_log, dt_bias, D)
    torch.testing.assert_close(a_log, torch.log(torch.arange(1, 5, dtype=torch.float32)))
    assert torch.equal(dt_bias, torch.ones(4))
    assert torch.equal(d, torch.ones(4))


def test_state_dict_adapter_upstream_signature_round_trips_hf_keys():
    config = tiny_hf_config("M*E")  # transformers' NemotronH has no MTP weights (test_mtp.py round-trips those)
    hf = hf_model(config)
    hf_state = dict(hf.state_dict())
    adapter = NemotronV3StateDictAdapter(config, types.SimpleNamespace(n_routed_experts=6), default_backend())
    assert isinstance(adapter, NemotronStateDictAdapter)
    ours = NemotronHForCausalLM(config, default_backend())
    ours.load_state_dict(adapter.from_hf(hf_state))  # strict: every HF key placed, nothing missing
    exported = adapter.to_hf(ours.state_dict())
    assert "backbone.embeddings.weight" in exported
    assert "backbone.layers.0.mixer.A_log" in exported
    assert "backbone.layers.2.mixer.experts.5.down_proj.weight" in exported
    back = adapter.from_hf(exported)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())

    bf16 = NemotronV3StateDictAdapter(config, None, None, torch.bfloat16)  # (config, moe_config, backend, dtype)
    loaded = bf16.from_hf(hf_state)
    assert loaded["model.layers.0.mixer._fp32_params.A_log"].dtype == torch.float32  # pinned: fp32
    assert loaded["model.layers.2.mixer.gate.e_score_correction_bias"].dtype == torch.float32
    assert loaded["model.layers.0.mixer.in_proj.weight"].dtype == torch.bfloat16
    assert bf16.to_hf(loaded)["backbone.layers.0.mixer.A_log"].dtype == torch.float32
    with pytest.raises(ValueError, match=r"n_routed_experts=4 disagrees.*\n.*must be an am_precision.BackendConfig"):
        NemotronV3StateDictAdapter(config, types.SimpleNamespace(n_routed_experts=4), "te")


def test_mtp_module_upstream_constructor_calls_the_factory():
    calls = []

    def factory(**kwargs):
        calls.append(kwargs)
        return nn.Identity()

    mtp_config = MTPConfig(num_layers=2, layer_pattern=("attention", "moe"))
    module = MTPModule(mtp_config, ["attention", "moe"], factory)  # (mtp_config, block_types, sublayer_factory)
    assert len(module.layers) == 4
    assert calls[3] == {
        "global_idx": 3,
        "depth": 1,
        "sublayer_idx": 1,
        "block_type": "moe",
        "has_fusion": False,
        "has_final_norm": True,
    }
    assert [c["has_fusion"] for c in calls] == [True, False, True, False]
    repeated = MTPModule(MTPConfig(2, ("attention",), 0.1, True), ["attention"], factory)
    assert len(repeated.layers) == 1  # one physical depth, applied twice
    with pytest.raises(ValueError, match="2 sublayers per depth"):
        MTPModule(mtp_config, ["attention"], factory)
    with pytest.raises(ValueError, match="enabled MTPConfig"):
        MTPModule(MTPConfig(), [], factory)
    assert isinstance(module, CoreMTPModule)
    model = _model("M*", mtp_depths=2)
    built = CoreMTPModule(model.config, model.mtp_config, backend=default_backend())
    assert built.state_dict().keys() == model.mtp.state_dict().keys()
    factory_built = MTPModule(  # upstream's constructor with the Nemotron sublayers: the same module
        model.mtp_config,
        model.mtp_config.layer_pattern,
        lambda *, global_idx, block_type, has_fusion, has_final_norm, **_: MTPSublayer(
            model.nemotron_config,
            model.nemotron_config.num_hidden_layers + global_idx,
            block_type=block_type,
            has_fusion=has_fusion,
            has_final_norm=has_final_norm,
            backend=default_backend(),
        ),
    )
    factory_built.load_state_dict(model.mtp.state_dict())
    hidden = torch.randn(1, 8, model.config.hidden_size)
    embeds = [torch.randn(1, 8, model.config.hidden_size) for _ in range(2)]
    for ours, theirs in zip(
        model.mtp(hidden, embed_inputs=embeds), factory_built(hidden, embed_inputs=embeds), strict=True
    ):
        torch.testing.assert_close(theirs, ours, rtol=0, atol=0)


def test_mtp_pattern_and_config_helpers():
    assert parse_mtp_layer_pattern("*E") == ["attention", "moe"]
    assert parse_mtp_layer_pattern("M-") == ["mamba", "mlp"]
    with pytest.raises(ValueError, match="MTP layer pattern is empty"):
        parse_mtp_layer_pattern("")
    with pytest.raises(ValueError, match=r"Unknown MTP layer symbol\(s\) \['X', 'Y'\]"):
        parse_mtp_layer_pattern("*XY")
    config = tiny_hf_config("M*", mtp_depths=2, mtp_pattern="*E")
    mtp = build_mtp_config_from_hf(config)
    assert mtp == MTPConfig(2, ("attention", "moe"), 0.1, False)
    assert mtp.enabled
    assert mtp.total_sublayers == 4
    mtp = build_mtp_config_from_hf(config, loss_scaling_factor=0.3, num_nextn_predict_layers=3, use_repeated_layer=True)
    assert (mtp.num_layers, mtp.loss_scaling_factor, mtp.num_physical_depths) == (3, 0.3, 1)


def _upstream_model(pattern: str, *, mtp_depths: int = 0) -> upstream.NemotronHForCausalLM:
    torch.manual_seed(0)
    return upstream.NemotronHForCausalLM(tiny_hf_config(pattern, mtp_depths=mtp_depths), default_backend())


def test_prepare_mtp_inputs_for_cp_is_the_mtp_part_of_prepare_batch_for_cp():
    model = _upstream_model("M*", mtp_depths=2).train()
    assert not hasattr(NemotronHForCausalLM, "prepare_mtp_inputs_for_cp")  # the core has one CP hook
    ids = tokens(2, 8)
    batch = {"input_ids": ids, "labels": ids.clone()}
    mtp_inputs = model.prepare_mtp_inputs_for_cp(batch, ignore_index=-100)
    assert set(mtp_inputs) == {"mtp_per_depth_input_ids", "mtp_per_depth_targets"}
    assert mtp_inputs["mtp_per_depth_input_ids"].shape == (2, 2, 8)
    full = model.prepare_batch_for_cp(batch)
    for key, value in mtp_inputs.items():
        assert torch.equal(value, full[key])
    assert torch.equal(mtp_inputs["mtp_per_depth_input_ids"][:, 0], roll_tensor(ids, -1, 1))  # depth 0: token t + 1
    assert set(batch) == {"input_ids", "labels"}  # the batch is not changed
    assert model.eval().prepare_mtp_inputs_for_cp(batch) is None  # MTP does not run in eval
    assert _upstream_model("M*").train().prepare_mtp_inputs_for_cp(batch) is None  # no MTP depths
