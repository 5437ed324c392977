"""No hangs: a rank that raises makes every rank exit, with a clear error, within 60 s of the fault; a run whose loss
or gradient norm goes non-finite stops on every rank (exit code 3) and leaves `latest` at finite weights."""

from __future__ import annotations

import json
import re
import time

import torch
from conftest import PARITY, launch

FAULT_TO_EXIT_LIMIT_S = 60.0
EXIT_RUN_STOPPED = 3


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


def test_a_nan_run_skips_what_it_may_then_stops_on_every_rank_and_latest_stays_finite(tmp_path) -> None:
    """Issue 22 item 3, at pp = 2 (the loss lives on the last stage only): --lr 1e38 makes step 1's weights huge
    (finite) and every later gradient norm NaN. --skip-nonfinite-steps 1 drops step 2 (counted), step 3 stops the
    run with the step and the value named, exit code 3 on both ranks; `latest` names step 2, whose weights are
    step 1's (finite)."""
    args = [*PARITY, "--lr", "1e38", "--ckpt-every", "1", "--skip-nonfinite-steps", "1"]
    run = launch(["--model", "llama", "--pp", "2", *args], nproc=2, out=tmp_path / "nan")
    assert run.returncode != 0, run.output[-3000:]
    assert "warning: step 2: non-finite gradient norm nan; update skipped (1 of --skip-nonfinite-steps 1)" in (
        run.output
    ), run.output[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] error: step 3: non-finite gradient norm nan" in run.output, run.output[-3000:]
    assert f"exitcode  : {EXIT_RUN_STOPPED}" in run.output, run.output[-3000:]
    assert "--skip-nonfinite-steps 1 allowed 1 skipped step(s)" in run.output
    assert not (tmp_path / "nan" / "summary.json").exists()
    root = tmp_path / "nan" / "checkpoints"
    assert (root / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    state = json.loads((root / "step_00000002" / "trainer_state.json").read_text())
    assert state["skipped_steps"] == [2]
    assert [step for step, *_ in state["losses"]] == [1]  # the skipped step trained nothing
    weights = run.final_weights()
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
