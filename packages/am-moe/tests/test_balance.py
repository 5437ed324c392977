"""Load balancing: the aux terms against textbook references, their gradients reaching the router through the
`RouterBalancer` injection (also under gradient accumulation and activation checkpointing), the bias update, and
the behaviour that matters: from a deliberately skewed router the imbalance falls with balancing on, not off."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from am_moe import (
    GroupedExperts,
    LoadBalancing,
    RouterBalancer,
    aux_loss_values,
    balanced_routing,
    configure_load_balancing,
    expert_load,
    reset_expert_load,
    router_z_loss,
    sequence_aux_loss,
    set_aux_loss_scale,
    switch_aux_loss,
    update_expert_bias,
)

# fp32 sums over a few dozen tokens, reordered against the reference loops.
TOL = 1e-6
H, E, K = 8, 4, 2


def _reference_switch(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """E / K * sum_i f_i P_i, written with loops (independent of am_moe)."""
    tokens = probs.shape[0]
    total = torch.zeros(())
    for expert in range(probs.shape[1]):
        f = (index == expert).sum() / tokens
        total = total + f * probs[:, expert].mean()
    return probs.shape[1] / index.shape[1] * total


def test_switch_aux_loss_matches_the_textbook_form_and_is_one_when_balanced() -> None:
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(13, E, generator=gen), -1)
    index = probs.topk(K, -1).indices
    torch.testing.assert_close(switch_aux_loss(probs, index), _reference_switch(probs, index), atol=TOL, rtol=0)
    uniform = torch.full((8, E), 1 / E)
    _, balanced = balanced_routing(8, E, K)
    assert switch_aux_loss(uniform, balanced).item() == pytest.approx(1.0)
    # padding is excluded: the masked call equals the call on the real tokens only
    mask = torch.rand(13, generator=gen) > 0.3
    torch.testing.assert_close(
        switch_aux_loss(probs, index, token_mask=mask), switch_aux_loss(probs[mask], index[mask]), atol=TOL, rtol=0
    )
    # "sum" is the mean times the real tokens
    torch.testing.assert_close(
        switch_aux_loss(probs, index, token_mask=mask, reduction="sum"),
        switch_aux_loss(probs[mask], index[mask]) * mask.sum(),
        atol=TOL,
        rtol=0,
    )


def test_sequence_aux_loss_is_the_mean_of_per_sequence_losses() -> None:
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(3 * 7, E, generator=gen), -1)
    index = probs.topk(K, -1).indices
    ids = torch.arange(3).repeat_interleave(7)
    per_sequence = [_reference_switch(probs[ids == s], index[ids == s]) for s in range(3)]
    got = sequence_aux_loss(probs, index, sequence_ids=ids, num_sequences=3)
    torch.testing.assert_close(got, torch.stack(per_sequence).mean(), atol=TOL, rtol=0)
    # padding: each sequence's loss over its real tokens, weighted by their count
    mask = torch.rand(21, generator=gen) > 0.3
    mask[0] = True
    parts = [
        (_reference_switch(probs[(ids == s) & mask], index[(ids == s) & mask]), ((ids == s) & mask).sum())
        for s in range(3)
    ]
    expected = sum(loss * n for loss, n in parts) / mask.sum()
    torch.testing.assert_close(
        sequence_aux_loss(probs, index, sequence_ids=ids, num_sequences=3, token_mask=mask), expected, atol=TOL, rtol=0
    )


def test_router_z_loss() -> None:
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(2))
    expected = torch.stack([torch.log(torch.exp(row).sum()) ** 2 for row in logits]).mean()
    torch.testing.assert_close(router_z_loss(logits), expected, atol=TOL, rtol=0)
    mask = torch.tensor([True] * 5 + [False] * 4)
    torch.testing.assert_close(router_z_loss(logits, token_mask=mask), router_z_loss(logits[:5]), atol=TOL, rtol=0)


def test_bad_coefficients_are_refused_in_one_error() -> None:
    with pytest.raises(ValueError, match="LoadBalancing") as info:
        LoadBalancing(bias_update_rate=-1e-3, aux_loss_coeff=math.inf, seq_aux_loss_coeff=math.nan, z_loss_coeff=True)
    message = str(info.value)
    for name in ("bias_update_rate", "aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff"):
        assert name in message
    with pytest.raises(ValueError, match="scale"):
        set_aux_loss_scale(nn.Module(), -1.0)
    with pytest.raises(ValueError, match="noise"):
        balanced_routing(4, E, K, noise=-0.5)


def test_balanced_routing_gives_every_expert_the_same_count_or_one_more() -> None:
    for tokens, experts, top_k in ((8, 4, 2), (7, 4, 3), (5, 8, 1), (0, 4, 2)):
        _, index = balanced_routing(tokens, experts, top_k)
        counts = torch.bincount(index.flatten(), minlength=experts)
        assert counts.max() - counts.min() <= 1
        if (tokens * top_k) % experts == 0:
            assert counts.min() == counts.max()
        for row in index:
            assert len(set(row.tolist())) == top_k  # distinct experts per token


# ---------------------------------------------------------------------------------------------- a tiny MoE layer
class SkewedMoE(nn.Module):
    """Sigmoid router (DeepSeek-V3 / Nemotron form) with an fp32 selection bias, grouped experts and a balancer."""

    router_bias: torch.Tensor

    def __init__(self, *, seed: int = 0, skew: float = 3.0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.router = nn.Linear(H, E)
        with torch.no_grad():
            self.router.bias.zero_()
            self.router.bias[0] = skew  # deliberately skewed: expert 0 wins almost every token
        self.register_buffer("router_bias", torch.zeros(E, dtype=torch.float32))
        self.experts = GroupedExperts(E, H, 16, gated=True, activation="silu", grouped_mm="loop")
        self.experts.init_weights(std=0.2)
        self.balancer = RouterBalancer(bias_name="router_bias")

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, S, H] -> [B, S, H]; mask [B, S] True = real token."""
        flat = x.reshape(-1, H)
        logits = self.router(flat)
        scores = logits.sigmoid()
        index = (scores + self.router_bias).topk(K, -1).indices  # the bias changes selection only
        weights = scores.gather(1, index)
        token_mask = None if mask is None else mask.reshape(-1)
        out = self.experts(flat, index, weights, token_mask=token_mask)
        ids = torch.arange(x.shape[0]).repeat_interleave(x.shape[1])
        out = self.balancer(
            out,
            probs=scores / scores.sum(-1, keepdim=True),
            logits=logits,
            top_k_index=index,
            sequence_ids=ids,
            num_sequences=x.shape[0],
            token_mask=token_mask,
        )
        return out.view_as(x)


