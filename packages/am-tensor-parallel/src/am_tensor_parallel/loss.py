"""Cross-entropy over a vocabulary-sharded head: each tp rank holds logits `[..., V/tp]` for its slice of the
vocabulary; the full `[..., V]` logits are never gathered (Megatron's vocab-parallel cross-entropy).

Three all-reduces of `[...]` per call (max, sum of exponentials, target logit), none in the backward: the gradient
`softmax - onehot` is local to each vocabulary slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    mesh: DeviceMesh,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """`F.cross_entropy(full_logits, labels)` from this rank's vocabulary shard, exactly (in fp32).

    Args:
        logits: `[..., V/tp]` (float; a plain tensor or a `Shard(-1)` DTensor), tp rank r holding vocabulary
            entries `[r*V/tp, (r+1)*V/tp)`, as a `colwise` head produces them. Computed in fp32.
        labels: `[...]` int64 class indices in `[0, V)` or `ignore_index` (already shifted for next-token loss).
        mesh: the 1-D tp mesh the head is sharded over.
        reduction: "mean" (over non-ignored labels; 0 when there are none), "sum" or "none" (`[...]`).

    Returns:
        the loss, identical on every tp rank (fp32).
    """
    if isinstance(logits, DTensor):
        logits = logits.to_local()
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)}: leading dims must match")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    group = mesh.get_group()
    per_token = _VocabParallelCE.apply(logits.float(), labels, group, ignore_index)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum().clamp(min=1)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, group: Any, ignore_index: int) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        start = dist.get_rank(group) * local_vocab
        peak = logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        valid = labels != ignore_index
        local = labels - start
        mine = valid & (local >= 0) & (local < local_vocab)
        index = torch.where(mine, local, torch.zeros_like(local))
        target = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(target, group=group)
        loss = (sum_exp.log() - target) * valid
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, mine, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        softmax, index, mine, valid = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, index.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        grad_logits *= (grad * valid).unsqueeze(-1)
        return grad_logits, None, None, None
