"""Tied input/output embeddings under pipeline parallelism.

When `lm_head.weight is embed_tokens.weight` and the two land on different stages, each stage holds its own copy
(same initial values). Training matches the unsplit tied model if, after every backward and before the optimizer
step, both copies receive the SUM of their gradients — the embedding-gradient all-reduce Megatron does between the
first and last stage. `sync_tied_embedding_grads` does that over a two-rank process group created once at split
time (or in-process when both stages live on the same rank, as with V-shaped schedules). When both modules land on
the same stage they stay tied by identity and nothing needs syncing.

This module never imports transformers and uses only public torch.distributed APIs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TiedEmbeddingCopy", "sync_tied_embedding_grads", "sync_tied_embedding_weights", "tied_embedding_copies"]

# pair -> (the default process group it was made under, the pair's group)
_PAIR_GROUPS: dict[tuple[int, int], tuple[Any, Any]] = {}


@dataclass
class TiedEmbeddingCopy:
    """One stage's copy of a tied embedding weight.

    Attributes:
        param_name: the parameter's name inside the stage module (e.g. "model.embed_tokens.weight").
        role: "input" (embedding, first stage) or "output" (lm_head, last stage).
        first_rank / last_rank: global ranks holding the input and output copies.
        group: process group of those two ranks, None when they are the same rank.
    """

    param_name: str
    role: str
    first_rank: int
    last_rank: int
    group: Any = None


def pair_group(first_rank: int, last_rank: int) -> Any:
    """The process group of this rank's first/last-stage ranks, created once.

    Collective over the default group (every rank calls it, as every rank splits its model): the pairs of all
    pipeline replicas are gathered and every rank creates every pair group in the same order. Creating the group
    only on its two members (`use_local_synchronization=True`) would advance torch's group counter on some ranks
    only, and the next `new_group`/`init_device_mesh` on the other ranks would hang.

    Returns:
        the group, or None when both copies live on this one rank.
    """
    key = (min(first_rank, last_rank), max(first_rank, last_rank)) if first_rank != last_rank else None
    pairs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, key)
    world = dist.distributed_c10d._get_default_group()
    for pair in sorted({tuple(p) for p in pairs if p is not None}):
        # A group cached under an earlier default process group (destroyed since: e.g. a dry run's fake one) is made
        # again. Decided by the default group, which every rank shares, never by the pair group itself: on a rank
        # outside the pair that is NON_GROUP_MEMBER, and a per-rank answer would make new_group calls diverge.
        cached = _PAIR_GROUPS.get(pair)
        if cached is None or cached[0] is not world:
            _PAIR_GROUPS[pair] = (world, dist.new_group(ranks=list(pair)))
    return _PAIR_GROUPS[key][1] if key is not None else None


def tied_embedding_copies(models: Iterable[nn.Module]) -> list[tuple[nn.Module, TiedEmbeddingCopy]]:
    """The tied-embedding copies held by this rank's stage modules."""
    found = []
    for model in models:
        copy = getattr(model, "_pp_tied_embedding", None)
        if isinstance(copy, TiedEmbeddingCopy):
            found.append((model, copy))
    return found


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # FSDP2 DTensor: both copies are sharded the same way
    return to_local() if callable(to_local) else tensor


@torch.no_grad()
def sync_tied_embedding_grads(models: Iterable[nn.Module]) -> int:
    """Sum the gradients of the two copies of each tied embedding, so both hold the tied model's gradient.

    Call it on every rank of the pipeline after `schedule.step()` and before `optimizer.step()` (AutoPipeline.step
    does it for you). Ranks without a copy return at once. A copy without a gradient contributes zeros.

    Returns:
        the number of copies synced on this rank.
    """
    copies = tied_embedding_copies(models)
    params = [(dict(model.named_parameters())[copy.param_name], copy) for model, copy in copies]
    grads: dict[int, torch.Tensor] = {}
    for param, _ in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads[id(param)] = param.grad
    local_pairs = [(p, c) for p, c in params if c.group is None]
    if local_pairs:
        if len(local_pairs) != 2:
            raise RuntimeError(
                f"Expected both tied-embedding copies on this rank, found {len(local_pairs)}; the stage placement "
                "changed after splitting."
            )
        total = grads[id(local_pairs[0][0])] + grads[id(local_pairs[1][0])]
        for param, _ in local_pairs:
            grads[id(param)].copy_(total)
    for param, copy in params:
        if copy.group is not None:
            dist.all_reduce(_local(grads[id(param)]), op=dist.ReduceOp.SUM, group=copy.group)
    return len(params)


@torch.no_grad()
def sync_tied_embedding_weights(models: Iterable[nn.Module]) -> int:
    """Copy the input embedding's values into the output copy (after materializing a meta-device model).

    Returns:
        the number of copies touched on this rank.
    """
    copies = tied_embedding_copies(models)
    params = [(dict(model.named_parameters())[copy.param_name], copy) for model, copy in copies]
    local = [(p, c) for p, c in params if c.group is None]
    if len(local) == 2:
        source = next(p for p, c in local if c.role == "input")
        target = next(p for p, c in local if c.role == "output")
        target.copy_(source)
    for param, copy in params:
        if copy.group is not None:
            dist.broadcast(_local(param), src=copy.first_rank, group=copy.group)
    return len(params)