def _train(balancing: LoadBalancing, *, steps: int = 40) -> list[float]:
    """Train SkewedMoE on a fixed regression task; the global max/mean load of each step."""
    model = SkewedMoE()
    configure_load_balancing(model, balancing)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(5)
    imbalance = []
    for _ in range(steps):
        x = torch.randn(4, 16, H, generator=gen)
        set_aux_loss_scale(model, 1 / x[..., 0].numel())
        loss = F.mse_loss(model(x), torch.zeros_like(x), reduction="sum") / x[..., 0].numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        load = expert_load(model, reset=True)
        imbalance.append(load.max_over_mean()["experts"])
        update_expert_bias(model, load)
    return imbalance


def test_skewed_router_imbalance_falls_with_bias_update_and_not_without() -> None:
    off = _train(LoadBalancing())
    on = _train(LoadBalancing(bias_update_rate=0.02))
    assert off[0] == on[0] == 2.0  # the same start: expert 0 in every token's top-2 (2 = E / K, the worst)
    assert min(off[-10:]) > 1.9, off  # without balancing the skew stays
    # with the bias update it falls towards 1 (64 tokens a step: the sign rule keeps it within a few pairs)
    last = on[-10:]
    assert sum(last) / len(last) < 1.35, on
    assert max(last) < 1.6, on


def test_skewed_router_imbalance_falls_with_aux_loss() -> None:
    """The aux losses move the router's parameters (the skewed sigmoid is saturated, so the toy needs a large
    coefficient to move within 30 SGD steps)."""
    on = _train(LoadBalancing(seq_aux_loss_coeff=30.0, aux_loss_coeff=30.0), steps=30)
    assert on[0] == 2.0
    last = on[-10:]
    assert sum(last) / len(last) < 1.5, on


def test_bias_update_is_the_sign_rule_in_fp32_and_changes_selection_only() -> None:
    model = SkewedMoE(skew=0.0)
    configure_load_balancing(model, LoadBalancing(bias_update_rate=1e-3))
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    out_before = model(x)
    load = expert_load(model, reset=True)
    counts = load.tokens_per_expert["experts"].double()
    deltas = update_expert_bias(model, load)
    expected = (1e-3 * torch.sign(counts.mean() - counts)).float()
    assert torch.equal(deltas["router_bias"], expected)
    assert model.router_bias.dtype == torch.float32
    assert torch.equal(model.router_bias, expected)
    assert "router_bias" in model.state_dict()  # checkpointed, so a resumed run continues from it
    # combine weights are the unbiased scores: with the bias set so selection does not change, the output does not
    with torch.no_grad():
        model.router_bias.fill_(0.25)  # the same shift for every expert: same top-k
    torch.testing.assert_close(model(x), out_before, atol=0, rtol=0)


