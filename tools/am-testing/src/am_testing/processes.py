"""Run whole programs (the reference trainer under torchrun, or ranks started by hand) with a deadline.

`run_processes(commands, name=..., deadline_s=...)` starts one process per command, waits for all of them, and
returns each one's exit code and output. A run still going at its deadline is stopped with every process it started
(torchrun puts its workers in sessions of their own, so the run's processes are found through /proc, not a process
group: every process below the started ones, and every process that inherited the run's `AM_TESTING_RUN` tag in its
environment, which also finds one already re-parented away from the tree) and `DeadlineExceeded` is raised naming
the run, its commands and each process's output tail, which holds the Python stack of every process that was stopped:
the processes run with `PYTHONFAULTHANDLER=1` and are stopped with SIGABRT first, which makes Python print every
thread's stack. Never a hang, never a process left behind (the call returns once every one has ended).

Output goes to files, not pipes, so a chatty process can never block on a full pipe.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

OUTPUT_TAIL_CHARS = 6000  # of each process's output, in DeadlineExceeded's message
_STOP_GRACE_S = 3.0  # after SIGABRT, for the stacks to be written, before SIGKILL
_GONE_WAIT_S = 10.0  # after SIGKILL, for the kernel to end every process (a loaded machine takes a moment)
_RUN_TAG = "AM_TESTING_RUN"  # environment variable each process of a run inherits; its value names the run


@dataclass(frozen=True)
class Finished:
    """One process of a run that ended by itself: its command, exit code (negative: killed by that signal), its
    stdout and stderr interleaved as written, and its wall time."""

    command: list[str]
    returncode: int
    output: str
    wall_s: float


class DeadlineExceeded(RuntimeError):
    """A run was still going at its deadline; it was stopped, and the message names it and shows each process's
    output tail (with the stacks of the processes that were stopped)."""


def _no_core_dumps() -> None:
    """In the child before exec: SIGABRT must not leave core files in the working directory."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc; any thread's children)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return found


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it, parents first."""
    order, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        order.append(current)
        todo.extend(_children(current))
    return order


def _tagged(tag: str) -> list[int]:
    """Every process whose environment carries `AM_TESTING_RUN=tag` (this user's; others' environ is unreadable)."""
    marker = f"{_RUN_TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # ended meanwhile, or not ours
            continue
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie has ended; only its exit status waits for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, sig)


def _stop(procs: Sequence[subprocess.Popen[bytes]], tag: str) -> None:
    """SIGABRT every process of the run (stacks written by faulthandler), then SIGKILL what is left and wait until
    every one has ended, so that none outlives the call."""

    def members() -> list[int]:
        tree = [pid for proc in procs if proc.poll() is None for pid in _tree(proc.pid)]
        return sorted({*tree, *_tagged(tag)} - {os.getpid()})

    pids = members()
    _signal_all(pids, signal.SIGABRT)
    stop_by = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < stop_by and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    # Children of a process that already died were re-parented away from the tree: kill every pid seen or tagged.
    gone_by = time.monotonic() + _GONE_WAIT_S
    while True:
        left = [pid for pid in {*pids, *members()} if _alive(pid)]
        _signal_all(left, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)
        if not left or time.monotonic() > gone_by:
            break
        time.sleep(0.05)
    for proc in procs:
        proc.wait()


def run_processes(
    commands: Sequence[Sequence[str]],
    *,
    name: str,
    deadline_s: float,
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> list[Finished]:
    """Start one process per command, all at once, and wait for every one of them, at most `deadline_s` seconds.

    Args:
        commands: each an argv list (`[sys.executable, "-m", "torch.distributed.run", ...]`).
        name: how errors name this run (e.g. the configuration's name).
        deadline_s: seconds from the start until the whole run is stopped.
        env: the environment of every process, or one per command; None: this process's environment.
            `PYTHONFAULTHANDLER=1` is added to each (stacks on SIGABRT).
        cwd: working directory of every process.

    Returns:
        One `Finished` per command, in order.

    Raises:
        DeadlineExceeded: a process was still running at the deadline (every process of the run is stopped first).
        ValueError: `env` is a sequence whose length differs from `commands`', or `commands` is empty.
    """
    if not commands:
        raise ValueError(f"run {name!r}: no commands to run")
    if env is None or isinstance(env, Mapping):
        envs: list[Mapping[str, str]] = [env if env is not None else os.environ] * len(commands)
    else:
        envs = list(env)
        if len(envs) != len(commands):
            raise ValueError(f"run {name!r}: {len(envs)} environments for {len(commands)} commands; pass one each")
    tag = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="am_run_") as folder:
        logs = [Path(folder) / f"process{i}.log" for i in range(len(commands))]
        procs: list[subprocess.Popen[bytes]] = []
        started = time.perf_counter()
        try:
            for command, environment, log in zip(commands, envs, logs, strict=True):
                with open(log, "wb") as sink:  # the child keeps its own descriptor
                    procs.append(
                        subprocess.Popen(
                            list(command),
                            stdout=sink,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            env={**environment, "PYTHONFAULTHANDLER": "1", _RUN_TAG: tag},
                            cwd=cwd,
                            preexec_fn=_no_core_dumps,
                        )
                    )
            deadline = time.monotonic() + deadline_s
            while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
            late = [i for i, proc in enumerate(procs) if proc.poll() is None]
        finally:
            # Also on KeyboardInterrupt or a failed start: nothing of the run outlives this call.
            if any(proc.poll() is None for proc in procs):
                _stop(procs, tag)
        wall_s = time.perf_counter() - started
        outputs = [log.read_bytes().decode(errors="replace") for log in logs]
    if late:
        parts = [
            f"--- process {i} ({'stopped at the deadline' if i in late else f'exit code {procs[i].returncode}'}): "
            f"{' '.join(commands[i])}\n{outputs[i][-OUTPUT_TAIL_CHARS:]}"
            for i in range(len(commands))
        ]
        raise DeadlineExceeded(
            f"run {name!r} passed its deadline of {deadline_s:g} s (processes {late} still running); every process "
            "was stopped. Output of each (a stopped process ends with its Python stacks):\n" + "\n".join(parts)
        )
    return [
        Finished(list(command), int(proc.returncode), output, wall_s)
        for command, proc, output in zip(commands, procs, outputs, strict=True)
    ]


def run_process(
    command: Sequence[str],
    *,
    name: str,
    deadline_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Finished:
    """`run_processes` of one command (e.g. torchrun, which starts and watches the ranks itself)."""
    (finished,) = run_processes([command], name=name, deadline_s=deadline_s, env=env, cwd=cwd)
    return finished
