"""Resume is exact: a run whose rank is SIGKILLed mid-run, relaunched with `--resume latest`, ends with the same
weights, bit for bit, as the uninterrupted run (Nemotron-H with MTP, pp=2, 1F1B, fp32; under expert parallelism,
dp 2 x cp 2 with ep 2: the DCP checkpoint holds the experts as (expert_dp, ep)-sharded DTensors; and at tp 2: TP
DTensors and the Mamba2 mixers' plain-tensor shards under per-tp-rank keys).

The kill comes from the trainer's fault injection (AM_TRAIN_FAIL_MODE=sigkill: rank 1 SIGKILLs itself as step 3
starts, after the checkpoints of steps 1 and 2 were written); torchrun then stops rank 0.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PARITY, launch

KILL = {"AM_TRAIN_FAIL_AT_STEP": "3", "AM_TRAIN_FAIL_RANK": "1", "AM_TRAIN_FAIL_MODE": "sigkill"}
ARGS = ["--model", "nemotron", "--pp", "2", "--schedule", "1F1B", *PARITY, "--ckpt-every", "1"]


EP_ARGS = ["--model", "nemotron", "--dp", "2", "--ep", "2", "--cp", "2", *PARITY, "--ckpt-every", "1"]
# TP: the DCP checkpoint holds TP DTensors and Mamba2's plain-tensor shards (per-tp-rank keys)
TP_ARGS = ["--model", "nemotron", "--tp", "2", *PARITY, "--ckpt-every", "1"]


@pytest.mark.parametrize(
    ("reference", "args", "nproc"),
    [("nemotron-pp2-1f1b", ARGS, 2), ("nemotron-dp2-ep2-cp2", EP_ARGS, 4), ("nemotron-tp2", TP_ARGS, 2)],
    ids=["pp2", "ep2-dp2-cp2", "tp2"],
)
def test_sigkill_then_resume_equals_uninterrupted_run_bit_for_bit(
    runs, tmp_path, reference: str, args: list[str], nproc: int
) -> None:
    uninterrupted = runs.get(reference).check()
    out = tmp_path / "killed"

    killed = launch(args, nproc=nproc, out=out, env=KILL)
    assert killed.returncode != 0, killed.output[-3000:]
    assert "SIGKILL" in killed.output or "Signal 9" in killed.output, killed.output[-3000:]
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    assert not (checkpoints / "step_00000003").exists()

    resumed = launch([*args, "--resume", "latest"], nproc=nproc, out=out).check()
    assert resumed.summary["resumed_from"] == 2
    assert resumed.summary["losses"] == uninterrupted.summary["losses"]  # exact floats, history included
    assert resumed.summary["expert_imbalance"] == uninterrupted.summary["expert_imbalance"]
    # Nemotron-H balances by default (issue 25): the terms' history resumes exactly, and the router biases, moved by
    # every step so far, are in the bit-identical weights below
    assert resumed.summary["moe_aux_losses"] == uninterrupted.summary["moe_aux_losses"]
    assert len(resumed.summary["moe_aux_losses"]["moe_seq_aux_loss"]) == 3
    got, want = resumed.final_weights(), uninterrupted.final_weights()
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, f"not bit-identical after resume: {different}"
    biases = [name for name in want if name.endswith("e_score_correction_bias")]
    assert biases
    assert all(want[name].abs().max() > 0 for name in biases), "the bias update did not run"
