"""Test helpers: launch a real gloo process group ONCE per test module and collect per-case results.

`run_group(world_size, worker)` spawns `world_size` processes that each run `worker(rank, world_size, folder)` in an
initialized gloo group and return a dict of per-case results. A case that raises is recorded with its traceback so
each pytest test fails on its own case; a rank that crashes or hangs fails the module with every rank's traceback
after at most `timeout` seconds — never a hang.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT_S = 60  # a desynchronized collective fails after this long instead of hanging


class CaseError:
    """A case that raised on a rank: carries the formatted traceback back to the test."""

    def __init__(self, text: str) -> None:
        self.text = text


def run_cases(cases: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each case in order, recording its result or its traceback (every rank runs the same cases)."""
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception:
            results[name] = CaseError(traceback.format_exc())
    return results


def case_result(results: list[dict[str, Any]], name: str, rank: int) -> Any:
    value = results[rank][name]
    if isinstance(value, CaseError):
        raise AssertionError(f"case {name!r} raised on rank {rank}:\n{value.text}")
    return value


def _entry(worker: Callable[..., dict[str, Any]], rank: int, world_size: int, folder: str) -> None:
    torch.set_num_threads(1)  # 2 cores shared by all ranks (and other test suites)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{folder}/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        result = worker(rank, world_size, folder)
        torch.save(result, os.path.join(folder, f"result{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(folder, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_group(
    world_size: int, worker: Callable[[int, int, str], dict[str, Any]], *, timeout: float = 240.0
) -> tuple[list[Any], str]:
    """Spawn a gloo group of `world_size` ranks running `worker`; return each rank's result dict and the shared
    temporary folder (for files the ranks wrote, e.g. checkpoints)."""
    folder = tempfile.mkdtemp(prefix="am_moe_")
    # forkserver: torch is imported once by the server and each rank forks from it (spawning costs ~5-10 s of
    # imports per rank on a busy 2-core machine); forking pytest itself is unsafe once it has run OpenMP kernels.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "pytest", "am_moe"]
    )
    procs = [context.Process(target=_entry, args=(worker, rank, world_size, folder)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    failed = False
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            failed = True
            time.sleep(2.0)  # let the other ranks write their tracebacks
            break
        time.sleep(0.1)
    timed_out = any(p.is_alive() for p in procs) and not failed
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
    errors = []
    for rank in range(world_size):
        path = os.path.join(folder, f"error{rank}.txt")
        if os.path.exists(path):
            with open(path) as f:
                errors.append(f"--- rank {rank} ---\n{f.read()}")
    if timed_out or failed or any(p.exitcode != 0 for p in procs):
        reason = f"timed out after {timeout} s" if timed_out else f"exit codes {[p.exitcode for p in procs]}"
        raise RuntimeError(f"process group of {world_size} ranks failed ({reason}):\n" + "\n".join(errors))
    results = [torch.load(os.path.join(folder, f"result{rank}.pt"), weights_only=False) for rank in range(world_size)]
    return results, folder
