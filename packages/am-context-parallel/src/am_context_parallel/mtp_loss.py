"""THE multi-token-prediction (MTP) term of a causal-LM loss: its targets and its scaled sum, one implementation.

Semantics (`labels` are the next-token targets, already shifted, so `labels[t]` is token t + 1): MTP depth k
(0-based) at position t predicts token t + k + 2, i.e. its target is the label k + 1 positions on
(`shift_packed_tensor`); the last k + 1 positions of a row, and every position whose target lies in another packed
document (`seq_idx`), get `ignore_index`. The term is `scaling_factor / D x sum_k loss_fn(logits_k, targets_k)`.

Both places that compute an MTP loss call it: am-pipelining's `calculate_mtp_loss` / `PipelineCausalLMLoss` (the
last pipeline stage) and am-models-nemotron's `combined_causal_lm_loss` (the model's forward and its
`combined_loss` hook). It lives here because context parallelism is where MTP targets must be computed on whole
sequences before sharding (a shard cannot shift across a block edge), and both may import this package (models never
import am-pipelining).
`roll_tensor` (NeMo AutoModel's zero-filling roll) is here too, so that am-pipelining and Nemotron-H share one.
What it must not do: communicate, or read a model (callers pass the projection and the loss function).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MTPLossOutput", "mtp_loss", "mtp_targets", "roll_tensor", "shift_packed_tensor"]


def roll_tensor(t: torch.Tensor, shifts: int = -1, dim: int = -1, *, fill_value: Any = 0) -> torch.Tensor:
    """`torch.roll` with the wrapped-around slice set to `fill_value` (NeMo AutoModel's MTP `roll_tensor`).

    Negative shifts (left) fill the trailing |shifts| positions, positive shifts the leading ones; `shifts == 0` or
    an empty `dim` returns `t` itself. Shape and dtype of `t`.
    """
    if shifts == 0 or t.shape[dim] == 0:
        return t
    rolled = torch.roll(t, shifts=shifts, dims=dim)
    size = t.shape[dim]
    count = min(abs(shifts), size)
    start = size - count if shifts < 0 else 0
    return rolled.index_fill(dim, torch.arange(start, start + count, device=t.device), fill_value)


def shift_packed_tensor(
    tensor: torch.Tensor,
    *,
    depth: int,
    seq_idx: torch.Tensor | None = None,
    fill_value: Any = 0,
    batch_dim: int = 0,
    seq_dim: int = 1,
) -> torch.Tensor:
    """Shift left by `depth` along `seq_dim` without crossing packed-sequence boundaries.

    tensor: [B, S, ...] (any layout with distinct batch/sequence dims); seq_idx: [B, S] sequence id per token.
    Position t takes the value at t+depth when that exists and belongs to the same sequence, else `fill_value`.
    Returns fresh storage.

    Raises:
        ValueError: tensor has < 2 dims, depth <= 0, batch_dim == seq_dim, or seq_idx's shape is not [B, S].
    """
    if tensor.dim() < 2:
        raise ValueError(f"shift_packed_tensor needs a tensor with batch and sequence dims, got shape {tensor.shape}.")
    if depth <= 0:
        raise ValueError(f"depth must be positive, got {depth}.")
    batch_dim %= tensor.dim()
    seq_dim %= tensor.dim()
    if batch_dim == seq_dim:
        raise ValueError(f"batch_dim and seq_dim must differ, both are {batch_dim}.")
    batch, seq = tensor.shape[batch_dim], tensor.shape[seq_dim]
    if seq_idx is not None and tuple(seq_idx.shape) != (batch, seq):
        raise ValueError(f"seq_idx must have shape ({batch}, {seq}) = (B, S), got {tuple(seq_idx.shape)}.")
    positions = torch.arange(seq, device=tensor.device)
    source = positions + depth
    valid = (source < seq).unsqueeze(0).expand(batch, seq)
    source = source.clamp(max=seq - 1)
    if seq_idx is not None:
        valid = valid & (seq_idx.index_select(1, source) == seq_idx)
    shifted = tensor.index_select(seq_dim, source)
    # Broadcast the [B, S] validity onto the tensor's layout.
    shape = [1] * tensor.dim()
    shape[batch_dim], shape[seq_dim] = batch, seq
    order = sorted([batch_dim, seq_dim])
    mask = valid if order == [batch_dim, seq_dim] else valid.t()
    mask = mask.reshape(shape)
    return torch.where(mask, shifted, torch.as_tensor(fill_value, dtype=tensor.dtype, device=tensor.device))


def mtp_targets(
    labels: torch.Tensor, depths: int, *, seq_idx: torch.Tensor | None = None, ignore_index: int = -100
) -> list[torch.Tensor]:
    """The D MTP targets, each shaped like `labels`: depth k's is `labels` shifted k + 1 positions on within its
    document. labels: [B, S] next-token targets (or flat [T], one row); seq_idx: document ids shaped like labels."""
    if labels.dim() == 2:
        rows, row_ids = labels, seq_idx
    else:
        rows, row_ids = labels[None], None if seq_idx is None else seq_idx[None]
    return [
        shift_packed_tensor(rows, depth=k + 1, seq_idx=row_ids, fill_value=ignore_index).view_as(labels)
        for k in range(depths)
    ]


@dataclass
class MTPLossOutput:
    """Scaled MTP loss and the unscaled per-depth losses (graphs kept)."""

    loss: torch.Tensor
    per_depth_losses: list[torch.Tensor]


def mtp_loss(
    outputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scaling_factor: float,
    project: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> MTPLossOutput:
    """`scaling_factor / D x sum_k loss_fn(project(outputs[k]), targets[k])` over the D >= 1 depths.

    outputs: D per-depth hidden states [B, S, H] (with `project`, e.g. the LM head, making logits of one depth at a
    time) or logits [B, S, V]; targets: D targets shaped like the labels (`mtp_targets`, or computed on whole
    sequences before CP sharding).

    Raises:
        ValueError: no depth, or a different number of outputs and targets.
    """
    if not outputs or len(outputs) != len(targets):
        raise ValueError(
            f"MTP loss: got {len(outputs)} per-depth outputs and {len(targets)} targets; need D >= 1 of each"
        )
    per_depth = [
        loss_fn(output if project is None else project(output), target)
        for output, target in zip(outputs, targets, strict=True)
    ]
    return MTPLossOutput(torch.stack(per_depth).sum() * scaling_factor / len(per_depth), per_depth)
