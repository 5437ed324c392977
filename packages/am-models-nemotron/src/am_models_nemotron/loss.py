"""Cross entropy over the vocabulary whose gradient is computed in the forward pass, a block of rows at a time.

What it is for: the language-model losses (`NemotronHForCausalLM` with `labels`, the MTP depths). The plain
`F.cross_entropy` keeps a log-softmax copy of the logits for its backward and then allocates two more logits-sized
tensors there (a zero-filled NLL gradient and the log-softmax gradient); at [B·S, V] these are the largest tensors
of the step. Here the softmax is evaluated once per block of rows while the block is in cache, and the gradient
`(softmax - onehot) / count` is written straight into one buffer that the backward hands on.
What it must not do: round. Math is fp32 whatever the logits dtype (fp64 stays fp64); the result equals
`F.cross_entropy(logits.float(), targets, ignore_index=...)` (mean over the non-ignored rows; NaN when every row is
ignored, as there) within fp32 summation order.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cross_entropy"]

# Rows per block: 256 rows of a 4k-256k vocabulary are 4-256 MiB of fp32; the block's softmax is read right after
# it is written, so smaller blocks keep it in cache for the common vocabularies.
_BLOCK_ROWS = 256


class _CrossEntropyMean(torch.autograd.Function):
    """loss = mean over rows with targets != ignore_index of logsumexp(logits[r]) - logits[r, targets[r]].

    logits: [R, V] (any float dtype); targets: [R] int64. Returns a 0-dim fp32 (fp64 for fp64 logits) tensor.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, empty_is_zero: bool
    ) -> torch.Tensor:
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        rows = logits.shape[0]
        valid = targets != ignore_index
        count = valid.sum()
        if empty_is_zero:
            count = count.clamp(min=1)
        safe_targets = torch.where(valid, targets, 0)[:, None]
        # 1 / count per valid row, 0 for ignored rows: the gradient's row scale (NaN when count = 0, as
        # F.cross_entropy's mean, unless empty_is_zero).
        row_scale = valid.to(compute_dtype) / count.to(compute_dtype)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits) if need_grad else None
        total = torch.zeros((), dtype=compute_dtype, device=logits.device)
        for start in range(0, rows, _BLOCK_ROWS):
            block = slice(start, start + _BLOCK_ROWS)
            values = logits[block].to(compute_dtype)
            row_max = values.amax(dim=-1, keepdim=True)
            # exp(values - max) goes into the gradient buffer when it has the compute dtype (no extra block tensor).
            in_place = grad is not None and grad.dtype == compute_dtype
            shifted = torch.sub(values, row_max, out=grad[block]) if in_place else values - row_max  # type: ignore[index]
            exps = shifted.exp_()
            sums = exps.sum(dim=-1, keepdim=True)
            picked = values.gather(1, safe_targets[block])
            total += ((row_max + sums.log() - picked).squeeze(1) * row_scale[block]).sum()
            if grad is not None:
                scale = row_scale[block, None]
                exps.mul_(scale / sums).scatter_add_(1, safe_targets[block], -scale)
                if not in_place:
                    grad[block].copy_(exps)
        if grad is not None:
            ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors
        # A plain `loss.backward()` sends 1: hand on the buffer itself (read-only downstream) instead of allocating a
        # second logits-sized tensor. The check reads a CPU scalar only; elsewhere the product is cheap.
        if grad_output.device.type == "cpu" and grad_output.item() == 1.0:
            return grad, None, None, None
        return grad * grad_output.to(grad.dtype), None, None, None


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100, empty_is_zero: bool = False
) -> torch.Tensor:
    """Mean cross entropy of `logits` [..., V] against `targets` [...] (int ids; `ignore_index` rows skipped).

    Same value and gradient as `F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1),
    ignore_index=ignore_index)`; returns a 0-dim fp32 tensor (fp64 for fp64 logits). When every target is ignored
    the result is NaN, as there, or 0 with a zero gradient when `empty_is_zero` (no host sync either way).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree; targets must "
            "have the logits' shape without the vocabulary dimension."
        )
    flat = logits.reshape(-1, logits.shape[-1])
    loss: torch.Tensor = _CrossEntropyMean.apply(flat, targets.reshape(-1).to(torch.long), ignore_index, empty_is_zero)
    return loss
