"""Parity with transformers' NemotronHForCausalLM (logits, loss, gradients; fp32), checkpoints both ways, the fp32
contract after a bf16 cast, gradient checkpointing, packed documents and the declared capabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from am_nemotron_helpers import VOCAB, assert_close_rel, hf_model, randomize_, save_hf, tiny_hf_config, tokens
from transformers import NemotronHForCausalLM as HFNemotronH

from am_model_io import read_safetensors_folder
from am_models_nemotron import NemotronHCausalLMOutputWithPast, NemotronHForCausalLM, NemotronStateDictAdapter
from am_precision import assert_fp32_contract, cast_model_to_dtype, fp32_report

# fp32, same op order where it matters: logits agree to ~1e-7 relative; 1e-5 leaves room for summation order.
PARITY_RTOL = 1e-5

PATTERNS = {"dense": "M*-M*-", "moe": "ME*EM-"}


def _hf_name(name: str) -> str:
    return (
        name.replace("._fp32_params", "").replace("embed_tokens", "embeddings").replace("model.norm.", "model.norm_f.")
    )


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, our model loaded from its save_pretrained folder, folder)."""
    hf = hf_model(tiny_hf_config(PATTERNS[request.param]), seed=1)
    folder = save_hf(hf, tmp_path_factory.mktemp(request.param))
    return hf, NemotronHForCausalLM.from_pretrained(folder).eval(), folder


def test_logits_match_transformers(pair) -> None:
    hf, ours, _ = pair
    ids = tokens(2, 21)
    with torch.no_grad():
        expected = hf(ids).logits
        actual = ours(ids).logits
    assert_close_rel(actual, expected, rtol=PARITY_RTOL, what="logits")


def test_padded_batch_logits_match_transformers_on_real_tokens(pair) -> None:
    hf, ours, _ = pair
    ids = tokens(2, 16, seed=3)
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0  # right padding: real tokens never see pads
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
        actual = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert_close_rel(actual[real], expected[real], rtol=PARITY_RTOL, what="padded logits")


def test_loss_and_gradients_match_transformers(pair) -> None:
    hf, ours, _ = pair
    ids = tokens(2, 19, seed=4)
    labels = ids.clone()
    labels[0, :5] = -100
    hf.zero_grad()
    ours.zero_grad()
    hf_loss = hf(ids, labels=labels).loss
    our_loss = ours(ids, labels=labels).loss
    hf_loss.backward()
    our_loss.backward()
    assert_close_rel(our_loss, hf_loss, rtol=PARITY_RTOL, what="loss")
    hf_params = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        reference = hf_params[_hf_name(name)].grad
        if name.endswith("experts.up_proj") or name.endswith("experts.down_proj"):
            assert param.grad is not None
        assert_close_rel(param.grad, reference, rtol=PARITY_RTOL, what=f"grad {name}")


def test_our_checkpoint_loads_in_transformers_with_equal_logits(pair, tmp_path: Path) -> None:
    _hf, ours, _ = pair
    ours.save_pretrained(tmp_path)
    reloaded = HFNemotronH.from_pretrained(str(tmp_path)).eval()
    ids = tokens(2, 17, seed=5)
    with torch.no_grad():
        assert_close_rel(reloaded(ids).logits, ours(ids).logits, rtol=PARITY_RTOL, what="reloaded in HF")
    stored = read_safetensors_folder(tmp_path)
    assert any(k.startswith("backbone.layers.0.mixer.A_log") for k in stored)
    assert all(not k.startswith("model.") for k in stored)


def test_transformers_in_memory_state_dict_is_accepted(pair) -> None:
    hf, ours, _ = pair
    adapter = NemotronStateDictAdapter(ours.config)
    converted = adapter.from_hf(hf.state_dict())
    assert set(converted) == set(ours.state_dict())
    for key, value in ours.state_dict().items():
        assert torch.equal(converted[key], value), key


def test_fp32_pinned_values_survive_a_bf16_cast_bit_exactly(pair) -> None:
    _, _ours, folder = pair
    model = NemotronHForCausalLM.from_pretrained(folder)
    pinned_before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()] if _is_pinned(n)}
    assert pinned_before, "the model has fp32-pinned tensors"
    cast_model_to_dtype(model, torch.bfloat16)
    report = assert_fp32_contract(model, storage_dtype=torch.bfloat16)
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    for name, before in pinned_before.items():
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], before), name
    assert {e.name for e in report.pinned} == set(pinned_before)
    with torch.no_grad():
        logits = model(tokens(1, 9)).logits
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()
    assert len(fp32_report(model).violations) == 0


