"""The seed API called as NeMo AutoModel documents it (`models/gemma4_moe/model.py`): the constructor's positional
order `(config, moe_config=None, backend=None, text_config=None)`, the `get_capabilities(config)` classmethod, tied
embeddings, the registry entry points naming the defining modules (so `is_custom_model` is True), and upstream's
MoE names from `upstream.py` (decoder layer, gate, state-dict adapter, text backend, `prepare_model_inputs_for_cp`)
against our own classes and transformers."""

from __future__ import annotations

import importlib
import importlib.metadata

import _g4_configs as C
import pytest
import torch
from transformers import Gemma4ForCausalLM as HFGemma4ForCausalLM

import am_models_gemma4
from am_context_parallel import make_cp_batch_and_ctx
from am_models_gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextModel
from am_models_gemma4.upstream import (
    Gemma4Gate,
    Gemma4MoEDecoderLayer,
    Gemma4MoEStateDictAdapter,
    Gemma4MoETextModelBackend,
    ShardLayout,
    prepare_model_inputs_for_cp,
)
from am_precision import BackendConfig
from am_testing import root_api_problems


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


def test_constructor_backend_and_moe_config():
    config = C.vlm_config()
    torch.manual_seed(0)
    plain = Gemma4ForConditionalGeneration(config)
    with_backend = Gemma4ForConditionalGeneration(config, None, BackendConfig(attn="sdpa", linear="torch"))
    assert with_backend.model.language_model.backend.attn == "sdpa"  # honoured (issue 26), no longer only logged
    with_backend.load_state_dict(plain.state_dict())
    ids = torch.randint(0, C.IMAGE_TOKEN - 5, (1, 6))
    torch.testing.assert_close(with_backend(input_ids=ids).logits, plain(input_ids=ids).logits)
    with pytest.raises(ValueError, match="this config is dense"):
        Gemma4ForConditionalGeneration(config, _MoEConfig())  # an MoE setting for a dense model


