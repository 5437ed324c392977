"""Bad input is refused before any collective, with ONE message listing every problem, and exit code 2 on every
rank.

"Before any collective" is proven without a clock: the ranks are launched by hand (no torchrun) with MASTER_PORT
pointing at a socket this test holds. A rank that reached `init_process_group` would connect to it (ranks > 0) or
fail to bind it (rank 0, with another exit code); after the ranks exit, the socket must have seen no connection.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys

import torch
from conftest import PARITY, TRAIN, launch, without_preset_sizes
from safetensors.torch import load_file, save_file

from am_testing import run_processes

EXIT_BAD_INPUT = 2


def _launch_ranks_by_hand(args: list[str], *, world_size: int, timeout: float = 240) -> list[tuple[int, str]]:
    """(exit code, output) of each rank, started together through am-testing (`run_processes`, with a deadline);
    fails if any rank tried to join the rendezvous."""
    rendezvous = socket.socket()
    rendezvous.bind(("", 0))  # every address: rank 0 cannot bind this port as the store server
    rendezvous.listen(8)
    port = str(rendezvous.getsockname()[1])
    try:
        rendezvous_env = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
        rendezvous_env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        envs = [
            {**os.environ, **rendezvous_env, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world_size)
        ]
        done = run_processes(
            [[sys.executable, str(TRAIN), *args]] * world_size,
            name=f"{world_size} ranks by hand: {' '.join(args)}",
            deadline_s=timeout,
            env=envs,
        )
        results = [(rank.returncode, rank.output) for rank in done]
        rendezvous.setblocking(False)
        try:
            peer, _ = rendezvous.accept()
        except BlockingIOError:
            peer = None
        if peer is not None:
            peer.close()
        assert peer is None, "a rank connected to the rendezvous: it got past validation\n" + results[-1][1][-3000:]
        return results
    finally:
        rendezvous.close()


def _save_nemotron_with_attention_dropout(folder) -> None:
    """A tiny Nemotron-H folder (Mamba conv kernel 4: a CP shard needs the previous rank's last 3 tokens) whose
    attention layers have dropout, which ring attention cannot apply."""
    from trainer.models import build_model, preset_spec

    spec = preset_spec("nemotron", hidden_size=32, num_layers=4, mtp_depths=1, tie_embeddings=False, vocab_size=None)
    model = build_model(spec, seed=0)
    model.config.attention_dropout = 0.1
    spec.save(model, folder)


def test_every_problem_is_listed_once_and_every_rank_exits_before_any_collective(tmp_path) -> None:
    (tmp_path / "corpus.txt").write_bytes(b"In the beginning\n\xc3\x28")  # a broken two-byte sequence
    (tmp_path / "a-file").write_text("not a folder")
    _save_nemotron_with_attention_dropout(tmp_path / "nemotron-dropout")
    args = [
        *without_preset_sizes(PARITY), "--model-path", str(tmp_path / "nemotron-dropout"),
        "--pp", "2", "--cp", "2",  # world size 2 != 4 (pp x cp itself is accepted for nemotron's contiguous layout)
        "--ep", "3",  # does not divide dp x cp = 2, nor nemotron's 4 experts (am-capabilities)
        "--seq-len", "2",  # not divisible by 2 x cp = 4 (padded to 4: 2 tokens per rank, under the conv halo of 3)
        "--global-batch", "5", "--microbatch-size", "2",  # 5 sequences cannot make microbatches of 2
        "--schedule", "ZeroBubbleFantasy",  # unknown schedule
        "--resume", str(tmp_path / "no-such-checkpoint"),  # missing checkpoint
        "--data", str(tmp_path / "corpus.txt"),  # not UTF-8
        "--lr", "nan", "--threads", "-1", "--timeout", "inf",
        "--out", str(tmp_path / "a-file" / "out"),  # cannot be created
    ]  # fmt: skip
    (code0, out0), (code1, out1) = _launch_ranks_by_hand(args, world_size=2)
    assert (code0, code1) == (EXIT_BAD_INPUT, EXIT_BAD_INPUT), out0[-3000:] + out1[-3000:]
    assert out0.count("refusing to start (14 problems)") == 1, out0  # exactly the fourteen below
    assert "Traceback" not in out0 + out1
    assert "refusing to start" not in out1
    expected = [
        "the world size is 2 but pp x dp x cp = 2 x 1 x 2 = 4",
        "--global-batch 5 / --dp 1 = 5) is not divisible by --microbatch-size 2",
        "--schedule 'ZeroBubbleFantasy' is unknown",
        "--seq-len 2 is not divisible by 4 (2 x --cp 2)",
        # what the model cannot honour under CP (its cp_problems hook), found before the forward would raise it
        "--cp 2 with --seq-len 2: NemotronHForCausalLM: S_local=2 tokens per rank is shorter than the Mamba conv "
        "halo (3); use a longer sequence or fewer CP ranks",
        "--cp 2 with --seq-len 2: NemotronHForCausalLM: attention dropout is not supported by ring attention; set "
        "attention_dropout=0",
        "no-such-checkpoint does not exist",
        f"--data {tmp_path / 'corpus.txt'} is not UTF-8 text: byte offset 17 holds b'\\xc3'",
        "--lr nan: must be a finite number",
        "--threads -1: must be >= 0",
        "--timeout inf: must be a finite number",
        f"{tmp_path / 'a-file'} is a file, so the folder cannot be created",
        "--ep 3 with --dp 1 x --cp 2: ep=3 must divide dp x cp = 2",
        "ep_size=3: NemotronHForCausalLM cannot use expert parallelism: its experts cannot be split evenly over "
        "ep_size=3 ranks (n_routed_experts=4 not divisible by 3)",
    ]
    missing = [line for line in expected if line not in out0]
    assert not missing, f"not reported: {missing}\n{out0}"


def test_a_fresh_run_into_checkpoints_and_a_model_path_missing_a_tensor_are_refused_on_every_rank(runs, tmp_path):
    """Nothing is lost or silently re-initialized: an --out holding checkpoints needs --resume or --overwrite, and
    an HF folder must supply every tensor (named as the file names it); a .pt that holds no tensor is listed in the
    same message. (--pp above a folder's layers: test_pipeline_layout.py.)"""
    previous = runs.get("llama-tied").check()
    out = tmp_path / "out"
    shutil.copytree(previous.out / "checkpoints", out / "checkpoints")
    folder = tmp_path / "two-layers"
    _save_llama(folder, layers=2)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    torch.save({"ids": [1, 2, 3]}, tmp_path / "ids.pt")
    args = [*without_preset_sizes(PARITY), "--model-path", str(folder), "--pp", "2", "--data", str(tmp_path / "ids.pt")]
    args += ["--out", str(out)]
    (code0, out0), (code1, out1) = _launch_ranks_by_hand(args, world_size=2)
    assert (code0, code1) == (EXIT_BAD_INPUT, EXIT_BAD_INPUT), out0[-3000:] + out1[-3000:]
    assert "refusing to start (3 problems)" in out0, out0
    for expected in (
        f"--out {out} already holds checkpoints (step_00000003, latest): continue that run with --resume latest, "
        "choose another --out, or pass --overwrite to delete them",
        "missing keys (1): ['model.layers.0.mlp.up_proj.weight']",
        f"--data {tmp_path / 'ids.pt'}: expected a 1-D integer tensor, got a dict",
    ):
        assert expected in out0, f"not reported: {expected}\n{out0}"
    assert (out / "checkpoints" / "step_00000003" / "manifest.json").is_file(), "the old checkpoint is intact"


def test_overwrite_replaces_the_old_checkpoints(runs, tmp_path) -> None:
    previous = runs.get("llama-tied").check()
    shutil.copytree(previous.out / "checkpoints", tmp_path / "checkpoints")
    run = launch(["--model", "llama", *PARITY, "--steps", "1", "--overwrite"], nproc=1, out=tmp_path).check()
    assert f"--overwrite: deleted the checkpoints under {tmp_path}" in run.output
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000001"]


def _save_llama(folder, *, layers: int) -> None:
    from trainer.models import build_model, preset_spec

    spec = preset_spec("llama", hidden_size=32, num_layers=layers, mtp_depths=0, tie_embeddings=False, vocab_size=None)
    spec.save(build_model(spec, seed=0), folder)


def test_a_corrupt_checkpoint_is_refused(runs, tmp_path) -> None:
    source = runs.get("llama-tied").check()
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(source.out / "checkpoints" / "step_00000003", checkpoint)
    weights = checkpoint / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last tensor
    weights.write_bytes(bytes(data))
    state_path = checkpoint / "trainer_state.json"
    state = json.loads(state_path.read_text())
    assert state["step"] == 3
    state_path.write_text(json.dumps({**state, "step": 2}))  # a tampered step counter

    run = launch(["--model", "llama", "--tie-embeddings", *PARITY, "--resume", str(checkpoint)], nproc=1, out=tmp_path)
    assert run.returncode == EXIT_BAD_INPUT, run.output[-3000:]
    assert "model/model.safetensors is corrupt (its sha256 differs from the manifest)" in run.output
    assert "trainer_state.json is corrupt (its sha256 differs from the manifest)" in run.output
    assert "refusing to start (2 problems)" in run.output


def test_a_nan_in_a_model_path_is_refused_on_every_rank_each_reading_half_of_the_files(tmp_path) -> None:
    """Issue 22 item 3 / issue 23: a NaN / inf tensor in `--model-path` stops a 2-rank job before anything is built:
    each rank reads only its half of the tensors (after the process group exists), and both exit with code 2 and
    the same list, which names every bad tensor and its file, whichever rank read it."""
    folder = tmp_path / "llama"
    _save_llama(folder, layers=2)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    bad = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    for key in bad:
        tensors[key].view(-1)[:2] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    with socket.socket() as free:  # a port for the real rendezvous
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    args = [*without_preset_sizes(PARITY), "--model-path", str(folder), "--dp", "2", "--out", str(tmp_path / "out")]
    envs = [
        {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        for rank in range(2)
    ]
    done = run_processes(
        [[sys.executable, str(TRAIN), *args]] * 2, name="2 ranks, a NaN --model-path", deadline_s=240, env=envs
    )
    (code0, out0), (code1, out1) = [(rank.returncode, rank.output) for rank in done]
    assert (code0, code1) == (EXIT_BAD_INPUT, EXIT_BAD_INPUT), out0[-3000:] + out1[-3000:]
    assert "refusing to start (3 problems)" in out0, out0
    for key in bad:
        assert f"tensor {key!r} in {weights.name} holds 2 NaN value(s)" in out0, out0
    assert "Traceback" not in out0 + out1
    assert not (tmp_path / "out" / "checkpoints").exists()
