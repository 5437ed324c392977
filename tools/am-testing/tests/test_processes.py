"""`run_processes`: every process's exit code and output come back; a run past its deadline is stopped whole (also
the processes a child started in a session of its own, as torchrun does) and the error names the run and shows the
stopped processes' Python stacks."""

from __future__ import annotations

import os
import sys
import time

import pytest

from am_testing import DeadlineExceeded, run_process, run_processes

# A child that starts a grandchild in its own session (torchrun's workers), prints its pid, and both sleep.
_TREE = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(f"pid of the grandchild: {grandchild.pid}", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")  # a zombie has exited
    except OSError:
        return False


def test_each_process_gets_its_environment_and_reports_code_and_output() -> None:
    code = "import os, sys; print('rank', os.environ['RANK']); sys.exit(int(os.environ['RANK']) + 3)"
    envs = [{**os.environ, "RANK": str(rank)} for rank in range(2)]
    done = run_processes([[sys.executable, "-c", code]] * 2, name="two ranks", deadline_s=60, env=envs)
    assert [d.returncode for d in done] == [3, 4]
    assert [d.output.strip() for d in done] == ["rank 0", "rank 1"]
    assert done[0].command == [sys.executable, "-c", code]


def test_a_run_past_its_deadline_is_stopped_whole_and_named(tmp_path) -> None:
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as caught:
        run_process([sys.executable, "-c", _TREE], name="sleepy-config", deadline_s=3, cwd=tmp_path)
    assert time.monotonic() - started < 30
    message = str(caught.value)
    assert "run 'sleepy-config' passed its deadline of 3 s" in message
    assert "stopped at the deadline" in message
    assert "time.sleep" in message or "File " in message, message  # the stopped process's Python stack
    grandchild = int(message.split("pid of the grandchild: ")[-1].split()[0])
    assert not _alive(grandchild), "the grandchild (own session) outlived the run"
    assert not list(tmp_path.iterdir()), "no core file or other leftover in the working directory"


def test_wrong_number_of_environments_is_refused() -> None:
    with pytest.raises(ValueError, match="2 environments for 1 commands"):
        run_processes([[sys.executable, "-c", "pass"]], name="x", deadline_s=10, env=[{}, {}])
