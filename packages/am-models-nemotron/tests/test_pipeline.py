"""The pipeline-stage contract, single process: the model split by hand the way am-pipelining splits it (deep copy,
modules not kept set to None, layer keys deleted) gives, stage after stage, the full model's logits and MTP states."""

from __future__ import annotations

import copy

import torch
from am_nemotron_helpers import VOCAB, assert_close_rel, randomize_, tiny_hf_config, tokens

from am_model_contract import contract_of
from am_models_nemotron import NemotronHForCausalLM

FP32_TOL = 1e-6


def _model(depths: int = 2) -> NemotronHForCausalLM:
    torch.manual_seed(0)
    return randomize_(NemotronHForCausalLM(tiny_hf_config("ME*-M*", mtp_depths=depths)), seed=6).train()


def _stage(model: NemotronHForCausalLM, layers: range, *, first: bool, last: bool) -> NemotronHForCausalLM:
    stage = copy.deepcopy(model)
    for key in list(stage.model.layers.keys()):
        if int(key) not in layers:
            del stage.model.layers[key]
    if not first:
        stage.model.embed_tokens = None
    if not last:
        stage.model.norm = None
        stage.lm_head = None
        stage.mtp = None
    return stage


def test_two_stages_equal_the_full_model_forward_and_backward() -> None:
    model = _model()
    ids = tokens(2, 12)
    seq_idx = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    full = model(ids, seq_idx=seq_idx)
    stage0 = _stage(model, range(0, 3), first=True, last=False)
    stage1 = _stage(model, range(3, 6), first=False, last=True)
    sent = stage0(ids, seq_idx=seq_idx)
    assert isinstance(sent, tuple)
    assert len(sent) == 3
    hidden, *embeds = sent
    out = stage1(hidden, *embeds, seq_idx=seq_idx)
    assert len(out) == 1 + 2 + 1
    logits, h1, h2, tail = out
    assert_close_rel(logits, full.logits, rtol=FP32_TOL, what="logits")
    assert_close_rel(h1, full.mtp_per_depth_h[0], rtol=FP32_TOL, what="mtp depth 0")
    assert_close_rel(h2, full.mtp_per_depth_h[1], rtol=FP32_TOL, what="mtp depth 1")
    assert tail.dtype == torch.int32
    assert torch.equal(tail, seq_idx.to(torch.int32))
    # The declaration the pipeline loss reads: logits first, the MTP hidden states, seq_idx last.
    assert contract_of(model).pp.output_names == ("logits", "mtp_per_depth_h", "seq_idx")
    (logits.square().mean() + h1.square().mean() + h2.square().mean()).backward()
    (full.logits.square().mean() + sum(h.square().mean() for h in full.mtp_per_depth_h)).backward()
    assert_close_rel(
        stage0.model.embed_tokens.weight.grad, model.model.embed_tokens.weight.grad, rtol=1e-5, what="embed grad"
    )


def test_middle_stage_passes_the_embeddings_through() -> None:
    model = _model()
    ids = tokens(1, 9)
    hidden, *embeds = _stage(model, range(0, 2), first=True, last=False)(ids)
    middle = _stage(model, range(2, 4), first=False, last=False)
    out_hidden, *out_embeds = middle(hidden, *embeds)
    assert all(a is b for a, b in zip(out_embeds, embeds, strict=True))
    assert out_hidden.shape == hidden.shape
    logits, *_ = _stage(model, range(4, 6), first=False, last=True)(out_hidden, *out_embeds)
    assert_close_rel(logits, model(ids).logits, rtol=FP32_TOL, what="three stages")


def test_stage_without_mtp_returns_bare_tensors() -> None:
    model = _model(depths=0)
    ids = tokens(1, 7)
    hidden = _stage(model, range(0, 3), first=True, last=False)(ids)
    assert isinstance(hidden, torch.Tensor)
    assert hidden.shape == (1, 7, 32)
    logits = _stage(model, range(3, 6), first=False, last=True)(hidden)
    assert_close_rel(logits, model(ids).logits, rtol=FP32_TOL, what="no-MTP stages")


def test_stage_metas_and_module_names() -> None:
    model = _model()
    first_in, first_out = _stage(model, range(0, 3), first=True, last=False).get_pipeline_stage_metas(
        is_first=True, microbatch_size=2, seq_len=8, dtype=torch.bfloat16
    )
    assert [tuple(t.shape) for t in first_in] == [(2, 8)]
    assert first_in[0].dtype == torch.long
    assert [tuple(t.shape) for t in first_out] == [(2, 8, 32)] * 3
    last_in, last_out = model.get_pipeline_stage_metas(
        is_first=False, microbatch_size=2, seq_len=8, dtype=torch.float32
    )
    assert len(last_in) == 3
    assert [tuple(t.shape) for t in last_out] == [(2, 8, VOCAB), (2, 8, 32), (2, 8, 32), (2, 8)]
    assert last_out[-1].dtype == torch.int32
    assert all(t.device.type == "meta" for t in last_out)
    names = [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]]
    customized = model.customize_pipeline_stage_modules(names, layers_prefix="model.", text_model=model.model)
    assert customized[-1][-1] == "mtp"
    assert customized[0] == names[0]
    assert names[-1][-1] == "lm_head"
    assert _model(depths=0).customize_pipeline_stage_modules(names, layers_prefix="model.") == names
    assert model.get_pipeline_kwargs_chunk_dims({"seq_idx": torch.zeros(2, 8), "flag": True}) == {"seq_idx": 0}


def test_non_first_stage_rejects_token_ids() -> None:
    import pytest

    stage1 = _stage(_model(depths=0), range(3, 6), first=False, last=True)
    with pytest.raises(ValueError, match="hidden states"):
        stage1(tokens(1, 4))
