"""Issue 25 at the model level: Nemotron-H's balancing recipe wired to am-moe's mechanisms (bias update on
`gate.e_score_correction_bias`, sequence-level aux loss reaching the router), the fake balanced gate and
`gate_precision` from the BackendConfig."""

from __future__ import annotations

import pytest
import torch
from am_nemotron_helpers import tiny_hf_config

from am_models_nemotron import NemotronConfig, NemotronHForCausalLM, NemotronMoE, default_backend
from am_moe import (
    LoadBalancing,
    configure_load_balancing,
    expert_load,
    sequence_aux_loss,
    set_aux_loss_scale,
    update_expert_bias,
)

FP32_TOL = 1e-6


def _moe(**backend_fields) -> NemotronMoE:
    cfg = NemotronConfig.from_any(tiny_hf_config("E"))
    torch.manual_seed(0)
    moe = NemotronMoE(cfg, backend=default_backend().replace(**backend_fields))
    moe.init_weights()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.5)
    return moe


def test_recipe_is_megatrons_and_layers_start_with_balancing_off() -> None:
    assert NemotronHForCausalLM.moe_load_balancing == LoadBalancing(bias_update_rate=1e-3, seq_aux_loss_coeff=1e-4)
    moe = _moe()
    assert moe.balancer.balancing == LoadBalancing()
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.gate.gate_precision == torch.float32  # router math in fp32 by default


def test_bias_update_moves_e_score_correction_bias_from_the_layers_load() -> None:
    model = NemotronHForCausalLM(tiny_hf_config("*E-E"), backend=default_backend())
    assert configure_load_balancing(model, NemotronHForCausalLM.moe_load_balancing) == 2
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids)
    load = expert_load(model, reset=True)
    deltas = update_expert_bias(model, load)
    assert len(deltas) == 2
    for name, delta in deltas.items():
        layer = name.removesuffix(".gate.e_score_correction_bias")
        counts = load.tokens_per_expert[f"{layer}.experts"].double()
        assert torch.equal(delta, (1e-3 * torch.sign(counts.mean() - counts)).float())
        assert torch.equal(model.get_buffer(name), delta)  # started at 0, fp32
        assert name in model.state_dict()


def test_seq_aux_loss_reaches_the_router_with_the_explicit_objectives_gradient() -> None:
    moe = _moe()
    configure_load_balancing(moe, LoadBalancing(seq_aux_loss_coeff=0.5))
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True
    real = ~padding.reshape(-1)
    set_aux_loss_scale(moe, 1.0)
    moe(x, padding_mask=padding).sum().backward()
    injected = moe.gate.weight.grad.clone()
    # the same objective written out: main output + 0.5 * token-summed sequence term over real tokens
    configure_load_balancing(moe, LoadBalancing())
    moe.zero_grad()
    out = moe(x, padding_mask=padding).sum()
    tokens = x.reshape(-1, 32)[real]
    _, indices, _, scores = moe.gate.route(tokens)
    rows = torch.arange(3).repeat_interleave(5)[real]
    aux = sequence_aux_loss(
        scores / scores.sum(-1, keepdim=True), indices, sequence_ids=rows, num_sequences=3, reduction="sum"
    )
    (out + 0.5 * aux).backward()
    torch.testing.assert_close(injected, moe.gate.weight.grad, atol=FP32_TOL, rtol=1e-5)
    assert not torch.equal(injected, torch.zeros_like(injected))


def test_fake_balanced_gate_spreads_tokens_evenly_and_gate_precision_is_honoured() -> None:
    moe = _moe(fake_balanced_gate=True)
    x = torch.randn(2, 6, 32)
    moe(x)
    counts = moe.experts.tokens_per_expert  # 12 tokens x top-2 over 6 experts: exactly 4 each
    assert counts.tolist() == [4] * 6
    noisy = _moe(fake_balanced_gate=True, fake_gate_noise=2.0)
    noisy(x)
    assert int(noisy.experts.tokens_per_expert.sum()) == 24
    bf16 = _moe(gate_precision="bfloat16")
    weights, _ = bf16.gate(torch.randn(4, 32))
    assert weights.dtype == torch.bfloat16


def test_balancing_on_a_model_without_bias_or_moe_is_refused() -> None:
    dense = NemotronHForCausalLM(tiny_hf_config("*-"), backend=default_backend())
    with pytest.raises(ValueError, match="no MoE router"):
        configure_load_balancing(dense, NemotronHForCausalLM.moe_load_balancing)
    assert configure_load_balancing(dense, LoadBalancing()) == 0
