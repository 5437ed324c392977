"""Bad input is refused before any collective, with ONE message listing every problem, and a non-zero exit code on
every rank.

"Before any collective" is proven by launching the ranks by hand (no torchrun) with a rendezvous nobody else joins:
a rank that reached `init_process_group` would wait there for its peers until the 60 s timeout; refused ranks exit
at once with code 2.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

from conftest import PARITY, TRAIN, launch

EXIT_BAD_INPUT = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch_ranks_by_hand(args: list[str], *, world_size: int, timeout: float = 120) -> list[tuple[int, str, float]]:
    port = str(_free_port())
    procs = []
    started = time.perf_counter()
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(TRAIN), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        results.append((proc.returncode, output, time.perf_counter() - started))
    return results


def test_every_problem_is_listed_once_and_every_rank_exits_before_any_collective(tmp_path) -> None:
    args = [
        "--model", "nemotron", *PARITY,
        "--pp", "2", "--cp", "2",  # world size 2 != 4 (pp x cp itself is accepted for nemotron's contiguous layout)
        "--seq-len", "18",  # not divisible by 2 x cp = 4, the length the CP sharder pads to
        "--global-batch", "5", "--microbatch-size", "2",  # 5 sequences cannot make microbatches of 2
        "--schedule", "ZeroBubbleFantasy",  # unknown schedule
        "--resume", str(tmp_path / "no-such-checkpoint"),  # missing checkpoint
        "--out", str(tmp_path / "out"),
        "--timeout", "60",
    ]  # fmt: skip
    (code0, out0, _), (code1, out1, wall) = _launch_ranks_by_hand(args, world_size=2)
    assert (code0, code1) == (EXIT_BAD_INPUT, EXIT_BAD_INPUT), out0[-3000:] + out1[-3000:]
    assert wall < 60, "a rank waited for its peers: it reached a collective"
    assert out0.count("refusing to start") == 1
    assert "refusing to start" not in out1
    expected = [
        "the world size is 2 but pp x dp x cp = 2 x 1 x 2 = 4",
        "--global-batch 5 / --dp 1 = 5) is not divisible by --microbatch-size 2",
        "--schedule 'ZeroBubbleFantasy' is unknown",
        "--seq-len 18 is not divisible by 4 (2 x --cp 2)",
        "no-such-checkpoint does not exist",
    ]
    missing = [line for line in expected if line not in out0]
    assert not missing, f"not reported: {missing}\n{out0}"
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_corrupt_checkpoint_is_refused(runs, tmp_path) -> None:
    source = runs.get("llama-tied").check()
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(source.out / "checkpoints" / "step_00000003", checkpoint)
    weights = checkpoint / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last tensor
    weights.write_bytes(bytes(data))

    run = launch(["--model", "llama", "--tie-embeddings", *PARITY, "--resume", str(checkpoint)], nproc=1, out=tmp_path)
    assert run.returncode == EXIT_BAD_INPUT, run.output[-3000:]
    assert "model/model.safetensors is corrupt (its sha256 differs from the manifest)" in run.output
    assert "refusing to start (1 problem)" in run.output