def test_constructor_moe_config_checked_against_the_config():
    """upstream's `moe_config` is accepted when it describes the MoE the text config builds, refused otherwise."""
    config = C.vlm_config(moe=True)
    torch.manual_seed(0)
    plain = Gemma4ForConditionalGeneration(config)
    torch.manual_seed(0)
    with_moe_config = Gemma4ForConditionalGeneration(config, _MoEConfig())
    ids = torch.randint(0, C.IMAGE_TOKEN - 5, (1, 6))
    torch.testing.assert_close(with_moe_config(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="disagree with it") as err:
        Gemma4ForConditionalGeneration(config, _MoEConfig(n_routed_experts=8, moe_inter_dim=32))
    for field in ("n_routed_experts=8", "moe_inter_dim=32"):
        assert field in str(err.value)  # every disagreeing field named at once


def test_root_has_one_name_per_object():
    """The package root binds each object to one name; upstream's other spellings live in `upstream` only."""
    assert root_api_problems(am_models_gemma4) == []
    upstream_only = {"Gemma4Gate", "Gemma4MoEDecoderLayer", "Gemma4MoEStateDictAdapter", "Gemma4MoETextModelBackend"}
    assert upstream_only.isdisjoint(am_models_gemma4.__all__)
    assert not upstream_only & set(dir(am_models_gemma4))


def test_get_capabilities_classmethod():
    dense = Gemma4ForConditionalGeneration.get_capabilities(C.vlm_config())
    moe = Gemma4ForConditionalGeneration.get_capabilities(C.vlm_config(moe=True))
    assert dense["supports_cp"]
    assert moe["supports_cp"]
    assert dense["supports_pp"]


def test_package_modules_importable_by_upstream_style_paths():
    for name in ("model", "vlm", "moe", "state_dict_adapter", "cp", "upstream"):
        importlib.import_module(f"am_models_gemma4.{name}")


class _MoEConfig:
    """Upstream's `MoEConfig` fields for the tiny MoE config (what its text backend would build)."""

    def __init__(self, **overrides: object) -> None:
        self.dim, self.inter_dim, self.moe_inter_dim = 32, 64, 16
        self.n_routed_experts, self.n_activated_experts, self.n_shared_experts = 4, 2, 0
        self.score_func, self.norm_topk_prob, self.expert_activation = "softmax", True, "geglu"
        self.dtype, self.train_gate = torch.bfloat16, True  # not compared: they do not change the computation
        self.__dict__.update(overrides)


def _moe_model(seed: int = 0) -> Gemma4ForCausalLM:
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(C.text_config(moe=True)).eval()
    C.perturb_(model)
    return model


def test_moe_decoder_layer_upstream_signature():
    model = _moe_model()
    config = model.config
    layer = Gemma4MoEDecoderLayer(config, 1, _MoEConfig(), BackendConfig(attn="sdpa", linear="torch"))
    assert layer.self_attn.core_attention.attn == "sdpa"  # the backend is honoured (issue 26), no longer only logged
    layer.load_state_dict(model.model.layers["1"].state_dict())
    ids = torch.randint(1, C.VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        model.model.layers["1"] = layer.eval()  # the upstream-named layer in place of ours, same weights
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    # positional order (config, layer_idx, moe_config, backend); defaults None
    assert Gemma4MoEDecoderLayer(config, 0).layer_idx == 0
    with pytest.raises(ValueError, match="disagree with it") as err:
        Gemma4MoEDecoderLayer(config, 0, _MoEConfig(n_routed_experts=8, n_activated_experts=3, score_func="sigmoid"))
    for field in ("n_routed_experts=8", "n_activated_experts=3", "score_func='sigmoid'"):
        assert field in str(err.value)  # every disagreeing field named at once
    with pytest.raises(ValueError, match="enable_moe_block=True"):
        Gemma4MoEDecoderLayer(C.text_config(), 0)


def test_gate_routes_like_our_router():
    model = _moe_model()
    router = model.model.layers["1"].moe.router
    gate = Gemma4Gate(model.config, False)
    gate.load_state_dict(router.state_dict())  # same parameters: proj.weight, scale, per_expert_scale
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    weights, indices, aux = gate(x, torch.ones(10, dtype=torch.bool), None)
    ref_weights, ref_indices = router(x)
    assert aux is None
    assert weights.dtype == torch.bfloat16  # x's dtype, as upstream
    torch.testing.assert_close(indices, ref_indices, rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_weights.to(torch.bfloat16), rtol=0, atol=0)
    # the per-expert scale is in the weights: with ones they are the renormalized top-k probabilities
    with torch.no_grad():
        gate.per_expert_scale.fill_(1.0)
    torch.testing.assert_close(gate(x.float())[0].sum(-1), torch.ones(10))
    with pytest.raises(NotImplementedError, match="routing replay"):
        Gemma4Gate(model.config, enable_routing_replay=True)
    with pytest.raises(ValueError, match="enable_moe_block=True"):
        Gemma4Gate(C.text_config())
    with pytest.raises(ValueError, match="token_mask has shape"):
        gate(x, torch.ones(3, dtype=torch.bool))


def test_state_dict_adapter_round_trips_transformers_keys():
    torch.manual_seed(0)
    config = C.text_config(moe=True)
    hf = HFGemma4ForCausalLM(config).eval()
    C.perturb_(hf)
    hf_sd = hf.state_dict()
    assert any(k.endswith("router.per_expert_scale") for k in hf_sd)
    adapter = Gemma4MoEStateDictAdapter(config, _MoEConfig(), None, torch.float32)
    ours = Gemma4ForCausalLM(config).eval()
    ours.load_state_dict(adapter.from_hf(hf_sd), strict=True)
    ids = torch.randint(1, C.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    back = adapter.to_hf(adapter.from_hf(hf_sd))
    assert set(back) == set(hf_sd)
    for key, tensor in hf_sd.items():
        torch.testing.assert_close(back[key], tensor, rtol=0, atol=0)  # per-expert scale kept, nothing folded
    no_router = adapter.to_hf(ours.state_dict(), exclude_key_regex=r".*router\..*")
    assert not any("router." in k for k in no_router)
    assert any("experts." in k for k in no_router)
    ((name, tensor),) = adapter.convert_single_tensor_to_hf(
        "model.layers.1.moe.experts.down_proj", hf_sd["model.layers.1.experts.down_proj"]
    )
    assert name == "model.layers.1.experts.down_proj"
    bf16 = Gemma4MoEStateDictAdapter(config, dtype=torch.bfloat16).from_hf(hf_sd)
    assert bf16["model.layers.1.moe.experts.down_proj"].dtype == torch.bfloat16
    assert bf16["model.layers.1.moe.router.proj.weight"].dtype == torch.float32  # pinned, as in the model
    with pytest.raises(ValueError, match="apply_expert_parallel"):
        adapter.from_hf(hf_sd, device_mesh=object())
    with pytest.raises(ValueError, match="moe_inter_dim"):
        Gemma4MoEStateDictAdapter(config, _MoEConfig(moe_inter_dim=64))


def test_text_model_backend_equals_ours():
    config = C.text_config(moe=True)
    torch.manual_seed(0)
    ours = Gemma4TextModel(config).eval()
    C.perturb_(ours)
    backend = Gemma4MoETextModelBackend(config, None, moe_config=_MoEConfig(), moe_overrides={"aux_loss_coeff": 0})
    backend.load_state_dict(ours.state_dict())
    ids = torch.randint(1, C.VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        got = backend(ids, attention_mask=mask, cache_position=torch.arange(8), cp_enabled=False)
        ref = ours(ids, attention_mask=mask)
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state, rtol=0, atol=0)
    with pytest.raises(ValueError, match="pixel_values") as err:
        backend(ids, pixel_values=torch.zeros(1, 3, 4, 4), cp_enabled=True)
    assert "cp_enabled=True" in str(err.value)
    with pytest.raises(ValueError, match="moe_overrides\\['n_routed_experts'\\]"):
        Gemma4MoETextModelBackend(config, moe_overrides={"n_routed_experts": 2})


def test_text_model_backend_vision_bidirectional_mm_ids():
    config = C.text_config(moe=True, use_bidirectional_attention="vision")
    torch.manual_seed(0)
    backend = Gemma4MoETextModelBackend(config).eval()
    ours = Gemma4TextModel(config).eval()
    ours.load_state_dict(backend.state_dict())
    ids = torch.randint(1, C.VOCAB, (1, 8), generator=torch.Generator().manual_seed(5))
    mm = torch.tensor([[0, 1, 1, 1, 0, 0, 0, 0]])
    from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask

    with torch.no_grad():
        got = backend(ids, mm_token_type_ids=mm).last_hidden_state
        ref = ours(ids, vision_group_ids=get_block_sequence_ids_for_mask(mm, device=ids.device)).last_hidden_state
        causal = ours(ids).last_hidden_state
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert not torch.allclose(got[:, 1:3], causal[:, 1:3])  # the image tokens did see each other


class _OneProcessMesh:
    """A 1-D CP mesh seen from one process (no process group): its size and this process's coordinate."""

    mesh_dim_names = ("cp",)

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self) -> None:  # the context keeps it for entering (a ring step), which this test does not do
        return None

    def __getitem__(self, name: str) -> _OneProcessMesh:
        return self


@pytest.mark.parametrize("rank", [0, 1])
def test_prepare_model_inputs_for_cp_shards_like_make_cp_batch_and_ctx(rank):
    model = _moe_model()
    ids = torch.randint(1, C.VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))

    def batch() -> dict:
        return {"input_ids": ids.clone(), "labels": torch.roll(ids, -1, 1), "attention_mask": torch.ones(2, 7)}

    given = batch()
    prepared = prepare_model_inputs_for_cp(model, given, num_chunks=1)
    assert set(prepared) == {"cp_sharder"}
    assert set(given) == {"input_ids", "labels", "attention_mask"}
    sharder = prepared["cp_sharder"]
    mesh = _OneProcessMesh(2, rank)
    ctx, local, layout = sharder.shard_batch(mesh, None, batch(), loss_mask=None, padding_token_id=0)
    ref_ctx, ref = make_cp_batch_and_ctx(mesh, batch(), model=model)
    assert layout == ShardLayout(7, 8)  # padded to a multiple of 2C
    assert set(local) == set(ref)
    for key, value in ref.items():
        torch.testing.assert_close(local[key], value, rtol=0, atol=0)
    torch.testing.assert_close(ctx.positions, ref_ctx.positions)
    indices = sharder.local_token_global_indices(mesh, 8, "cpu")
    assert indices.tolist() == list(range(4 * rank, 4 * rank + 4))
    torch.testing.assert_close(indices.view(1, -1).expand(2, -1), local["position_ids"])
    with pytest.raises(ValueError, match=r"prepare_model_inputs_for_cp requires input_ids\."):
        prepare_model_inputs_for_cp(model, {"labels": ids})
    with pytest.raises(ValueError, match="num_chunks=2"):
        prepare_model_inputs_for_cp(model, batch(), num_chunks=2)
