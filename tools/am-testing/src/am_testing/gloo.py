"""Launch a real gloo process group ONCE per test module and run many named cases inside it.

`run_group(world_size, worker, preload=...)` starts `world_size` processes that each run `worker(rank, world_size)`
inside an initialized gloo group; each returns a dict of per-case results (`run_cases` builds it). A case that raises
is recorded with its traceback, so each pytest test fails on its own case (`case_result`); a rank that crashes or
hangs fails the whole module after at most `timeout` seconds: never a hang. The error names, for every rank, the
case it was in (or that it had not started one, or had finished them) and shows its traceback, or the stack of a
rank that was stopped. A case may also have a deadline of its own (`run_cases(..., timeout=...)`). Collectives time
out after `PG_TIMEOUT_S`, so a desynchronized case turns into an error on every rank.

Ranks fork from a forkserver that has imported `preload` once (spawning costs ~5-10 s of imports per rank on a busy
2-core machine; forking pytest itself is unsafe once it has run OpenMP kernels). The rendezvous folder is removed
afterwards.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib.util
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT_S = 90  # a desynchronized collective fails after this long instead of hanging


class CaseError:
    """A case that raised on a rank: carries the formatted traceback back to the test."""

    def __init__(self, text: str) -> None:
        self.text = text


# Set in a rank process by `_entry`: the file naming the case the rank is in, and the file its stacks are written to
# (on a case's own deadline, or on SIGUSR1 from run_group); run_group reads both when the group fails.
_case_file: str | None = None
_stack_file: TextIO | None = None


def _mark(text: str) -> None:
    if _case_file is not None:
        with open(_case_file, "w") as f:
            f.write(text)


def run_cases(
    cases: dict[str, Callable[[], Any]], *, timeout: float | None = None, stop_after_failure: bool = False
) -> dict[str, Any]:
    """Run each case in order (every rank runs the same cases), recording its result or its traceback.

    Args:
        cases: name -> a function of no arguments; its return value must be picklable.
        timeout: seconds each case may take on this rank. A case past it stops the rank (its stack is written
            out first; a call blocked inside a collective is stopped too), and `run_group` fails naming the case.
            None: only `run_group`'s deadline for the whole group applies.
        stop_after_failure: after each case the ranks agree (one all-reduce) whether any of them failed; from the
            first failure on, the remaining cases are recorded as not run. For cases that exchange point-to-point
            messages (pipeline schedules), where a message left unmatched by a failed case would reach the next one.
    """
    results: dict[str, Any] = {}
    failed_before: str | None = None
    for name, case in cases.items():
        if failed_before is not None:
            results[name] = CaseError(f"not run: case {failed_before!r} failed before it on some rank")
            continue
        _mark(f"in case {name!r}")
        if timeout is not None:
            # faulthandler's watchdog is a C thread: it fires even while the case blocks in C++ (a gloo wait).
            faulthandler.dump_traceback_later(timeout, exit=True, file=_stack_file or sys.stderr)
        try:
            results[name] = case()
        except Exception:  # recorded, not swallowed: case_result raises it with this traceback in the test
            results[name] = CaseError(traceback.format_exc())
        finally:
            faulthandler.cancel_dump_traceback_later()
        if stop_after_failure:
            flag = torch.tensor([1.0 if isinstance(results[name], CaseError) else 0.0])
            dist.all_reduce(flag)
            if flag.item() > 0:
                failed_before = name
    _mark("after its last case")
    return results


def case_result(results: list[dict[str, Any]], name: str, rank: int) -> Any:
    """The value case `name` returned on `rank`; AssertionError with the rank's traceback if it raised."""
    value = results[rank][name]
    if isinstance(value, CaseError):
        raise AssertionError(f"case {name!r} raised on rank {rank}:\n{value.text}")
    return value


