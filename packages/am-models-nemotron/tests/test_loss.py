"""The block-wise cross entropy against `F.cross_entropy`: value and gradient for every dtype, ignored rows, several
blocks, scaled and retained backward passes, the empty case, and no-grad evaluation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from am_models_nemotron import loss as loss_module
from am_models_nemotron.loss import cross_entropy

IGN = -100


def _case(rows: int, vocab: int, dtype: torch.dtype, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[::5] = IGN
    return logits, targets


def _reference(logits: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
    return F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, targets, **kwargs)


@pytest.mark.parametrize(
    ("dtype", "loss_tol", "grad_tol"),
    [(torch.float32, 1e-6, 1e-6), (torch.float64, 1e-12, 1e-12), (torch.bfloat16, 1e-6, 1e-2)],
)
@pytest.mark.parametrize("rows", [3, 256, 700])  # one partial block, exactly one block, several blocks
def test_value_and_gradient_equal_f_cross_entropy(dtype, loss_tol, grad_tol, rows) -> None:
    logits, targets = _case(rows, 300, dtype)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    ours = cross_entropy(ours_in, targets, ignore_index=IGN)
    ref = _reference(ref_in, targets, ignore_index=IGN)
    assert ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, rtol=loss_tol, atol=0)
    ours.backward()
    ref.backward()
    assert ours_in.grad is not None
    assert ref_in.grad is not None
    assert ours_in.grad.dtype == dtype
    # bf16 gradients may differ by one rounding step of bf16 (the reference rounds an fp32 gradient once too).
    torch.testing.assert_close(ours_in.grad.float(), ref_in.grad.float(), rtol=grad_tol, atol=grad_tol * 1e-2)
    assert ours_in.grad[::5].abs().max() == 0  # ignored rows get no gradient


def test_scaled_and_repeated_backward_passes() -> None:
    logits, targets = _case(300, 50, torch.float32, seed=1)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    ours = cross_entropy(ours_in, targets) * 0.25
    ref = _reference(ref_in, targets) * 0.25
    # Twice with retain_graph: the first pass must not have consumed or scaled the stored gradient.
    for _ in range(2):
        ours.backward(retain_graph=True)
        ref.backward(retain_graph=True)
        torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-6, atol=1e-9)
    unscaled_in = logits.clone().requires_grad_()
    loss = cross_entropy(unscaled_in, targets)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(unscaled_in.grad, ref_in.grad * 4, rtol=1e-6, atol=1e-9)


def test_leading_dimensions_and_shape_errors() -> None:
    logits, targets = _case(24, 40, torch.float32, seed=2)
    torch.testing.assert_close(
        cross_entropy(logits.view(2, 12, 40), targets.view(2, 12)), _reference(logits, targets, ignore_index=IGN)
    )
    with pytest.raises(ValueError, match="disagree"):
        cross_entropy(logits, targets[:-1])


def test_every_row_ignored() -> None:
    logits = torch.randn(4, 10, requires_grad=True)
    targets = torch.full((4,), IGN)
    assert torch.isnan(cross_entropy(logits, targets))
    assert torch.isnan(_reference(logits, targets))
    zero = cross_entropy(logits, targets, empty_is_zero=True)
    assert zero.item() == 0.0
    zero.backward()
    assert logits.grad is not None
    assert torch.count_nonzero(logits.grad) == 0


def test_no_gradient_buffer_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, targets = _case(40, 30, torch.float32, seed=3)
    allocations: list[torch.Size] = []
    real_empty_like = torch.empty_like

    def counting_empty_like(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        allocations.append(tensor.shape)
        return real_empty_like(tensor, *args, **kwargs)

    monkeypatch.setattr(loss_module.torch, "empty_like", counting_empty_like)
    with torch.no_grad():
        value = cross_entropy(logits, targets)
    torch.testing.assert_close(value, _reference(logits, targets, ignore_index=IGN))
    assert allocations == []
    cross_entropy(logits.clone().requires_grad_(), targets)
    assert allocations == [logits.shape]
