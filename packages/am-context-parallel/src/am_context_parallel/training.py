"""Loss and gradient reduction for a CP training step: a global token mean and a sum of gradients over the group.

What it is for: under CP each rank holds a slice of every sequence, so (1) the loss must be divided by the number
of non-ignored labels of the WHOLE sequence (all-reduced), not the local one, and (2) each rank's parameter
gradients cover only its tokens' paths (ring attention already routes dK/dV back to their owners), so summing them
over the CP group gives the gradient of the full-sequence loss. Parity with C = 1 follows exactly.
What it must not do: shift labels (a shard cannot see its neighbour's next token: pass labels already shifted,
label t = token t+1), or average gradients (that would divide by C twice).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["all_reduce_cp_gradients", "cp_token_mean_loss"]


def _active(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def cp_token_mean_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, group: Any, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy of the local tokens divided by the GLOBAL count of non-ignored labels.

    logits: `[B, S_local, V]` (any float dtype; computed in fp32), labels: `[B, S_local]` already shifted.
    Returns `(local_loss, global_loss)`: backpropagate `local_loss` on every rank (then `all_reduce_cp_gradients`);
    `global_loss` is the detached full-sequence token mean, identical on every rank, for logging.
    """
    local_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    count = (labels != ignore_index).sum().to(torch.float32)
    if _active(group):
        dist.all_reduce(count, group=group)
    local_loss = local_sum / count.clamp(min=1.0)
    global_loss = local_loss.detach().clone()
    if _active(group):
        dist.all_reduce(global_loss, group=group)
    return local_loss, global_loss


def all_reduce_cp_gradients(parameters: Iterable[torch.nn.Parameter] | torch.nn.Module, *, group: Any) -> None:
    """Sum every existing `.grad` over the CP group, in one flat collective (in place)."""
    params = parameters.parameters() if isinstance(parameters, torch.nn.Module) else parameters
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not _active(group):
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
