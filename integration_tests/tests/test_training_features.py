"""The training features end to end (two launches in all): a run from the example TOML config with an HF tokenizer,
`.jsonl` data, held-out validation every 2 steps, activation checkpointing, SGD + linear schedule and TensorBoard;
the same run at pp = 2 x cp = 2 (4 ranks) computes the same training AND validation losses (validation through
the pipeline schedule's forward-only `eval` inside the CP ring context). And `am-train` is a console command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLE_CONFIG, launch

RTOL = 1e-5  # fp32, as test_parity.py


@pytest.fixture(scope="module")
def feature_runs(text_corpus, tmp_path_factory: pytest.TempPathFactory) -> dict:
    args = ["--config", str(EXAMPLE_CONFIG), "--tokenizer", str(text_corpus["tokenizer"])]
    args += ["--data", str(text_corpus["jsonl"]), "--timeout", "120"]
    root = tmp_path_factory.mktemp("feature-runs")
    single = launch(args, nproc=1, out=root / "single").check()
    parallel = launch([*args, "--pp", "2", "--cp", "2"], nproc=4, out=root / "pp2-cp2").check()
    return {"single": single, "parallel": parallel}


def test_config_file_tokenizer_jsonl_run_validates_and_logs(feature_runs) -> None:
    run = feature_runs["single"]
    summary = run.summary
    # the example config's values reached the run; the command line's --tokenizer / --data too
    assert (summary["optimizer"], summary["lr_schedule"], summary["activation_checkpointing"]) == (
        "sgd",
        "linear",
        True,
    )
    assert summary["steps"] == 4
    assert len(summary["losses"]) == 4
    assert [step for step, _ in summary["val_losses"]] == [2, 4]  # every --val-every 2 steps
    assert summary["final_val_loss"] == summary["val_losses"][-1][1]
    assert all(loss > 0 for _, loss in summary["val_losses"])
    assert "validation loss" in run.output
    assert Path(summary["loss_curve"]).is_file()
    # TensorBoard (rank 0): the same numbers as the summary
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert summary["tensorboard"] == str(run.out / "tb")
    events = EventAccumulator(summary["tensorboard"])
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss"} <= set(
        events.Tags()["scalars"]
    )
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert logged == [(i + 1, pytest.approx(loss, rel=1e-6)) for i, loss in enumerate(summary["losses"])]
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [
        (step, pytest.approx(loss, rel=1e-6)) for step, loss in summary["val_losses"]
    ]
    lrs = [e.value for e in events.Scalars("train/lr")]
    assert lrs == pytest.approx([1e-2, 1e-2 - 9e-3 / 3, 1e-2 - 2 * 9e-3 / 3, 1e-3], rel=1e-6)  # warm-up 1, linear


def test_pipeline_x_cp_run_has_the_single_process_training_and_validation_losses(feature_runs) -> None:
    single, parallel = feature_runs["single"].summary, feature_runs["parallel"].summary
    assert (parallel["layout"]["pp"], parallel["layout"]["cp"]) == (2, 2)
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(single["losses"]), rtol=RTOL, atol=0.0)
    got, want = torch.tensor(parallel["val_losses"]), torch.tensor(single["val_losses"])
    assert torch.equal(got[:, 0], want[:, 0])
    torch.testing.assert_close(got[:, 1], want[:, 1], rtol=RTOL, atol=0.0)
    assert parallel["tensorboard"] is not None  # rank 0 logs; the other ranks write nothing (no second folder)


def test_am_train_is_a_console_command() -> None:
    command = Path(sys.executable).parent / "am-train"
    assert command.is_file(), f"am-train is not installed in {command.parent} (uv sync --all-packages)"
    done = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    for option in ("--config", "--tokenizer", "--val-every", "--tensorboard", "--activation-checkpointing"):
        assert option in done.stdout
    assert "--lr-schedule {cosine,linear,constant}" in done.stdout
