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


def test_every_row_ignored_gives_the_references_loss_and_a_zero_gradient() -> None:
    logits = torch.randn(4, 10, requires_grad=True)
    targets = torch.full((4,), IGN)
    ours = cross_entropy(logits, targets)
    assert torch.isnan(ours)
    assert torch.isnan(_reference(logits, targets))
    ours.backward()
    assert logits.grad is not None
    assert torch.count_nonzero(logits.grad) == 0  # as F.cross_entropy's: one all-padding batch poisons nothing
    logits.grad = None
    zero = cross_entropy(logits, targets, empty_is_zero=True)
    assert zero.item() == 0.0
    zero.backward()
    assert logits.grad is not None
    assert torch.count_nonzero(logits.grad) == 0
    assert torch.isnan(cross_entropy(torch.randn(0, 10), torch.zeros(0, dtype=torch.long)))  # no rows: NaN as in F


def test_non_finite_logits_in_ignored_rows_are_ignored() -> None:
    logits, targets = _case(40, 30, torch.float32, seed=5)
    logits[0] = float("nan")  # rows 0, 5, 10, ... are ignored
    logits[5, 3] = float("inf")
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    ours = cross_entropy(ours_in, targets)
    ref = _reference(ref_in, targets, ignore_index=IGN)
    torch.testing.assert_close(ours, ref)
    ours.backward()
    ref.backward()
    assert ours_in.grad is not None
    assert ref_in.grad is not None
    torch.testing.assert_close(ours_in.grad[targets != IGN], ref_in.grad[targets != IGN])
    assert torch.count_nonzero(ours_in.grad[targets == IGN]) == 0  # F's gradient is NaN on the NaN row


@pytest.mark.parametrize(
    ("dtype", "scale"), [(torch.float16, 65536.0), (torch.float16, 1024.0), (torch.bfloat16, 1 / 3)]
)
def test_loss_scale_is_applied_before_rounding_to_the_logits_dtype(dtype, scale) -> None:
    """fp16 loss scaling (GradScaler starts at 2**16, above fp16's range) and bf16 gradient accumulation (loss / 3)
    must round the scaled fp32 gradient once, like F.cross_entropy(logits.float())."""
    logits, targets = _case(300, 200, dtype, seed=6)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    (cross_entropy(ours_in, targets) * scale).backward()
    (_reference(ref_in, targets, ignore_index=IGN) * scale).backward()
    assert ours_in.grad is not None
    assert ref_in.grad is not None
    assert torch.isfinite(ours_in.grad).all()
    # Equal up to one rounding step of the low-precision dtype (fp32 summation order differs), and no gradient
    # entry that the reference keeps is flushed to zero.
    torch.testing.assert_close(ours_in.grad, ref_in.grad)
    assert torch.count_nonzero(ours_in.grad) == torch.count_nonzero(ref_in.grad)


def test_second_derivatives_equal_the_reference() -> None:
    """A gradient penalty through a linear head: needs d(grad_logits)/d(logits), which the buffer alone lacks."""
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(20, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 10, (20,), generator=gen)
    targets[::4] = IGN
    penalties = []
    for loss_fn in (cross_entropy, lambda logits, t: _reference(logits, t, ignore_index=IGN)):
        weight = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(8)).requires_grad_()
        loss = loss_fn(features @ weight.t(), targets)
        (grad_features,) = torch.autograd.grad(loss, features, create_graph=True)
        penalties.append(torch.autograd.grad(grad_features.square().sum(), weight)[0])
    torch.testing.assert_close(penalties[0], penalties[1], rtol=1e-12, atol=1e-14)


def test_retained_graph_on_leaf_logits_accumulates_like_the_reference() -> None:
    logits, targets = _case(50, 20, torch.float32, seed=8)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    ours = cross_entropy(ours_in, targets)
    ref = _reference(ref_in, targets, ignore_index=IGN)
    for _ in range(3):  # the first pass may hand its buffer to ours_in.grad; later passes rebuild the gradient
        ours.backward(retain_graph=True)
        ref.backward(retain_graph=True)
        torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-6, atol=1e-8)


def test_no_gradient_buffer_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, targets = _case(40, 30, torch.float32, seed=3)
    buffers: list[torch.Size] = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs) -> torch.Tensor:
        out = real_empty(*args, **kwargs)
        if out.shape == logits.shape:
            buffers.append(out.shape)
        return out

    monkeypatch.setattr(loss_module.torch, "empty", counting_empty)
    with torch.no_grad():
        value = cross_entropy(logits.clone().requires_grad_(), targets)  # requires grad, but grad mode is off
    torch.testing.assert_close(value, _reference(logits, targets, ignore_index=IGN))
    assert buffers == []
    cross_entropy(logits.clone().requires_grad_(), targets)
    assert buffers == [logits.shape]
