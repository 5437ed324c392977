"""am_context_parallel.mtp_loss: the one MTP term (am-pipelining's calculate_mtp_loss and am-models-nemotron's
combined_causal_lm_loss call it). Contract: depth k's target at t is the label k + 1 positions on within the
document, `ignore_index` elsewhere; the term is scaling / D x the sum of the per-depth losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from am_context_parallel import MTPLossOutput, mtp_loss, mtp_targets

IGN = -100


def test_targets_shift_within_documents_and_flat_rows_match_2d() -> None:
    labels = torch.tensor([[1, 2, 3, 4, 5, 6]])
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1]])
    first, second = mtp_targets(labels, 2, seq_idx=seq_idx)
    assert first.tolist() == [[2, 3, IGN, 5, 6, IGN]]
    assert second.tolist() == [[3, IGN, IGN, 6, IGN, IGN]]
    flat = mtp_targets(labels[0], 2, seq_idx=seq_idx[0])
    assert [t.tolist() for t in flat] == [first[0].tolist(), second[0].tolist()]
    assert mtp_targets(labels, 0) == []


def test_term_is_scaling_over_depths_times_the_sum_of_projected_depth_losses() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn(2, 5, 4, generator=g) for _ in range(3)]
    head = torch.randn(7, 4, generator=g)
    targets = [torch.randint(0, 7, (2, 5), generator=g) for _ in range(3)]

    def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1), ignore_index=IGN)

    out = mtp_loss(hidden, targets, loss_fn=ce, scaling_factor=0.3, project=lambda h: h @ head.t())
    per_depth = [ce(h @ head.t(), t) for h, t in zip(hidden, targets, strict=True)]
    assert isinstance(out, MTPLossOutput)
    torch.testing.assert_close(out.per_depth_losses, per_depth)
    torch.testing.assert_close(out.loss, 0.3 * sum(per_depth) / 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 per-depth outputs and 3 targets"):
        mtp_loss(hidden[:2], targets, loss_fn=ce, scaling_factor=0.3)
    with pytest.raises(ValueError, match="need D >= 1"):
        mtp_loss([], [], loss_fn=ce, scaling_factor=0.3)