def _is_pinned(name: str) -> bool:
    return "_fp32_params" in name or name.endswith("e_score_correction_bias")


def test_random_init_samples_in_fp32_and_keeps_pinned_fp32() -> None:
    model = NemotronHForCausalLM(tiny_hf_config("ME*"), dtype=torch.bfloat16)
    mixer = model.model.layers["0"].mixer
    assert mixer.A_log.dtype == torch.float32
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1, 5, dtype=torch.float32)))
    assert model.model.layers["1"].mixer.gate.e_score_correction_bias.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_packed_rows_equal_each_document_alone() -> None:
    torch.manual_seed(0)
    model = randomize_(NemotronHForCausalLM(tiny_hf_config("ME*M-")), seed=2).eval()
    docs = [tokens(1, n, seed=10 + n) for n in (7, 12, 5)]
    packed = torch.cat(docs, dim=1)
    seq_idx = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)], dim=1)
    with torch.no_grad():
        logits = model(packed, seq_idx=seq_idx).logits
        start = 0
        for doc in docs:
            alone = model(doc).logits
            assert_close_rel(logits[:, start : start + doc.shape[1]], alone, rtol=PARITY_RTOL, what="document")
            start += doc.shape[1]
    with torch.no_grad():  # `_packed_seq_ids` (1-based) is the same input
        assert_close_rel(model(packed, _packed_seq_ids=seq_idx + 1).logits, logits, rtol=0, what="_packed_seq_ids")


def test_padding_from_the_attention_mask_is_excluded_from_moe_routing() -> None:
    """The model passes its padding (attention_mask == 0) to every MoE block: only real tokens reach the router, and
    what sits in the padded slots changes no real token's output."""
    torch.manual_seed(0)
    model = randomize_(NemotronHForCausalLM(tiny_hf_config("ME*E-")), seed=5).eval()
    ids = tokens(2, 10, seed=6)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, 8:] = 0  # right padding
    pads = ~mask.bool()
    routed: list[int] = []
    gates = [layer.mixer.gate for layer in model.model.layers.values() if layer.block_type == "moe"]
    hooks = [gate.register_forward_hook(lambda _m, args, _out: routed.append(args[0].shape[0])) for gate in gates]
    try:
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
            other = ids.clone()
            other[pads] = (other[pads] + 11) % VOCAB
            logits_other = model(other, attention_mask=mask).logits
    finally:
        for hook in hooks:
            hook.remove()
    assert routed == [int(mask.sum())] * (2 * len(gates))
    real = mask.bool()
    assert_close_rel(logits_other[real], logits[real], rtol=1e-6, what="real tokens with other pad contents")


def test_gradient_checkpointing_is_idempotent_and_gives_equal_gradients() -> None:
    torch.manual_seed(0)
    model = randomize_(NemotronHForCausalLM(tiny_hf_config("ME*-", mtp_depths=1)), seed=3).train()
    ids = tokens(2, 12)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    names = [n for n, _ in model.named_parameters()]
    model.gradient_checkpointing_enable()
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    assert [n for n, _ in model.named_parameters()] == names
    checkpointed = grads()
    for name, grad in plain.items():
        assert torch.equal(checkpointed[name], grad), name
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    with pytest.raises(ValueError, match="non-reentrant"):
        model.gradient_checkpointing_enable({"use_reentrant": True})


def test_tied_embeddings_are_rejected() -> None:
    with pytest.raises(NotImplementedError, match="tie_word_embeddings"):
        NemotronHForCausalLM(tiny_hf_config("M*", tie_word_embeddings=True))


