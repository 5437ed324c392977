"""Counters of what the ring attention sends and computes on this rank (`count_ring_bytes`).

What it is for: benchmarks and tests predict the bytes a configuration sends (a sliding layer fetches only the ranks
its window reaches) and check the prediction; `record` is called by the ring's setup and transfers.
What it must not do: communicate, or cost anything when no counter is open.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["RingCommStats", "count_ring_bytes"]


@dataclass
class RingCommStats:
    """Bytes this rank sent and chunks it computed, summed over the ring attention calls inside `count_ring_bytes`.

    metadata_bytes: the header, positions and doc ids this rank contributed to the setup all-gathers (once per
    `RingAttentionContext`, or per call of the standalone `ring_attention`). calls: attention calls;
    setup_gathers: calls that ran the setup all-gathers (1 per context; every call of the standalone function).
    """

    forward_kv_bytes: int = 0
    backward_kv_bytes: int = 0
    backward_grad_bytes: int = 0
    metadata_bytes: int = 0
    chunks_computed: int = 0
    chunks_skipped: int = 0
    calls: int = 0
    setup_gathers: int = 0

    @property
    def total_bytes(self) -> int:
        return self.forward_kv_bytes + self.backward_kv_bytes + self.backward_grad_bytes + self.metadata_bytes


_active_stats: list[RingCommStats] = []


@contextmanager
def count_ring_bytes() -> Iterator[RingCommStats]:
    """Count what `ring_attention` sends from this rank while the context is open (nesting allowed)."""
    stats = RingCommStats()
    _active_stats.append(stats)
    try:
        yield stats
    finally:
        _active_stats.remove(stats)


def record(**increments: int) -> None:
    """Add `increments` (field name → amount) to every open counter."""
    for stats in _active_stats:
        for name, value in increments.items():
            setattr(stats, name, getattr(stats, name) + value)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
