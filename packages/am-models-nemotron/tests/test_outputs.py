"""What upstream users rely on in the output: a `CausalLMOutputWithPast` whose `loss` is the next-token loss, the
MTP fields declared, hidden states in transformers' convention (checked against transformers' NemotronH, also when
the config asks for them), the one combined-loss helper on every output form, `from_config` and
`initialize_weights(buffer_device=...)`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from am_nemotron_helpers import VOCAB, assert_close_rel, hf_model, randomize_, tiny_hf_config, tokens
from transformers.modeling_outputs import CausalLMOutputWithPast

from am_models_nemotron import (
    NemotronHCausalLMOutputWithPast,
    NemotronHForCausalLM,
    NemotronStateDictAdapter,
    combined_causal_lm_loss,
    shift_labels,
)

RTOL = 1e-5  # fp32 parity with transformers (see test_model)


@pytest.fixture(scope="module")
def pair():
    hf = hf_model(tiny_hf_config("M*E-M"), seed=6)
    ours = NemotronHForCausalLM(hf.config, num_nextn_predict_layers=0).eval()
    ours.load_state_dict(NemotronStateDictAdapter(ours.config).from_hf(hf.state_dict()))
    return hf, ours


def _mtp_model() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    return randomize_(NemotronHForCausalLM(tiny_hf_config("ME*-", mtp_depths=2)), seed=7).train()


def _token_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum") / 50


def test_output_class_declares_the_mtp_fields() -> None:
    assert issubclass(NemotronHCausalLMOutputWithPast, CausalLMOutputWithPast)
    names = {f.name for f in dataclasses.fields(NemotronHCausalLMOutputWithPast)}
    assert {"loss", "logits", "past_key_values", "hidden_states", "attentions"} <= names
    assert {"mtp_per_depth_h", "mtp_loss", "mtp_loss_scaling_factor"} <= names
    out = _mtp_model()(tokens(2, 8), labels=tokens(2, 8))
    assert isinstance(out.mtp_per_depth_h, list)
    assert len(out.mtp_per_depth_h) == 2
    assert out.mtp_loss_scaling_factor == 0.1
    assert out.mtp_loss is not None


def test_hidden_states_follow_transformers(pair) -> None:
    """(embeddings, output of layers 0..L-2, final normed state): L + 1 tensors equal to transformers'."""
    hf, ours = pair
    ids = tokens(2, 13, seed=2)
    with torch.no_grad():
        expected = hf(ids, output_hidden_states=True, use_cache=False).hidden_states
        actual = ours(ids, output_hidden_states=True).hidden_states
    assert len(actual) == len(expected) == 6
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_close_rel(a, e, rtol=RTOL, what=f"hidden state {i}")
    with torch.no_grad():
        selected = ours(ids, output_hidden_states=[0, -1]).hidden_states
        hf_selected = hf(ids, output_hidden_states=[0, -1], use_cache=False).hidden_states
    assert [h is None for h in selected] == [h is None for h in hf_selected]
    assert_close_rel(selected[-1], expected[-1], rtol=RTOL, what="selected last")


def test_output_hidden_states_none_falls_back_to_the_config(pair) -> None:
    hf, ours = pair
    ids = tokens(1, 6)
    assert ours(ids).hidden_states is None
    ours.config.output_hidden_states = True
    try:
        with torch.no_grad():
            states = ours(ids).hidden_states
            assert ours(ids, output_hidden_states=False).hidden_states is None
            expected = hf(ids, use_cache=False).hidden_states  # the same config object: transformers follows it too
    finally:
        ours.config.output_hidden_states = False
    assert len(states) == len(expected) == 6


def test_return_dict_false_gives_transformers_tuple(pair) -> None:
    _hf, ours = pair
    ids = tokens(1, 7)
    with torch.no_grad():
        out = ours(ids, labels=ids)
        as_tuple = ours(ids, labels=ids, return_dict=False)
    assert isinstance(as_tuple, tuple)
    assert torch.equal(as_tuple[0], out.loss)
    assert torch.equal(as_tuple[1], out.logits)


