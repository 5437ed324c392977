"""Test-only hooks of the reference trainer, switched on by environment variables (never by an option).

What it is for: `AM_TRAIN_FAIL_AT_STEP=<step> AM_TRAIN_FAIL_RANK=<rank> AM_TRAIN_FAIL_MODE=raise|sigkill` makes that
rank raise (or SIGKILL itself) when the step starts (`maybe_inject_fault`: the fault tests); `AM_TRAIN_FP32_REPORT=
<folder>` makes every rank write its fp32-pinned tensors after the FSDP2 wrap (`dump_fp32_tensors`: the fp32
contract's test); `AM_TRAIN_MEMORY_REPORT=<folder>` makes every rank write the kernel's count of its peak resident
memory while the model was built and materialized (`BuildMemory`: the real-size test of issue 23).
What it must not do: change a run in which these variables are unset.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


def maybe_inject_fault(step: int, rank: int) -> None:
    if os.environ.get("AM_TRAIN_FAIL_AT_STEP") != str(step) or os.environ.get("AM_TRAIN_FAIL_RANK", "0") != str(rank):
        return
    print(f"[rank {rank}] injecting a fault at step {step}, time {time.time():.3f}", file=sys.stderr, flush=True)
    if os.environ.get("AM_TRAIN_FAIL_MODE", "raise") == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault on rank {rank} at step {step} (AM_TRAIN_FAIL_AT_STEP)")


def dump_fp32_tensors(parts: list[nn.Module], folder: str, rank: int, *, storage_dtype: torch.dtype) -> None:
    """Write this rank's fp32-pinned tensors (full values, gathered from their FSDP2 shards), their dtypes, and the
    fp32 contract's violations (am-precision's report, unpinned tensors checked against `storage_dtype`)."""
    from torch.distributed.tensor import DTensor

    from am_precision import fp32_report

    facts: dict[str, Any] = {"_violations": []}
    for part in parts:
        report = fp32_report(part, storage_dtype=storage_dtype)
        tensors = dict(part.named_parameters()) | dict(part.named_buffers())
        for entry in report.entries:
            if entry.rule is None:
                continue
            tensor = tensors[entry.name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            facts[entry.name] = {
                "dtype": str(tensor.dtype),
                "dtensor": isinstance(tensor, DTensor),
                "value": full.detach().cpu().clone(),
            }
        facts["_violations"] += [str(v.name) for v in report.violations]
    Path(folder).mkdir(parents=True, exist_ok=True)
    torch.save(facts, Path(folder) / f"fp32_rank{rank}.pt")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class BuildMemory:
    """With `AM_TRAIN_MEMORY_REPORT=<folder>`: `start()` resets the kernel's peak resident set (VmHWM, via
    /proc/self/clear_refs) to the current one before the build; `finish(parts, rank, checkpoint_bytes_read=...)`
    writes `memory_rank{rank}.json`: the resident KiB at the start, the peak KiB since (the kernel counts every page:
    Python, torch and the allocator alike), this rank's local tensor bytes and the tensor bytes it read from a
    `--model-path` folder. Linux only; a no-op otherwise."""

    def __init__(self) -> None:
        self.folder = os.environ.get("AM_TRAIN_MEMORY_REPORT")
        self.start_kib = 0

    def start(self) -> None:
        if self.folder:
            Path("/proc/self/clear_refs").write_text("5")
            self.start_kib = _status_kib("VmRSS")

    def finish(self, parts: list[nn.Module], rank: int, *, checkpoint_bytes_read: int = 0) -> None:
        if not self.folder:
            return
        import json

        from trainer.step_memory import local_numel

        tensors = [tensor for part in parts for tensor in [*part.parameters(), *part.buffers()]]
        local = sum(local_numel(tensor) * tensor.element_size() for tensor in tensors)
        facts = {
            "rss_start_kib": self.start_kib,
            "hwm_kib": _status_kib("VmHWM"),
            "local_tensor_bytes": local,
            "checkpoint_bytes_read": checkpoint_bytes_read,
        }
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        (Path(self.folder) / f"memory_rank{rank}.json").write_text(json.dumps(facts))


__all__ = ["BuildMemory", "dump_fp32_tensors", "maybe_inject_fault"]