def _router_grads(model: SkewedMoE, batches: list[tuple[torch.Tensor, torch.Tensor]], total: int) -> torch.Tensor:
    model.zero_grad()
    set_aux_loss_scale(model, 1 / total)
    for x, mask in batches:
        out = model(x, mask=mask)
        (out * mask[..., None]).sum().div(total).backward()
    grad = model.router.weight.grad
    assert grad is not None
    return grad.clone()


def test_aux_gradient_reaches_the_router_and_accumulation_equals_one_pass() -> None:
    """Sequence-level and z terms decompose over micro-batches exactly: two micro-batches with the trainer's
    normalisation (1 / all real tokens) give the router the gradient of one pass over both."""
    balancing = LoadBalancing(seq_aux_loss_coeff=0.3, z_loss_coeff=0.01)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 6, H, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.2
    total = int(mask.sum())
    model = SkewedMoE(skew=1.0)
    configure_load_balancing(model, balancing)
    one_pass = _router_grads(model, [(x, mask)], total)
    values_one = aux_loss_values(model, normalizer=total, reset=True)
    accumulated = _router_grads(model, [(x[:2], mask[:2]), (x[2:], mask[2:])], total)
    values_acc = aux_loss_values(model, normalizer=total, reset=True)
    torch.testing.assert_close(accumulated, one_pass, atol=1e-6, rtol=1e-5)
    assert values_acc == pytest.approx(values_one, rel=1e-6)
    # the injected gradient is exactly the explicit objective's
    configure_load_balancing(model, LoadBalancing())
    model.zero_grad()
    flat_mask = mask.reshape(-1)
    out = model(x, mask=mask)
    logits = model.router(x.reshape(-1, H))
    scores = logits.sigmoid()
    index = (scores + model.router_bias).topk(K, -1).indices
    ids = torch.arange(4).repeat_interleave(6)
    explicit = (
        (out * mask[..., None]).sum()
        + 0.3
        * sequence_aux_loss(
            scores / scores.sum(-1, keepdim=True),
            index,
            sequence_ids=ids,
            num_sequences=4,
            token_mask=flat_mask,
            reduction="sum",
        )
        + 0.01 * router_z_loss(logits, token_mask=flat_mask, reduction="sum")
    )
    (explicit / total).backward()
    torch.testing.assert_close(model.router.weight.grad, one_pass, atol=1e-6, rtol=1e-5)
    # and the reported value is the objective's aux part
    expected_seq = sequence_aux_loss(
        scores / scores.sum(-1, keepdim=True), index, sequence_ids=ids, num_sequences=4, token_mask=flat_mask
    )
    assert values_one["seq_aux_loss"] == pytest.approx(0.3 * expected_seq.item(), rel=1e-5)
    assert values_one["aux_loss"] == 0.0


def test_activation_checkpointing_counts_once_and_keeps_the_gradient() -> None:
    model = SkewedMoE(skew=1.0)
    configure_load_balancing(model, LoadBalancing(aux_loss_coeff=0.5, z_loss_coeff=0.1))
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 5, dtype=torch.bool)
    plain = _router_grads(model, [(x, mask)], 10)
    plain_values = aux_loss_values(model, reset=True)
    reset_expert_load(model)
    model.zero_grad()
    out = torch.utils.checkpoint.checkpoint(lambda a: model(a, mask=mask), x, use_reentrant=False)
    out.sum().div(10).backward()
    torch.testing.assert_close(model.router.weight.grad, plain, atol=1e-6, rtol=1e-5)
    assert aux_loss_values(model, reset=True) == pytest.approx(plain_values, rel=1e-6)
    assert int(expert_load(model).tokens_per_expert["experts"].sum()) == 10 * K


def test_update_expert_bias_names_a_missing_layer() -> None:
    model = SkewedMoE()
    configure_load_balancing(model, LoadBalancing(bias_update_rate=1e-3))
    with pytest.raises(KeyError, match="experts"):
        update_expert_bias(model, expert_load(nn.Linear(2, 2)))
