"""Multi-rank test helpers of am-context-parallel (and a dense reference attention).

am_testing's gloo harness (one process group per test module, many cases inside) with this package's imports
preloaded in the forkserver the ranks fork from."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from am_testing import case_result, run_cases
from am_testing import run_group as _run_group

__all__ = ["case_result", "reference_attention", "run_cases", "run_group"]

PRELOAD = ("torch", "torch.distributed", "am_context_parallel")


def run_group(world_size: int, worker: Callable[[int, int], dict[str, Any]], *, timeout: float = 240.0) -> list[Any]:
    """`worker(rank, world_size)` on `world_size` gloo ranks; each rank's result dict (see am_testing.gloo)."""
    return _run_group(world_size, worker, preload=PRELOAD, timeout=timeout)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None,
    causal: bool,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Dense fp64 attention on the UNSHARDED sequence: token i's position is i; rows with no key give 0."""
    s = q.shape[2]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    query_pos = torch.arange(s).view(s, 1)
    key_pos = torch.arange(s).view(1, s)
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed &= key_pos <= query_pos
    if window is not None:
        distance = query_pos - key_pos
        allowed &= distance < window if causal else distance.abs() < window
    allowed = allowed.expand(q.shape[0], 1, s, s)
    if doc_ids is not None:
        same_doc = (doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)) & (doc_ids > 0).unsqueeze(2)
        allowed = allowed & same_doc.unsqueeze(1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf rows -> NaN -> 0
    return probs @ v
