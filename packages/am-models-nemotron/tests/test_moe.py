"""MoE routing and experts against a straightforward per-token reference; padding never takes part in routing."""

from __future__ import annotations

import torch
from am_nemotron_helpers import assert_close_rel, tiny_hf_config

from am_models_nemotron import NemotronConfig, NemotronMoE, default_backend, relu2

FP32_TOL = 1e-6


def _moe(**overrides) -> NemotronMoE:
    cfg = NemotronConfig.from_any(tiny_hf_config("E", **overrides))
    torch.manual_seed(0)
    moe = NemotronMoE(cfg, backend=default_backend())
    moe.init_weights()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.5)
        moe.gate.e_score_correction_bias.normal_(0, 0.2)
    return moe


def _reference_route(moe: NemotronMoE, x: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Per token, in plain Python: sigmoid scores, biased choice, best topk_group groups by top-2 sum, top-k."""
    gate = moe.gate
    scores = torch.sigmoid(x.double() @ gate.weight.double().T)
    choice = scores + gate.e_score_correction_bias.double()
    per_group = gate.num_experts // gate.n_group
    all_idx, all_w = [], []
    for t in range(x.shape[0]):
        group_score = [
            sorted(choice[t, g * per_group : (g + 1) * per_group].tolist())[-2:] for g in range(gate.n_group)
        ]
        ranked_groups = sorted(range(gate.n_group), key=lambda g: -sum(group_score[g]))[: gate.topk_group]
        allowed = [e for e in range(gate.num_experts) if e // per_group in ranked_groups]
        chosen = sorted(allowed, key=lambda e: -choice[t, e].item())[: gate.top_k]
        weights = [scores[t, e].item() for e in chosen]
        total = sum(weights)
        all_idx.append(chosen)
        all_w.append([w / total * gate.routed_scaling_factor for w in weights])
    return all_idx, all_w


def test_router_matches_per_token_reference() -> None:
    moe = _moe()
    x = torch.randn(40, 32)
    weights, indices = moe.gate(x)
    ref_idx, ref_w = _reference_route(moe, x)
    for t in range(40):
        order = torch.argsort(indices[t])
        assert indices[t][order].tolist() == sorted(ref_idx[t])
        expected = torch.tensor([w for _, w in sorted(zip(ref_idx[t], ref_w[t], strict=True))])
        assert torch.allclose(weights[t][order].double(), expected.double(), atol=1e-6)
    assert weights.dtype == torch.float32


def test_correction_bias_selects_but_does_not_weight() -> None:
    moe = _moe(n_group=1, topk_group=1)
    x = torch.randn(8, 32)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[5] = 10.0  # forces expert 5 into every top-k
    weights, indices = moe.gate(x)
    assert (indices == 5).any(dim=1).all()
    scores = torch.sigmoid(x @ moe.gate.weight.T)
    picked = scores.gather(1, indices)
    assert_close_rel(weights, picked / picked.sum(-1, keepdim=True) * 1.5, rtol=FP32_TOL, what="unbiased weights")


def test_experts_equal_a_per_token_loop_with_shared_expert() -> None:
    moe = _moe(moe_latent_size=12)
    x = torch.randn(2, 7, 32)
    out = moe(x)
    flat = x.reshape(-1, 32)
    weights, indices = moe.gate(flat)
    expected = []
    for t in range(flat.shape[0]):
        latent = moe.fc1_latent_proj(flat[t])
        routed = sum(
            weights[t, k] * (moe.experts.down_proj[e] @ relu2(moe.experts.up_proj[e] @ latent))
            for k, e in enumerate(indices[t].tolist())
        )
        expected.append(moe.fc2_latent_proj(routed) + moe.shared_experts(flat[t]))
    assert_close_rel(out, torch.stack(expected).view_as(out), rtol=FP32_TOL, what="moe output")


def test_padding_tokens_get_no_expert_and_do_not_change_real_tokens() -> None:
    moe = _moe()
    x = torch.randn(2, 9, 32)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, :3] = True  # left padding
    padding[1, 7:] = True  # right padding
    out_masked = moe(x, padding_mask=padding)
    out_plain = moe(x)
    real = ~padding
    # Same values up to matmul blocking (a different number of rows goes through each expert).
    assert_close_rel(out_masked[real], out_plain[real], rtol=FP32_TOL, what="real tokens")
    # A padded token's routed contribution is zero: only the shared expert remains.
    assert_close_rel(out_masked[padding], moe.shared_experts(x[padding]), rtol=FP32_TOL, what="pad = shared only")
    # Real tokens' routing is independent of what sits in the padded slots.
    x_other = x.clone()
    x_other[padding] = torch.randn(int(padding.sum()), 32) * 100
    assert torch.equal(moe(x_other, padding_mask=padding)[real], out_masked[real])
    _weights, indices = moe.gate(x[real])
    _weights_all, indices_all = moe.gate(x.reshape(-1, 32))
    assert torch.equal(indices, indices_all[real.reshape(-1)])


def test_moe_rejects_unsupported_backends() -> None:
    cfg = NemotronConfig.from_any(tiny_hf_config("E"))
    import pytest

    with pytest.raises(ValueError, match="experts='te'"):
        NemotronMoE(cfg, backend=default_backend().replace(experts="te", dispatcher="deepep"))
