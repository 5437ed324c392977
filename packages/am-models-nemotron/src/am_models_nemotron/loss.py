"""Cross entropy over the vocabulary whose gradient is computed in the forward pass, a block of rows at a time.

What it is for: the language-model losses (`NemotronHForCausalLM` with `labels`, the MTP depths). The plain
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

from typing import Any

import torch
import torch.nn.functional as F

from .ssd import _compute_dtype

__all__ = ["cross_entropy"]

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
