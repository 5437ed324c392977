"""GroupedExperts: numerically the per-expert reference loop, forward and backward, for both backends.

Contract: gated (GeGLU / SwiGLU) and plain (ReLU²) experts equal `tests/_moe_reference.py` (fp32) in the output and
in the gradients of the hidden states, the routing weights and both expert weights, with `torch._grouped_mm` and
with the per-expert loop; padding tokens (`token_mask` False) get 0, reach no expert and get no gradient; bad router
outputs raise one `RoutingError` listing every problem; the load counters count each routed pair once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _moe_reference import random_routing, reference_experts
from torch.utils.checkpoint import checkpoint

from am_moe import EXPERT_ACTIVATIONS, GroupedExperts, LocalDispatcher, RoutingError
from am_moe.dispatch import combine_pairs

# fp32 against the reference loop: same products, different summation order (the loop sums expert by expert with
# index_add, ours over k): a few ulps of values of order 1.
FP32_TOL = 2e-6

KINDS = [(True, "gelu_tanh"), (True, "silu"), (False, "relu2")]
BACKENDS = ["grouped_mm", "loop"]


def _experts(gated: bool, activation: str, backend: str, *, num_experts: int = 8, hidden: int = 16, inter: int = 12):
    torch.manual_seed(1)
    experts = GroupedExperts(num_experts, hidden, inter, gated=gated, activation=activation, grouped_mm=backend)
    experts.init_weights(std=0.2)
    return experts


def _check_against_reference(
    experts: GroupedExperts, tokens: int, top_k: int, *, seed: int, token_mask: torch.Tensor | None = None
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, experts.hidden_size, generator=gen)
    index, weights = random_routing(tokens, top_k, experts.num_experts, generator=gen, skip=(3,))
    grad_out = torch.randn(tokens, experts.hidden_size, generator=gen)

    x_ours, w_ours = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = experts(x_ours, index, w_ours, token_mask=token_mask)
    out.backward(grad_out)

    first = experts.first_proj.detach().clone().requires_grad_()
    down = experts.down_proj.detach().clone().requires_grad_()
    x_ref, w_ref = x.clone().requires_grad_(), weights.clone().requires_grad_()
    ref = reference_experts(
        x_ref,
        index,
        w_ref,
        first=first,
        down=down,
        gated=experts.gated,
        activation=experts.activation,
        token_mask=token_mask,
    )
    ref.backward(grad_out)

    torch.testing.assert_close(out, ref, rtol=FP32_TOL, atol=FP32_TOL)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=FP32_TOL, atol=FP32_TOL)
    torch.testing.assert_close(w_ours.grad, w_ref.grad, rtol=FP32_TOL, atol=FP32_TOL)
    torch.testing.assert_close(experts.first_proj.grad, first.grad, rtol=FP32_TOL, atol=FP32_TOL)
    torch.testing.assert_close(experts.down_proj.grad, down.grad, rtol=FP32_TOL, atol=FP32_TOL)
    # expert 3 never routed: its weights still get a gradient (zero), which FSDP / EP reductions rely on
    assert torch.equal(experts.first_proj.grad[3], torch.zeros_like(experts.first_proj.grad[3]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("gated", "activation"), KINDS)
def test_equals_reference_loop(gated: bool, activation: str, backend: str) -> None:
    experts = _experts(gated, activation, backend)
    _check_against_reference(experts, tokens=37, top_k=3, seed=7)
    assert experts.grouped_mm_choice is not None
    assert experts.grouped_mm_choice.backend == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_tokens_reach_no_expert(backend: str) -> None:
    experts = _experts(True, "gelu_tanh", backend)
    mask = torch.ones(20, dtype=torch.bool)
    mask[[0, 5, 6, 19]] = False
    _check_against_reference(experts, tokens=20, top_k=2, seed=3, token_mask=mask)
    assert experts.tokens_per_expert.sum().item() == 16 * 2  # padding pairs are not counted

    x = torch.randn(20, 16, requires_grad=True)
    index = torch.randint(0, 8, (20, 2))
    index[~mask] = 99  # whatever the router said about padding is ignored, even out of range
    out = experts(x, index, torch.ones(20, 2), token_mask=mask)
    assert torch.equal(out[~mask], torch.zeros(4, 16))
    out.sum().backward()
    assert torch.equal(x.grad[~mask], torch.zeros(4, 16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_and_all_padding(backend: str) -> None:
    experts = _experts(False, "relu2", backend)
    empty = experts(torch.zeros(0, 16), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert empty.shape == (0, 16)
    x = torch.randn(4, 16, requires_grad=True)
    out = experts(x, torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2), token_mask=torch.zeros(4, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(4, 16))
    out.sum().backward()
    assert torch.equal(experts.down_proj.grad, torch.zeros_like(experts.down_proj))


def test_no_sync_dispatch_path_equals_host_path() -> None:
    """The CUDA path (no device-to-host sync: padding rows stay behind the last group) on the CPU."""
    experts = _experts(True, "silu", "grouped_mm")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(15, 16, generator=gen, requires_grad=True)
    index, weights = random_routing(15, 2, 8, generator=gen)
    mask = torch.rand(15, generator=gen) > 0.3
    outs, grads = [], []
    for host_sizes in (True, False):
        dispatcher = LocalDispatcher()
        rows, layout, state = dispatcher.dispatch(x, index, mask, num_experts=8, problems=[], host_sizes=host_sizes)
        assert (layout.valid_rows is None) == host_sizes
        out = experts._experts(rows, layout, experts.gate_up_proj, experts.down_proj, "grouped_mm")
        out = combine_pairs(dispatcher.undispatch(out, state), state, weights, out_dtype=x.dtype, combine_dtype=None)
        (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
        outs.append(out)
        grads.append(grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_combine_in_fp32_keeps_routing_weights_unrounded() -> None:
    """bf16 experts: with combine_dtype fp32 the weighted sum equals an fp32 combine of the same bf16 outputs."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 8, gated=True, activation="silu", dtype=torch.bfloat16)
    experts.init_weights(std=0.3)
    x = torch.randn(9, 16, dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    weights = torch.rand(9, 2) * 0.37 + 0.01  # fp32 routing weights, not representable in bf16
    out = experts(x, index, weights)
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        singles = torch.stack([experts(x, index[:, k : k + 1], torch.ones(9, 1)) for k in range(2)], dim=1)
    expected = (singles.float() * weights.unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    experts.combine_dtype = None
    rounded = (singles * weights.to(torch.bfloat16).unsqueeze(-1)).sum(dim=1)
    torch.testing.assert_close(experts(x, index, weights), rounded, rtol=0, atol=0)


def test_every_problem_is_listed_at_once() -> None:
    experts = _experts(True, "silu", "loop")
    with pytest.raises(RoutingError) as info:
        experts(
            torch.randn(5, 15),
            torch.zeros(4, 9, dtype=torch.float32),
            torch.zeros(4, 3),
            token_mask=torch.ones(6, dtype=torch.int64),
        )
    message = str(info.value)
    for expected in (
        "hidden_states must be [tokens, 16]",
        "4 rows but hidden_states has 5",
        "top_k=9 is larger than the number of experts (8)",
        "must be an integer tensor",
        "same shape",
        "token_mask must be bool",
        "token_mask must be [tokens] = [5]",
    ):
        assert expected in message, (expected, message)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_indices(backend: str) -> None:
    experts = _experts(False, "relu2", backend)
    index = torch.tensor([[0, 8], [-1, 2], [1, 2]])
    with pytest.raises(RoutingError, match=r"2 routing indices are out of range \[0, 8\)"):
        experts(torch.randn(3, 16), index, torch.ones(3, 2))


def test_dtype_mismatch_is_refused() -> None:
    experts = _experts(True, "silu", "loop")
    with pytest.raises(RoutingError, match=r"bfloat16 but the expert weights are torch\.float32"):
        experts(torch.randn(3, 16, dtype=torch.bfloat16), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


def test_constructor_lists_every_problem() -> None:
    with pytest.raises(ValueError, match="GroupedExperts") as info:
        GroupedExperts(0, 16, -1, gated=True, activation="swish", grouped_mm="triton")
    for expected in ("num_experts", "intermediate_size", "'swish' is unknown", "grouped_mm must be"):
        assert expected in str(info.value)


def test_layout_is_stacked_linear_weights() -> None:
    """`[E, out, in]`: expert e's up projection is `nn.Linear(H, I).weight`-shaped and the gate rows come first."""
    experts = GroupedExperts(3, 16, 8, gated=True, activation="gelu_tanh")
    experts.init_weights(std=0.5)
    assert experts.gate_up_proj.shape == (3, 16, 16)
    assert experts.down_proj.shape == (3, 16, 8)
    x = torch.randn(1, 16)
    gate = F.linear(x, experts.gate_up_proj[1, :8])
    up = F.linear(x, experts.gate_up_proj[1, 8:])
    expected = F.linear(EXPERT_ACTIVATIONS["gelu_tanh"](gate) * up, experts.down_proj[1])
    out = experts(x, torch.tensor([[1]]), torch.ones(1, 1))
    torch.testing.assert_close(out, expected, rtol=FP32_TOL, atol=FP32_TOL)
    plain = GroupedExperts(3, 16, 8, gated=False, activation="relu2")
    assert plain.up_proj.shape == (3, 8, 16)
    assert not hasattr(plain, "gate_up_proj")


def test_load_counted_once_under_activation_checkpointing() -> None:
    experts = _experts(True, "silu", "grouped_mm")
    x = torch.randn(10, 16, requires_grad=True)
    index = torch.tensor([[e % 8, (e + 1) % 8] for e in range(10)])
    out = checkpoint(experts, x, index, torch.ones(10, 2), use_reentrant=False)
    out.sum().backward()
    expected = torch.bincount(index.reshape(-1), minlength=8)
    assert torch.equal(experts.tokens_per_expert, expected)
    reference = _experts(True, "silu", "grouped_mm")
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref, index, torch.ones(10, 2)).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


def test_balanced_routing_under_fake_tensors() -> None:
    """A dry run (FakeTensorMode: no routing values) dispatches as if routing were perfectly balanced: host split
    sizes of `balanced_counts`, every row of the step reaching an expert."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from am_moe.dispatch import balanced_counts

    assert balanced_counts(10, 4).tolist() == [3, 3, 2, 2, 0, 0]
    with FakeTensorMode(allow_non_fake_inputs=True):
        hidden = torch.randn(12, 8)
        index = torch.zeros(12, 2, dtype=torch.long)
        rows, layout, state = LocalDispatcher().dispatch(
            hidden, index, None, num_experts=4, problems=[], host_sizes=True
        )
    assert layout.sizes == [6, 6, 6, 6]
    assert rows.shape == (24, 8)
    assert state.num_sent == 24
