"""Issue 25 at the model level: Gemma 4's (empty) balancing recipe, the aux losses and z-loss of am-moe on its
softmax router, the refused bias update, and the BackendConfig routing fields (fake balanced gate, gate_precision)."""

from __future__ import annotations

import pytest
import torch
from _g4_configs import text_config

from am_models_gemma4 import Gemma4ForCausalLM, Gemma4MoE, apply_routing_backend
from am_moe import (
    LoadBalancing,
    aux_loss_values,
    configure_load_balancing,
    router_z_loss,
    set_aux_loss_scale,
    switch_aux_loss,
)
from am_precision import BackendConfig


def _moe() -> Gemma4MoE:
    torch.manual_seed(0)
    moe = Gemma4MoE(text_config(moe=True))
    with torch.no_grad():
        moe.router.proj.weight.normal_()
    return moe


def test_recipe_is_off_and_a_bias_update_is_refused() -> None:
    assert Gemma4ForCausalLM.moe_load_balancing == LoadBalancing()
    model = Gemma4ForCausalLM(text_config(moe=True))
    with pytest.raises(ValueError, match="selection bias"):
        configure_load_balancing(model, LoadBalancing(bias_update_rate=1e-3))
    assert configure_load_balancing(model, LoadBalancing(aux_loss_coeff=1e-2)) > 0


def test_aux_and_z_loss_reach_the_router_as_the_explicit_objective() -> None:
    moe = _moe()
    configure_load_balancing(moe, LoadBalancing(aux_loss_coeff=0.2, z_loss_coeff=0.05))
    hidden = moe.router.proj.weight.shape[1]
    x = torch.randn(2, 6, hidden, generator=torch.Generator().manual_seed(1))
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, 4:] = True
    set_aux_loss_scale(moe, 0.5)
    moe(x, router_input=x, padding_mask=padding).sum().backward()
    injected = moe.router.proj.weight.grad.clone()
    reported = aux_loss_values(moe, reset=True)
    configure_load_balancing(moe, LoadBalancing())
    moe.zero_grad()
    out = moe(x, router_input=x, padding_mask=padding).sum()
    _, indices, logits, probs = moe.router.route(x.reshape(-1, hidden))
    real = ~padding.reshape(-1)
    aux = switch_aux_loss(probs, indices, token_mask=real, reduction="sum")
    z = router_z_loss(logits, token_mask=real, reduction="sum")
    (out + 0.5 * (0.2 * aux + 0.05 * z)).backward()
    torch.testing.assert_close(injected, moe.router.proj.weight.grad, atol=1e-6, rtol=1e-5)
    assert reported["aux_loss"] == pytest.approx(0.2 * aux.item(), rel=1e-6)
    assert reported["z_loss"] == pytest.approx(0.05 * z.item(), rel=1e-6)


def test_backend_routing_fields_are_honoured() -> None:
    moe = _moe()
    hidden = moe.router.proj.weight.shape[1]
    experts = moe.router.num_experts
    assert apply_routing_backend(moe, BackendConfig(fake_balanced_gate=True)) == 1
    x = torch.randn(experts, 3, hidden)  # E*3 tokens x top-k pairs: divisible by E
    moe(x, router_input=x)
    counts = moe.experts.tokens_per_expert
    assert counts.min() == counts.max()
    apply_routing_backend(moe, BackendConfig(gate_precision="bfloat16"))
    weights, _ = moe.router(torch.randn(4, hidden))
    assert weights.dtype == torch.bfloat16
    apply_routing_backend(moe, BackendConfig())  # gate_precision None: back to fp32, real router
    weights, _ = moe.router(torch.randn(4, hidden))
    assert weights.dtype == torch.float32
