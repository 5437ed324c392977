"""Multi-rank test helper of am-moe: am_testing's gloo harness (one process group per test module, many cases
inside) with this package's imports preloaded, plus a folder the ranks share for files they write (checkpoints)."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from typing import Any

from am_testing import case_result, run_cases
from am_testing import run_group as _run_group

__all__ = ["case_result", "run_cases", "run_group"]

PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "pytest", "am_moe")


def run_group(
    world_size: int, worker: Callable[..., dict[str, Any]], *, timeout: float = 240.0
) -> tuple[list[Any], str]:
    """`worker(rank, world_size, folder)` on `world_size` gloo ranks; each rank's result dict and `folder`, a
    temporary folder every rank sees (the caller reads what the ranks wrote there, e.g. a DCP checkpoint)."""
    folder = tempfile.mkdtemp(prefix="am_moe_")
    return _run_group(world_size, functools.partial(worker, folder=folder), preload=PRELOAD, timeout=timeout), folder
