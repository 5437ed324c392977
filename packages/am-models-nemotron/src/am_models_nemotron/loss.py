"""THE training loss of Nemotron-H (next-token + scaled MTP, one rule) and its cross entropy.

What it is for: `combined_causal_lm_loss` — the one implementation of the loss: position t's next-token target is
labels[t + 1], MTP depth k (0-based) at position t predicts token t + k + 2, never across a document, each depth
weighted `scaling / D` (that MTP term, targets and sum, is am-context-parallel's `mtp_targets` / `mtp_loss`, which
am-pipelining's `calculate_mtp_loss` calls too). The forward's `loss` / `mtp_loss`,
`NemotronHForCausalLM.combined_loss` (the duck-typed hook am-pipelining's `PipelineCausalLMLoss` and the reference
trainer call) and context parallelism's target preparation (`causal_lm_targets`) all go through it.
`cross_entropy`: cross entropy over the vocabulary whose gradient is computed in the forward pass. The plain
`F.cross_entropy` keeps a log-softmax copy of the logits for its backward and then allocates two more logits-sized
tensors there (a zero-filled NLL gradient and the log-softmax gradient); at [B·S, V] these are the largest tensors
of the step. Here the softmax is evaluated once per block of rows while the block is in cache, and the gradient
`(softmax - onehot) / count` is written straight into one buffer that the backward hands on.
What it must not do: round. Math and the gradient buffer are fp32 whatever the logits dtype (fp64 stays fp64); the
upstream gradient is applied in that precision and the result rounded once to the logits dtype, as
`F.cross_entropy(logits.float(), ...)` does. Values and gradients equal `F.cross_entropy`'s (mean over the
non-ignored rows; NaN loss with a zero gradient when every row is ignored, as there) within fp32 summation order.
With `create_graph=True` (second derivatives) the backward falls back to a differentiable softmax formula.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from am_context_parallel import mtp_loss, mtp_targets

from .mtp import shift_labels, shift_within_documents
from .ssd import _compute_dtype

__all__ = ["CombinedLoss", "causal_lm_targets", "combined_causal_lm_loss", "cross_entropy"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Rows per block: 256 rows of a 4k-256k vocabulary are 4-256 MiB of fp32; the block's softmax is read right after
# it is written, so smaller blocks keep it in cache for the common vocabularies.
_BLOCK_ROWS = 256


def _blockwise(
    logits: torch.Tensor,
    safe_targets: torch.Tensor,
    valid: torch.Tensor,
    row_scale: torch.Tensor,
    grad: torch.Tensor | None,
) -> torch.Tensor:
    """Sum over valid rows of logsumexp - picked logit; with `grad` ([R, V], compute dtype) also writes
    row_scale * (softmax - onehot) into it (zero rows for ignored targets, even where their logits are not finite)."""
    total = torch.zeros((), dtype=row_scale.dtype, device=logits.device)
    for start in range(0, logits.shape[0], _BLOCK_ROWS):
        block = slice(start, start + _BLOCK_ROWS)
        values = logits[block].to(row_scale.dtype)
        row_max = values.amax(dim=-1, keepdim=True)
        # exp(values - max) is written into the gradient buffer (no extra block-sized tensor).
        exps = (torch.sub(values, row_max, out=grad[block]) if grad is not None else values - row_max).exp_()
        sums = exps.sum(dim=-1, keepdim=True)
        picked = values.gather(1, safe_targets[block])
        keep = valid[block, None]
        total += torch.where(keep, row_max + sums.log() - picked, 0.0).sum()
        if grad is not None:
            scale = row_scale[block, None]
            exps.mul_(scale / sums).masked_fill_(~keep, 0.0).scatter_add_(1, safe_targets[block], -scale)
    return total


class _CrossEntropyMean(torch.autograd.Function):
    """loss = mean over rows with targets != ignore_index of logsumexp(logits[r]) - logits[r, targets[r]].

    logits: [R, V] (any float dtype); targets: [R] int64. Returns a 0-dim fp32 (fp64 for fp64 logits) tensor.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        empty_is_zero: bool,
        compute_grad: bool,
    ) -> torch.Tensor:
        dtype = _compute_dtype(logits)
        valid = targets != ignore_index
        count = valid.sum()
        if empty_is_zero:
            count = count.clamp(min=1)
        count = count.to(dtype)
        safe_targets = torch.where(valid, targets, 0)[:, None]
        # 1 / count for valid rows, exactly 0 for ignored ones (also when count = 0: zero gradient, like F's).
        row_scale = torch.where(valid, 1.0 / count, 0.0)
        grad = torch.empty(logits.shape, dtype=dtype, device=logits.device) if compute_grad else None
        total = _blockwise(logits, safe_targets, valid, row_scale, grad)
        ctx.save_for_backward(logits, safe_targets, valid, row_scale)
        # Kept as an attribute, not a saved tensor: the backward may hand it on (and then drops its reference).
        ctx.grad_buffer = grad
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        logits, safe_targets, valid, row_scale = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True: the precomputed buffer has no graph back to the logits, so build the gradient from
            # differentiable ops (slower; only for second derivatives such as gradient penalties).
            probs = torch.softmax(logits.to(row_scale.dtype), dim=-1)
            onehot = F.one_hot(safe_targets[:, 0], logits.shape[-1]).to(row_scale.dtype)
            grad = (probs - onehot).masked_fill(~valid[:, None], 0.0) * row_scale[:, None]
            return (grad * grad_output).to(logits.dtype), None, None, None, None
        grad = ctx.grad_buffer
        if grad is None:  # handed on by an earlier backward through a retained graph: rebuild it
            grad = torch.empty(logits.shape, dtype=row_scale.dtype, device=logits.device)
            _blockwise(logits, safe_targets, valid, row_scale, grad)
        # A plain `loss.backward()` on fp32 logits sends 1: hand on the buffer itself instead of allocating a second
        # logits-sized tensor, and forget it (autograd may adopt it as a leaf's .grad and accumulate into it later).
        # The check reads a CPU scalar only; elsewhere the product is cheap.
        if grad.dtype == logits.dtype and grad_output.device.type == "cpu" and grad_output.item() == 1.0:
            ctx.grad_buffer = None
            return grad, None, None, None, None
        return (grad * grad_output.to(grad.dtype)).to(logits.dtype), None, None, None, None


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100, empty_is_zero: bool = False
) -> torch.Tensor:
    """Mean cross entropy of `logits` [..., V] against `targets` [...] (int ids; `ignore_index` rows skipped).

    Same value and gradient as `F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1),
    ignore_index=ignore_index)`; returns a 0-dim fp32 tensor (fp64 for fp64 logits). When every target is ignored
    the loss is NaN, as there, or 0 when `empty_is_zero`; the gradient is zero either way (no host sync).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree; targets must "
            "have the logits' shape without the vocabulary dimension."
        )
    flat = logits.reshape(-1, logits.shape[-1])
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    loss: torch.Tensor = _CrossEntropyMean.apply(
        flat, targets.reshape(-1).to(torch.long), ignore_index, empty_is_zero, compute_grad
    )
    return loss


@dataclass
class CombinedLoss:
    """loss = lm_loss + mtp_loss (mtp_loss None when no MTP depth took part); per-depth losses unscaled."""

    loss: torch.Tensor
    lm_loss: torch.Tensor
    mtp_loss: torch.Tensor | None
    mtp_per_depth_losses: list[torch.Tensor]


def causal_lm_targets(
    labels: torch.Tensor,
    *,
    depths: int = 0,
    seq_idx: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    labels_shifted: bool = False,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(next-token targets [B, S], D MTP targets [B, S]): THE target rule.

    Position t's next-token target is labels[t + 1] (or labels[t] when `labels_shifted`); depth k's is the
    next-token target k + 1 positions on (the token t + k + 2). `ignore_index` past the row, across a document
    (`seq_idx`), at padding positions and where the target token is padding (`padding_mask`, True = padding).
    Context parallelism calls it on the whole sequence before sharding, so block edges are right.
    """
    if padding_mask is not None and not labels_shifted:
        labels = labels.masked_fill(padding_mask, ignore_index)
    shifted = labels if labels_shifted else shift_labels(labels, 1, seq_idx=seq_idx, ignore_index=ignore_index)
    if padding_mask is not None:
        shifted = shifted.masked_fill(padding_mask, ignore_index)
        if labels_shifted:  # the target of position t is the token t + 1: ignored where that token is padding
            # Past the row the caller's label stands (it names the token after the row; -100 where there is none),
            # as without a padding mask; otherwise a trainer's full windows would lose their last target under CP.
            shifted = shifted.masked_fill(shift_within_documents(padding_mask, 1, fill_value=False), ignore_index)
    targets = mtp_targets(shifted, depths, seq_idx=seq_idx, ignore_index=ignore_index)
    if padding_mask is not None:
        targets = [target.masked_fill(padding_mask, ignore_index) for target in targets]
    return shifted, targets


