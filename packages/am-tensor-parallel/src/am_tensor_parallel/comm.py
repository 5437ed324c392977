"""Count the bytes this rank's tensor-parallel collectives move, by kind, around any code (a forward + backward).

A `TorchDispatchMode` sees every collective DTensor issues (functional collectives) and the direct ones of this
package's styles and loss (`c10d` all-reduce); it counts each one's local tensor bytes and records nothing else.
Diagnostics for the benchmark and tests; not meant to stay on during training.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveBytes", "count_collective_bytes"]

_KINDS = {
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


@dataclass
class CollectiveBytes:
    """Bytes of the tensor each collective was called with on this rank (its input; for an all-gather the local
    shard, for a reduce-scatter the full input), summed per kind, and the number of calls per kind."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def total(self) -> int:
        return sum(self.bytes.values())


class _Counter(TorchDispatchMode):
    def __init__(self, stats: CollectiveBytes) -> None:
        super().__init__()
        self.stats = stats

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name.split("::")[-1]
        kind = _KINDS.get(name)
        if kind is not None:
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            self.stats.bytes[kind] = self.stats.bytes.get(kind, 0) + size
            self.stats.calls[kind] = self.stats.calls.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_collective_bytes() -> Iterator[CollectiveBytes]:
    """`with count_collective_bytes() as stats: loss.backward()` -> `stats.bytes == {"all_reduce": ..., ...}`."""
    stats = CollectiveBytes()
    with _Counter(stats):
        yield stats
