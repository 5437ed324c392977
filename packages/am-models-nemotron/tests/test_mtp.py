"""Multi-token prediction: label shifting (depth k predicts t + k + 2, never across documents), the per-depth hidden
states against a hand-built reference, the loss, repeated layers and checkpoint naming."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from am_nemotron_helpers import assert_close_rel, randomize_, tiny_hf_config, tokens

from am_models_nemotron import (
    NemotronHForCausalLM,
    NemotronStateDictAdapter,
    combined_causal_lm_loss,
    roll_tensor,
    shift_labels,
)

IGN = -100
FP32_TOL = 1e-6


def _model(depths: int = 2, **kwargs) -> NemotronHForCausalLM:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_hf_config("ME*-", mtp_depths=depths, mtp_pattern="*E"), **kwargs)
    return randomize_(model, seed=4).train()


def test_roll_tensor_fills_the_wrapped_slice() -> None:
    t = torch.tensor([[10, 11, 12, 13]])
    assert roll_tensor(t, -1).tolist() == [[11, 12, 13, 0]]
    assert roll_tensor(roll_tensor(t, -1), -1).tolist() == [[12, 13, 0, 0]]
    assert roll_tensor(t, 1).tolist() == [[0, 10, 11, 12]]
    assert roll_tensor(t, 0) is t


def test_shift_labels_masks_sequence_ends_and_document_boundaries() -> None:
    labels = torch.arange(1, 9)[None]
    seq_idx = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    assert shift_labels(labels, 1, seq_idx=seq_idx).tolist() == [[2, 3, 4, IGN, 6, 7, 8, IGN]]
    assert shift_labels(labels, 2, seq_idx=seq_idx).tolist() == [[3, 4, IGN, IGN, 7, 8, IGN, IGN]]
    assert shift_labels(labels, 9).tolist() == [[IGN] * 8]


def test_training_forward_emits_depth_states_equal_to_a_hand_built_reference() -> None:
    model = _model()
    ids = tokens(2, 14)
    out = model(ids)
    assert out.mtp_per_depth_h is not None
    assert len(out.mtp_per_depth_h) == 2
    hidden = model.model(ids)
    mtp = model.mtp
    for depth in range(2):
        first, second = mtp.layers[2 * depth], mtp.layers[2 * depth + 1]
        assert first.eh_proj is not None
        assert first.final_layernorm is None
        assert second.eh_proj is None
        assert second.final_layernorm is not None
        embed = model.model.embed_tokens(torch.cat([ids[:, depth + 1 :], ids.new_zeros(2, depth + 1)], dim=1))
        fused = F.linear(torch.cat([first.enorm(embed), first.hnorm(hidden)], dim=-1), first.eh_proj.weight)
        after_attention = fused + first.mixer(first.norm(fused))
        after_moe = after_attention + second.mixer(second.norm(after_attention))
        hidden = second.final_layernorm(after_moe)
        assert_close_rel(out.mtp_per_depth_h[depth], hidden, rtol=FP32_TOL, what=f"depth {depth}")


def test_loss_is_next_token_only_and_the_combined_loss_adds_the_scaled_mean_depth_loss() -> None:
    """`loss` is the next-token cross entropy (as upstream and transformers); `mtp_loss` is reported apart and
    `combined_loss` / `combined_causal_lm_loss` add it once."""
    model = _model(mtp_loss_scaling_factor=0.3)
    ids = tokens(2, 12, seed=2)
    labels = ids.clone()
    labels[1, 4] = IGN
    out = model(ids, labels=labels)
    main = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), labels[:, 1:].reshape(-1))
    depth_losses = []
    for depth, h in enumerate(out.mtp_per_depth_h):
        logits = model.lm_head(h)
        terms = [
            F.cross_entropy(logits[b, t], labels[b, t + depth + 2], reduction="sum")
            for b in range(2)
            for t in range(12 - depth - 2)
            if labels[b, t + depth + 2] != IGN
        ]
        depth_losses.append(torch.stack(terms).mean())
    expected_mtp = 0.3 * sum(depth_losses) / 2
    assert_close_rel(out.mtp_loss, expected_mtp, rtol=FP32_TOL, what="mtp loss")
    assert_close_rel(out.loss, main, rtol=FP32_TOL, what="next-token loss")
    combined = model.combined_loss(out, labels)
    assert_close_rel(combined, main + expected_mtp, rtol=FP32_TOL, what="combined loss")
    helper = combined_causal_lm_loss(
        out.logits, labels, mtp_per_depth_h=out.mtp_per_depth_h, lm_head=model.lm_head, mtp_loss_scaling_factor=0.3
    )
    assert_close_rel(helper.loss, combined, rtol=0, what="helper")
    assert_close_rel(helper.mtp_loss, out.mtp_loss, rtol=0, what="helper mtp")
    combined.backward()
    assert all(p.grad is not None for p in model.mtp.parameters())


def test_eval_and_cached_decoding_skip_mtp_unless_asked() -> None:
    model = _model().eval()
    ids = tokens(1, 8)
    assert model(ids).mtp_per_depth_h is None
    model.compute_mtp_in_eval = True
    assert len(model(ids).mtp_per_depth_h) == 2
    assert model(ids, use_cache=True).mtp_per_depth_h is None


def test_repeated_layer_shares_one_physical_depth() -> None:
    model = _model(depths=3, mtp_use_repeated_layer=True)
    assert len(model.mtp.layers) == 2
    out = model(tokens(1, 10))
    assert len(out.mtp_per_depth_h) == 3
    assert not torch.equal(out.mtp_per_depth_h[0], out.mtp_per_depth_h[1])


def test_constructor_override_disables_mtp_and_absent_fields_mean_none() -> None:
    assert _model(num_nextn_predict_layers=0).mtp is None
    assert NemotronHForCausalLM(tiny_hf_config("M*")).mtp is None


def test_checkpoint_names_follow_nvidia_layout() -> None:
    model = _model()
    hf_names = NemotronStateDictAdapter(model.config).to_hf(model.state_dict())
    for name in (
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.hnorm.weight",
        "mtp.layers.1.final_layernorm.weight",
        "mtp.layers.1.mixer.experts.5.up_proj.weight",
        "mtp.layers.3.mixer.gate.e_score_correction_bias",
    ):
        assert name in hf_names, name
    back = NemotronStateDictAdapter(model.config).from_hf(hf_names)
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("bad", [3, 1])
def test_wrong_number_of_depth_embeddings_is_rejected(bad: int) -> None:
    model = _model()
    with pytest.raises(ValueError, match="2 depths"):
        model.mtp(torch.randn(1, 4, 32), embed_inputs=[torch.randn(1, 4, 32)] * bad)