class _PortableWorker:
    """A worker pickled together with the files of the test modules it refers to.

    pytest's `--import-mode=importlib` (packages/pytest.ini, so that `pytest packages/` collects every package's
    tests at once) names a test module after its path (`am-moe.tests.test_parallel`), a name no other process can
    import; a rank loads such a module from its file under the same name before unpickling the worker.
    """

    def __init__(self, worker: Callable[[int, int], dict[str, Any]]) -> None:
        self.payload = pickle.dumps(worker)
        self.path_named_modules = {
            name: module.__file__
            for name, module in list(sys.modules.items())
            if not all(part.isidentifier() for part in name.split(".")) and getattr(module, "__file__", None)
        }

    def load(self) -> Callable[[int, int], dict[str, Any]]:
        for name, file in self.path_named_modules.items():
            parts = name.split(".")
            for depth in range(1, len(parts)):  # importing a dotted name needs its parents in sys.modules
                sys.modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
            if name not in sys.modules:
                spec = importlib.util.spec_from_file_location(name, file)
                if spec is None or spec.loader is None:
                    raise ImportError(f"cannot load the test module {name!r} from {file}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
        return pickle.loads(self.payload)


def _entry(portable: _PortableWorker, rank: int, world_size: int, folder: str) -> None:
    global _case_file, _stack_file
    torch.set_num_threads(1)  # 2 cores shared by all ranks (and other test suites)
    _case_file = os.path.join(folder, f"case{rank}.txt")
    _mark("before its first case")
    _stack_file = open(os.path.join(folder, f"stack{rank}.txt"), "w")  # noqa: SIM115 (open as long as the rank)
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    try:
        worker = portable.load()
        dist.init_process_group(
            "gloo",
            init_method=f"file://{folder}/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        result = worker(rank, world_size)
        torch.save(result, os.path.join(folder, f"result{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(folder, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_group(
    world_size: int,
    worker: Callable[[int, int], dict[str, Any]],
    *,
    preload: Sequence[str] = ("torch", "torch.distributed"),
    timeout: float = 240.0,
) -> list[Any]:
    """Spawn a gloo group of `world_size` ranks running `worker` (a picklable module-level function or a
    `functools.partial` of one); return each rank's result dict, rank order.

    Raises RuntimeError naming the reason (exit codes, or the timeout) and, for every rank, the case it was in
    with its traceback or, for a rank stopped while running, its stack.
    """
    folder = tempfile.mkdtemp(prefix="am_gloo_")
    try:
        portable = _PortableWorker(worker)
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(list(preload))
        procs = [
            context.Process(target=_entry, args=(portable, rank, world_size, folder)) for rank in range(world_size)
        ]
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
        stuck = [p for p in procs if p.is_alive()]
        # Read where each rank is before signalling: SIGUSR1 can interrupt a blocked collective, which then raises and
        # lets the rank move on before it is killed.
        wheres = [_read(folder, f"case{rank}.txt") or "before it started" for rank in range(world_size)]
        for proc in stuck:
            if proc.pid is not None:
                os.kill(proc.pid, signal.SIGUSR1)  # faulthandler writes the rank's stack before it is killed
        if stuck:
            time.sleep(1.0)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        if timed_out or failed or any(p.exitcode != 0 for p in procs):
            reason = f"timed out after {timeout} s" if timed_out else f"exit codes {[p.exitcode for p in procs]}"
            ranks = "\n".join(
                _rank_report(folder, rank, wheres[rank], procs[rank], procs[rank] in stuck)
                for rank in range(world_size)
            )
            raise RuntimeError(f"process group of {world_size} ranks failed ({reason}):\n{ranks}")
        return [torch.load(os.path.join(folder, f"result{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _read(folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read().strip()


def _rank_report(folder: str, rank: int, where: str, proc: Any, stopped: bool) -> str:
    """One rank's part of run_group's error: where it was (in which case), then its traceback or its stack."""
    state = "stopped" if stopped else f"exit code {proc.exitcode}"
    detail = _read(folder, f"error{rank}.txt") or _read(folder, f"stack{rank}.txt")
    return f"--- rank {rank} ({state}) {where} ---\n{detail}"
