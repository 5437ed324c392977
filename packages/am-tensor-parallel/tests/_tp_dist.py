"""Multi-rank test helper of am-tensor-parallel: am_testing's gloo harness (one process group per test module,
many cases inside) with this package's imports preloaded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from am_testing import case_result, run_cases
from am_testing import run_group as _run_group

__all__ = ["case_result", "run_cases", "run_group"]

PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "transformers", "am_tensor_parallel")


def run_group(world_size: int, worker: Callable[..., dict[str, Any]], *, timeout: float = 300.0) -> list[Any]:
    """`worker(rank, world_size)` on `world_size` gloo ranks; each rank's result dict."""
    return _run_group(world_size, worker, preload=PRELOAD, timeout=timeout)
