"""Launch a real gloo process group ONCE per test module and run many named cases inside it.

`run_group(world_size, worker, preload=...)` starts `world_size` processes that each run `worker(rank, world_size)`
inside an initialized gloo group; each returns a dict of per-case results (`run_cases` builds it). A case that raises
is recorded with its traceback, so each pytest test fails on its own case (`case_result`); a rank that crashes or
hangs fails the whole module with every rank's traceback after at most `timeout` seconds: never a hang. Collectives
time out after `PG_TIMEOUT_S`, so a desynchronized case turns into an error on every rank.

Ranks fork from a forkserver that has imported `preload` once (spawning costs ~5-10 s of imports per rank on a busy
2-core machine; forking pytest itself is unsafe once it has run OpenMP kernels). The rendezvous folder is removed
afterwards.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT_S = 90  # a desynchronized collective fails after this long instead of hanging


class CaseError:
    """A case that raised on a rank: carries the formatted traceback back to the test."""

    def __init__(self, text: str) -> None:
        self.text = text


def run_cases(cases: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each case in order (every rank runs the same cases), recording its result or its traceback."""
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception:
            results[name] = CaseError(traceback.format_exc())
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
    torch.set_num_threads(1)  # 2 cores shared by all ranks (and other test suites)
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

    Raises RuntimeError naming the reason (exit codes, or the timeout) with every rank's traceback.
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
        return [torch.load(os.path.join(folder, f"result{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