def combined_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    mtp_per_depth_h: Sequence[torch.Tensor] | None = None,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    mtp_loss_scaling_factor: float = 0.1,
    seq_idx: torch.Tensor | None = None,
    loss_fn: LossFn | None = None,
    labels_shifted: bool = False,
    mtp_per_depth_targets: Sequence[torch.Tensor] | None = None,
    padding_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> CombinedLoss:
    """Next-token loss plus `mtp_loss_scaling_factor / D` x the sum of the D MTP depth losses.

    logits: [B, S, V]; labels: [B, S] token ids — unshifted (transformers' convention: the target of position t is
    labels[t + 1]) or, with `labels_shifted=True`, already the next-token targets (the pipeline's convention);
    mtp_per_depth_h: D hidden states [B, S, H], projected by `lm_head`; seq_idx: [B, S] document ids of packed rows
    (targets never cross a document); mtp_per_depth_targets: D precomputed [B, S] targets (context parallelism:
    shifted before sharding), used instead of shifting `labels`.

    loss_fn: `(logits, targets) -> scalar`; default the mean cross entropy over non-ignored targets (an MTP depth
    without targets then counts 0). A token-sum loss divided by a global count (the reference trainer's) works too.

    Raises:
        ValueError: MTP hidden states without `lm_head`, or precomputed targets of the wrong count or shape.
    """
    depths = len(mtp_per_depth_h) if mtp_per_depth_h else 0
    shifted, targets = causal_lm_targets(
        labels,
        depths=depths if mtp_per_depth_targets is None else 0,
        seq_idx=seq_idx,
        padding_mask=padding_mask,
        labels_shifted=labels_shifted,
        ignore_index=ignore_index,
    )

    def loss_of(logits: torch.Tensor, targets: torch.Tensor, *, empty_is_zero: bool) -> torch.Tensor:
        # empty_is_zero: an MTP depth without targets (short rows at deep depths) counts 0, not NaN
        if loss_fn is not None:
            return loss_fn(logits, targets)
        return cross_entropy(logits, targets, ignore_index=ignore_index, empty_is_zero=empty_is_zero)

    lm_loss = loss_of(logits, shifted, empty_is_zero=False)
    if mtp_per_depth_targets is not None and depths:
        targets = list(mtp_per_depth_targets)
        if len(targets) != depths or any(t.shape != shifted.shape for t in targets):
            raise ValueError(
                f"MTP: got {len(targets)} target tensors of shapes {[tuple(t.shape) for t in targets]} for {depths} "
                f"depths; each must have the labels' shape {tuple(shifted.shape)}."
            )
    if not depths:
        return CombinedLoss(loss=lm_loss, lm_loss=lm_loss, mtp_loss=None, mtp_per_depth_losses=[])
    if lm_head is None:
        raise ValueError("combined_causal_lm_loss: MTP hidden states need lm_head to become logits.")
    # The MTP term is am-context-parallel's `mtp_loss`, the one implementation am-pipelining's loss calls too.
    term = mtp_loss(
        list(mtp_per_depth_h or []),
        targets,
        loss_fn=lambda logits, target: loss_of(logits, target, empty_is_zero=True),
        scaling_factor=mtp_loss_scaling_factor,
        project=lm_head,
    )
    return CombinedLoss(
        loss=lm_loss + term.loss, lm_loss=lm_loss, mtp_loss=term.loss, mtp_per_depth_losses=term.per_depth_losses
    )


def sum_over_items(count: Any) -> LossFn:
    """transformers' `num_items_in_batch` normalization as a `loss_fn`: the cross-entropy SUM over the non-ignored
    targets divided by `count` (the items of the whole accumulated batch), instead of this micro-batch's mean."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = (targets != -100).sum()
        return cross_entropy(logits, targets, empty_is_zero=True) * valid / count

    return loss
