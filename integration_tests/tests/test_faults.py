"""No hangs: a rank that raises makes every rank exit, with a clear error, within 60 s of the fault."""

from __future__ import annotations

import re
import time

from conftest import PARITY, launch

FAULT_TO_EXIT_LIMIT_S = 60.0


def test_a_raising_rank_ends_every_rank_with_a_clear_error(tmp_path) -> None:
    env = {"AM_TRAIN_FAIL_AT_STEP": "2", "AM_TRAIN_FAIL_RANK": "1", "AM_TRAIN_FAIL_MODE": "raise"}
    run = launch(["--model", "llama", "--pp", "2", *PARITY], nproc=2, out=tmp_path / "fault", env=env)
    ended = time.time()
    assert run.returncode != 0, run.output[-3000:]
    assert "RuntimeError: injected fault on rank 1 at step 2" in run.output, run.output[-3000:]
    injected = re.search(r"\[rank 1\] injecting a fault at step 2, time ([0-9.]+)", run.output)
    assert injected is not None, run.output[-3000:]
    assert ended - float(injected.group(1)) < FAULT_TO_EXIT_LIMIT_S
    assert not (tmp_path / "fault" / "summary.json").exists()