def test_output_type_hidden_states_and_bad_kwargs() -> None:
    model = NemotronHForCausalLM(tiny_hf_config("M*-")).eval()
    ids = tokens(1, 6)
    out = model(ids, output_hidden_states=True)
    assert isinstance(out, NemotronHCausalLMOutputWithPast)
    assert len(out.hidden_states) == 4
    assert out.logits.shape == (1, 6, VOCAB)
    assert model(ids, logits_to_keep=2).logits.shape == (1, 2, VOCAB)
    with pytest.raises(ValueError, match="logits_to_keep=2 cannot be combined with labels"):
        model(ids, labels=ids, logits_to_keep=2)
    with pytest.raises(TypeError, match="not_an_option"):
        model(ids, not_an_option=1)
    with pytest.raises(ValueError, match="both input_ids and inputs_embeds"):
        model(ids, inputs_embeds=model.model.embed_tokens(ids))


def test_capabilities_are_declared_by_duck_typing() -> None:
    moe = NemotronHForCausalLM.get_capabilities(tiny_hf_config("ME"))
    dense = NemotronHForCausalLM.get_capabilities(tiny_hf_config("M*-"))
    # TP from the declared plan (tp_plan.py; issue 24); am-capabilities checks its sizes at the mesh's tp
    assert moe == {"supports_pp": True, "supports_ep": True, "supports_tp": True, "supports_cp": True}
    assert dense["supports_ep"] is False
    assert dense["supports_pp"] is True
    assert NemotronHForCausalLM._pp_plan
    assert NemotronHForCausalLM.supports_gradient_checkpointing is True


def test_contract_declares_pipeline_cp_and_expert_parallel() -> None:
    """What every infrastructure package reads (am-model-contract), with hooks bound to the instance."""
    from am_model_contract import contract_of

    moe_model, dense_model = NemotronHForCausalLM(tiny_hf_config("ME")), NemotronHForCausalLM(tiny_hf_config("M*-"))
    moe, dense = contract_of(moe_model), contract_of(dense_model)
    assert moe.pp.keeps_own_forward
    assert moe.pp.plan == NemotronHForCausalLM._pp_plan
    # without MTP the last stage returns bare logits; with MTP the per-depth hidden states and the seq_idx tail too
    assert moe.pp.output_names == ("logits",)
    mtp = contract_of(NemotronHForCausalLM(tiny_hf_config("ME", mtp_depths=1)))
    assert mtp.pp.output_names == ("logits", "mtp_per_depth_h", "seq_idx")
    assert moe.cp.layout == "contiguous"  # am-context-parallel's declared contiguous path
    assert moe.cp.options is not None
    assert moe.cp.options() == moe_model.get_cp_options()
    assert moe.cp.problems is not None
    assert moe.cp.problems(seq_len=16, local_seq_len=8, cp_size=2) == []
    assert moe.cp.prepare == moe_model.prepare_batch_for_cp  # whole sequences prepared before sharding
    assert moe.pp.loss == moe_model.combined_loss  # the training-loss rule am-pipelining's loss calls
    assert moe.ep.is_moe
    assert moe.ep.apply is not None
    assert moe.ep.apply.__self__ is moe_model
    assert (dense.ep.is_moe, dense.ep.apply) == (False, None)
    # the whole model's plan (each mixer class's `_tp_plan` under its layer), the one am-tensor-parallel applies
    assert moe.tp.plan is not None
    assert "lm_head" in moe.tp.plan
    assert any(key.startswith("model.layers.") for key in moe.tp.plan)
    for old in ("_cp_layout", "_pp_keep_self_forward", "pipeline_output_names"):
        assert not hasattr(NemotronHForCausalLM, old)


def test_sharded_checkpoint_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_hf_config("ME*", mtp_depths=1)).eval()
    model.save_pretrained(tmp_path, max_shard_size=20_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = NemotronHForCausalLM.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_construction_dtype_comes_from_the_config_as_upstream_builds_it() -> None:
    """No `dtype=`: the config's torch_dtype (fp32-pinned tensors stay fp32); an explicit dtype wins; a config
    without one builds in torch's default dtype."""
    model = NemotronHForCausalLM(tiny_hf_config("ME*", torch_dtype="bfloat16"))
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers["0"].mixer.A_log.dtype == torch.float32
    assert model.model.layers["1"].mixer.gate.e_score_correction_bias.dtype == torch.float32
    assert (
        NemotronHForCausalLM(tiny_hf_config("M*", torch_dtype="bfloat16"), dtype=torch.float32).dtype == torch.float32
    )
    assert NemotronHForCausalLM(tiny_hf_config("M*")).dtype == torch.get_default_dtype()
