"""MoE block: router math, GeGLU experts, padding exclusion, and the fp32 router contract under bf16 storage."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _g4_configs import text_config
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

from am_models_gemma4 import Gemma4Experts, Gemma4ForCausalLM, Gemma4MoE, Gemma4Router
from am_precision import assert_fp32_contract, cast_model_to_dtype


def _router(seed: int = 0) -> Gemma4Router:
    torch.manual_seed(seed)
    router = Gemma4Router(text_config(moe=True))
    with torch.no_grad():
        router.proj.weight.normal_()
        router.scale.uniform_(0.5, 1.5)
        router.per_expert_scale.uniform_(0.5, 1.5)
    return router


def test_router_follows_the_gemma4_formula() -> None:
    """RMSNorm without scale · scale · H^-0.5 → linear → softmax over all E → top-k → renormalize → per-expert scale."""
    router = _router()
    x = torch.randn(10, 32, dtype=torch.float64).float()
    weights, indices = router(x)
    normed = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    probs = torch.softmax((normed * router.scale.double() * 32**-0.5) @ router.proj.weight.double().T, dim=-1)
    top, expected_indices = probs.topk(2, dim=-1)
    expected = top / top.sum(-1, keepdim=True) * router.per_expert_scale.double()[expected_indices]
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=1e-7)
    assert weights.dtype == torch.float32


def test_router_and_experts_match_transformers_modules() -> None:
    config = text_config(moe=True)
    torch.manual_seed(0)
    hf_router, hf_experts = Gemma4TextRouter(config), Gemma4TextExperts(config)
    with torch.no_grad():
        hf_router.proj.weight.normal_()
        hf_router.scale.uniform_(0.5, 1.5)
        hf_router.per_expert_scale.uniform_(0.5, 1.5)
        hf_experts.gate_up_proj.normal_(std=0.1)
        hf_experts.down_proj.normal_(std=0.1)
    ours = Gemma4MoE(config)
    ours.router.load_state_dict(hf_router.state_dict())
    ours.experts.load_state_dict(hf_experts.state_dict())  # the same names and [E, out, in] layout, no transpose
    residual, normed = torch.randn(3, 5, 32), torch.randn(3, 5, 32)
    _, hf_weights, hf_indices = hf_router(residual.reshape(-1, 32))
    expected = hf_experts(normed.reshape(-1, 32), hf_indices, hf_weights).reshape(3, 5, 32)
    torch.testing.assert_close(ours(normed, router_input=residual), expected, rtol=1e-5, atol=1e-6)


def test_experts_equal_a_per_token_loop() -> None:
    torch.manual_seed(1)
    experts = Gemma4Experts(text_config(moe=True))
    x = torch.randn(9, 32)
    indices = torch.randint(0, 4, (9, 2))
    weights = torch.rand(9, 2)
    out = experts(x, indices, weights)
    for t in range(9):
        want = torch.zeros(32)
        for slot in range(2):
            e = int(indices[t, slot])
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            want += weights[t, slot] * (experts.down_proj[e] @ (F.gelu(gate, approximate="tanh") * up))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-6)


def test_padding_tokens_are_not_routed_and_do_not_change_real_tokens() -> None:
    torch.manual_seed(2)
    moe = Gemma4MoE(text_config(moe=True))
    x = torch.randn(1, 6, 32)
    padded = torch.cat([x, 100 * torch.randn(1, 3, 32)], dim=1)
    padding_mask = torch.tensor([[False] * 6 + [True] * 3])
    out = moe(padded, router_input=padded, padding_mask=padding_mask)
    torch.testing.assert_close(out[:, :6], moe(x, router_input=x), rtol=0, atol=0)
    assert torch.count_nonzero(out[:, 6:]) == 0


def test_bf16_cast_keeps_router_fp32_and_routes_in_fp32() -> None:
    torch.manual_seed(3)
    model = Gemma4ForCausalLM(text_config(moe=True))
    cast_model_to_dtype(model, torch.bfloat16)
    assert_fp32_contract(model, storage_dtype=torch.bfloat16)
    router = model.model.layers["0"].moe.router
    assert {p.dtype for p in router.parameters()} == {torch.float32}
    assert model.model.layers["0"].moe.experts.gate_up_proj.dtype == torch.bfloat16
    assert model.model.rotary_emb.full_attention_inv_freq.dtype == torch.float32
    x = torch.randn(7, 32).to(torch.bfloat16)
    weights, indices = router(x)
    reference = Gemma4Router(text_config(moe=True))
    reference.load_state_dict(router.state_dict())
    ref_weights, ref_indices = reference(x.float())
    assert weights.dtype == torch.float32
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=0)
    logits = model(input_ids=torch.randint(1, 100, (1, 8))).logits
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits.float()).all()
