"""Launch real gloo ranks once per test module and run many named cases inside the same process group.

Each rank runs every case in order, catches its exceptions, and writes `{case: {"ok", "message"}}` to a JSON file
after each case, so the parent learns what finished even if a rank dies. After each case the ranks agree (an
all-reduce under the process-group timeout) on whether anyone failed; after a failure the remaining cases are
marked "not run", because unmatched point-to-point messages could poison them. The parent joins with a deadline
and kills stragglers: a broken case fails its test, it never hangs the suite.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 45
"""Per-collective timeout inside the ranks: a peer that died or diverged turns into an error, not a hang."""

CASE_TIMEOUT_S = int(os.environ.get("AM_PP_CASE_TIMEOUT_S", "90"))
"""Watchdog per case: a rank stuck longer dumps every thread's stack to its hang file and exits (point-to-point
waits are not always covered by the process-group timeout). Cases take well under 10 s each."""

_HUNG = "HUNG: no result within the case watchdog; stacks of this rank:\n"


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, cases_ref: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results: dict[str, dict[str, Any]] = {}
    path = os.path.join(out_dir, f"rank{rank}.json")
    hang_file = open(os.path.join(out_dir, f"rank{rank}.hang.txt"), "w")  # noqa: SIM115 - lives as long as the rank

    def flush() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        module_name, function_name = cases_ref.split(":")
        cases: dict[str, Callable[[], Any]] = getattr(importlib.import_module(module_name), function_name)()
        failed_before: str | None = None
        for name, case in cases.items():
            if failed_before is not None:
                results[name] = {"ok": False, "message": f"not run: case {failed_before!r} failed before it"}
                continue
            start = time.perf_counter()
            results[name] = {"ok": False, "message": _HUNG}
            flush()
            faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True, file=hang_file)
            try:
                case()
                results[name] = {"ok": True, "message": f"{time.perf_counter() - start:.2f}s"}
            except Exception:
                results[name] = {"ok": False, "message": traceback.format_exc()}
            finally:
                faulthandler.cancel_dump_traceback_later()
            flush()
            flag = torch.tensor([0.0 if results[name]["ok"] else 1.0])
            try:
                dist.all_reduce(flag)
            except Exception:
                flag = torch.tensor([1.0])
            if flag.item() > 0:
                failed_before = name
        flush()
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results["<setup>"] = {"ok": False, "message": traceback.format_exc()}
        flush()
        raise


def run_ranks(world_size: int, cases_ref: str, *, deadline_s: float = 300.0) -> dict[int, dict[str, Any]]:
    """Run `module:function` (returning {case name: callable}) on `world_size` gloo ranks; results per rank."""
    out_dir = tempfile.mkdtemp(prefix="am_pp_ranks_")
    init_file = os.path.join(out_dir, "store")
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=_worker, args=(rank, world_size, init_file, out_dir, cases_ref), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    end = time.monotonic() + deadline_s
    for process in processes:
        process.join(timeout=max(0.0, end - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)
    results: dict[int, dict[str, Any]] = {}
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[rank] = json.load(f)
        else:
            results[rank] = {}
        hang_path = os.path.join(out_dir, f"rank{rank}.hang.txt")
        stacks = open(hang_path).read() if os.path.exists(hang_path) else ""  # noqa: SIM115
        for entry in results[rank].values():
            if entry["message"] == _HUNG:
                entry["message"] += stacks or "(no stack dump: the rank was killed at the deadline)"
        results[rank]["<exitcode>"] = processes[rank].exitcode
    return results


def assert_case(results: dict[int, dict[str, Any]], name: str) -> None:
    """Fail with every rank's message unless the case passed on all ranks."""
    problems = []
    for rank, per_case in sorted(results.items()):
        entry = per_case.get(name)
        if entry is None:
            setup = per_case.get("<setup>", {}).get("message", "")
            problems.append(
                f"rank {rank}: case did not report (exit code {per_case.get('<exitcode>')}, killed at the deadline "
                f"or crashed) {setup}"
            )
        elif not entry["ok"]:
            problems.append(f"rank {rank}: {entry['message']}")
    if problems:
        raise AssertionError(f"case {name!r} failed:\n" + "\n".join(problems))
