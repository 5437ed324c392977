"""Loss and gradient helpers without a process group (the 2-rank parity run lives in test_hf.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from am_context_parallel import all_reduce_cp_gradients, cp_token_mean_loss


def test_token_mean_loss_equals_cross_entropy_mean_on_one_process() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen, requires_grad=True)
    labels = torch.randint(0, 7, (2, 5), generator=gen)
    labels[0, :3] = -100
    local, global_loss = cp_token_mean_loss(logits, labels, group=None)
    expected = F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(local, expected)
    torch.testing.assert_close(global_loss, expected.detach())
    assert local.requires_grad
    assert not global_loss.requires_grad


def test_all_ignored_labels_give_zero_not_nan() -> None:
    logits = torch.randn(1, 3, 4)
    local, _ = cp_token_mean_loss(logits, torch.full((1, 3), -100), group=None)
    assert local.item() == 0.0


def test_gradient_sum_is_a_no_op_without_a_group() -> None:
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    assert model.weight.grad is not None
    before = model.weight.grad.clone()
    all_reduce_cp_gradients(model, group=None)
    assert torch.equal(model.weight.grad, before)