def test_one_helper_for_every_output_form() -> None:
    """Unshifted labels (transformers), pre-shifted labels (the pipeline), the forward's output, a last pipeline
    stage's tuple and bare logits all give one combined loss; eval leaves MTP out unless compute_mtp_in_eval."""
    model = _mtp_model()
    ids = tokens(2, 11, seed=3)
    seq_idx = torch.tensor([[0] * 4 + [1] * 7, [0] * 11])
    out = model(ids, seq_idx=seq_idx)
    shifted = shift_labels(ids, 1, seq_idx=seq_idx)
    reference = combined_causal_lm_loss(
        out.logits, ids, mtp_per_depth_h=out.mtp_per_depth_h, lm_head=model.lm_head, seq_idx=seq_idx, loss_fn=_token_sum
    )
    assert reference.mtp_loss is not None
    assert len(reference.mtp_per_depth_losses) == 2
    assert_close_rel(reference.loss, reference.lm_loss + reference.mtp_loss, rtol=0, what="sum")
    forms = {
        "shifted labels": combined_causal_lm_loss(
            out.logits,
            shifted,
            mtp_per_depth_h=out.mtp_per_depth_h,
            lm_head=model.lm_head,
            seq_idx=seq_idx,
            loss_fn=_token_sum,
            labels_shifted=True,
        ).loss,
        "output": model.combined_loss(out, ids, loss_fn=_token_sum, seq_idx=seq_idx),
        "stage tuple": model.combined_loss(
            (out.logits, *out.mtp_per_depth_h, seq_idx.to(torch.int32)),
            shifted,
            loss_fn=_token_sum,
            labels_shifted=True,
        ),
    }
    for what, value in forms.items():
        assert_close_rel(value, reference.loss, rtol=1e-6, what=what)
    model.eval()
    try:
        no_mtp = model.combined_loss(out, ids, loss_fn=_token_sum, seq_idx=seq_idx)
        assert_close_rel(no_mtp, reference.lm_loss, rtol=0, what="eval: next-token only")
        assert_close_rel(model.combined_loss(out.logits, ids, loss_fn=_token_sum, seq_idx=seq_idx), no_mtp, rtol=0)
        model.compute_mtp_in_eval = True
        assert_close_rel(model.combined_loss(out, ids, loss_fn=_token_sum, seq_idx=seq_idx), reference.loss, rtol=0)
    finally:
        model.compute_mtp_in_eval = False
        model.train()
    # Another ignore_index: the default loss functions honour it (masked labels count as with -100).
    masked = shift_labels(ids, 1, seq_idx=seq_idx).masked_fill(ids % 3 == 0, -100)
    default = model.combined_loss(out, masked, labels_shifted=True, seq_idx=seq_idx)
    other = model.combined_loss(
        out, masked.masked_fill(masked == -100, -1), labels_shifted=True, seq_idx=seq_idx, ignore_index=-1
    )
    assert_close_rel(other, default, rtol=1e-6, what="ignore_index=-1")
    with pytest.raises(ValueError, match="need lm_head"):
        combined_causal_lm_loss(out.logits, ids, mtp_per_depth_h=out.mtp_per_depth_h)
    with pytest.raises(ValueError, match="got 1 target tensors"):
        combined_causal_lm_loss(
            out.logits, ids, mtp_per_depth_h=out.mtp_per_depth_h, lm_head=model.lm_head, mtp_per_depth_targets=[ids]
        )


def test_from_config_and_initialize_weights_on_a_buffer_device() -> None:
    config = tiny_hf_config("ME*", mtp_depths=1)
    model = NemotronHForCausalLM.from_config(config, None, num_nextn_predict_layers=0)
    assert model.mtp is None
    assert model.backend.attn == "sdpa"
    meta = NemotronHForCausalLM(config, device="meta")
    meta.to_empty(device="cpu")
    bias = meta.model.layers["1"].mixer.gate.e_score_correction_bias
    bias.fill_(float("nan"))  # what to_empty may leave behind
    meta.initialize_weights(buffer_device="cpu")
    assert torch.equal(meta.model.layers["1"].mixer.gate.e_score_correction_bias, torch.zeros(6))
    assert meta.model.layers["1"].mixer.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.isfinite(meta(tokens(1, 5)).logits).all()
    meta.initialize_weights(None, torch.bfloat16)  # upstream's positional order (buffer_device, dtype)
    assert meta.lm_head.weight.dtype == torch.bfloat16
    assert meta.model.layers["0"].mixer.A_log.dtype == torch.float32
    assert meta(tokens(1, 5)).logits.shape == (1, 5, VOCAB)


def test_prepared_shifted_labels_keep_the_last_target_as_the_loss_does() -> None:
    """`prepare_batch_for_cp(batch, labels_shifted=True)` gives the targets `combined_loss(..., labels_shifted=True)`
    uses off CP: the last position keeps the caller's label (the token after the row, e.g. a trainer's window),
    positions whose next token is padding are ignored, and MTP depth k ignores the last k + 1 positions."""
    from am_models_nemotron.cp import prepare_batch_for_cp

    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    labels = torch.tensor([[6, 7, 8, 9, 10, 42], [12, 13, 14, 15, 0, 0]])
    attention_mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    prepared = prepare_batch_for_cp(
        {"input_ids": ids, "labels": labels, "attention_mask": attention_mask}, mtp_depths=1, labels_shifted=True
    )
    assert prepared["labels"].tolist() == [[6, 7, 8, 9, 10, 42], [12, 13, 14, -100, -100, -100]]
    mtp_targets = prepared["mtp_per_depth_targets"][:, 0].tolist()
    assert mtp_targets == [[7, 8, 9, 10, 42, -100], [13, 14, -100, -100, -100, -100]]
    unpadded = prepare_batch_for_cp({"input_ids": ids[:1], "labels": labels[:1]}, mtp_depths=0, labels_shifted=True)
    assert torch.equal(unpadded["labels"], labels[:1])
