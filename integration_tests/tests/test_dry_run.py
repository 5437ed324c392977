"""Issue 23 §3-§4: `am-train --dry-run` runs one fake step per rank position in this process and its numbers are the
real run's.

Contract: (1) the parameter bytes of all ranks of the job add up exactly to the model's parameters, held once
(FSDP2 over dp, pipeline stages, experts over ep); (2) against a real gloo run the conftest RunCache launches anyway
(no launch of its own), whose trainer measures its first step with the same code (summary.json's "memory"):
parameters and optimizer state equal per rank, the saved-activation peak within 20 % (the dry run assumes balanced
routing; the real router is not); (3) bad input is one message, exit code 2, before anything runs.
The dry runs here are in-process (no launch): a few seconds each on the tiny presets.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from conftest import PARITY, TINY_ARGS
from torch import nn
from trainer.config import parse_args
from trainer.dry_run import dry_run
from trainer.validation import BadInput

# The dry run assumes perfectly balanced routing; the tiny real router routes unevenly (the bound).
ACTIVATION_TOLERANCE = 0.20


def _dry(args: list[str], out: Path) -> dict:
    return dry_run(parse_args(["--dry-run", *args, "--out", str(out), "--no-progress"]))


# Gemma 4 ties its output head to the input embedding; at pp 2 the last stage holds the output copy (vocabulary 256 x
# hidden 32, fp32): the one tensor a pipeline holds twice by design (am-pipelining's tied copies).
TIED_COPY_BYTES = 256 * 32 * 4


@pytest.mark.parametrize(
    ("layout", "held_twice"),
    [
        (["--model", "llama", "--pp", "2", "--dtype", "fp32"], 0),
        (["--model", "nemotron", "--dp", "2", "--ep", "2", "--layers", "4"], 0),
        (["--model", "gemma4-moe", "--pp", "2", "--dp", "2", "--ep", "2", "--layers", "4"], TIED_COPY_BYTES),
        # no MTP (as the published Nemotron 3 Nano config): the last stage returns bare logits
        (["--model", "nemotron", "--pp", "2", "--layers", "4", "--mtp-depths", "0"], 0),
    ],
    ids=["llama-pp2", "nemotron-dp2-fsdp-ep2", "gemma4-moe-pp2-dp2-ep2", "nemotron-pp2-no-mtp"],
)
def test_parameter_bytes_of_all_ranks_add_up_to_the_model(layout: list[str], held_twice: int, tmp_path: Path) -> None:
    report = _dry([*TINY_ARGS, *layout], tmp_path)
    world = report["world_size"]
    assert [entry["rank"] for entry in report["ranks"]] == list(range(world))
    summed = sum(entry["parameter_bytes"] for entry in report["ranks"])
    assert summed == report["parameter_bytes_total"] + held_twice
    assert report["parameter_bytes_total"] == 4 * report["parameters"]  # fp32 master weights
    for entry in report["ranks"]:
        assert entry["total_bytes"] == sum(
            entry[k]
            for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_peak_bytes", "buffer_bytes")
        )
        assert entry["activation_peak_bytes"] > 0
        assert entry["gradient_bytes"] == entry["parameter_bytes"]
    assert report["fits"] is True
    assert json.loads((tmp_path / "dry_run.json").read_text())["parameters"] == report["parameters"]
    assert report["predicted"]["step_s"] > 0
    assert report["positions"][0]["flops"] > 0


@pytest.mark.parametrize(
    ("case", "layout"),
    [
        ("nemotron-pp2-dp2-ep2", ["--pp", "2", "--dp", "2", "--ep", "2"]),
        # activation checkpointing: the held layer inputs and one layer's recomputed tensors (a RunCache run the
        # parity tests launch anyway)
        ("nemotron-dp2-ep2-ac", ["--dp", "2", "--ep", "2", "--activation-checkpointing"]),
    ],
)
def test_estimate_matches_the_real_gloo_run(case: str, layout: list[str], runs, tmp_path: Path) -> None:
    """A RunCache run (fp32) against the dry run of the same options: nemotron pp2 x dp2 x ep2 (4 ranks), and
    dp2 x ep2 with activation checkpointing (2 ranks)."""
    real = runs.get(case).check()
    measured = real.summary["memory"]["ranks"]
    report = _dry(["--model", "nemotron", *layout, *PARITY], tmp_path)
    assert len(measured) == len(report["ranks"]) == real.nproc
    for got, want in zip(report["ranks"], measured, strict=True):
        assert got["parameter_bytes"] == want["parameter_bytes"], (got, want)
        assert got["optimizer_bytes"] == want["optimizer_bytes"], (got, want)
        assert got["gradient_bytes"] == want["gradient_bytes"], (got, want)
        error = abs(got["activation_peak_bytes"] - want["activation_peak_bytes"]) / want["activation_peak_bytes"]
        assert error <= ACTIVATION_TOLERANCE, (got, want)
    # traffic counted from the collectives the step issued: pipeline p2p, FSDP2 and the experts' all-to-all
    axes = {axis for position in report["positions"] for axis in position["axes"]}
    assert ("pp" in axes) == ("--pp" in layout), axes
    assert any("ep" in axis for axis in axes), axes


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "llama", "--gpu-memory", "0"], "--gpu-memory 0.0: must be a positive finite number"),
        (["--model", "llama", "--gpu-memory", "nan"], "--gpu-memory nan: must be a positive finite number"),
        (["--model", "llama", "--gpu-memory", "-3"], "--gpu-memory -3.0: must be a positive finite number"),
        (["--model", "llama", "--dp", "2", "--world-size", "8"], "the world size is 8 but pp x dp x cp"),
        (["--model", "llama", "--pp", "4"], "Number of stages (4) cannot exceed number of layers (2)"),
        (["--model", "llama", "--tp", "3"], "4 attention heads cannot be split over tp=3"),
    ],
)
def test_bad_input_is_one_message(args: list[str], expected: str, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="refusing to start") as raised:
        _dry([*TINY_ARGS, *args], tmp_path)
    assert expected in str(raised.value)


def test_dry_run_options_need_dry_run(tmp_path: Path) -> None:
    from trainer.config import find_problems

    cfg = parse_args(["--model", "llama", "--gpu-memory", "80", "--out", str(tmp_path)])
    assert any("only apply with --dry-run" in p for p in find_problems(cfg, world_size=1))


def test_unknown_architecture_and_layouts_that_do_not_divide_the_real_model(tmp_path: Path) -> None:
    folder = tmp_path / "unknown"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}))
    with pytest.raises(BadInput) as raised:
        _dry(["--model-path", str(folder), "--seq-len", "16", "--global-batch", "4"], tmp_path / "o1")
    assert "cannot build the model" in str(raised.value)
    # 128 routed experts over ep 3, and 52 layers over 64 stages: refused with the real model's numbers
    with pytest.raises(BadInput) as raised:
        _dry(
            ["--model", "nemotron-3-nano-30b-a3b", "--dp", "3", "--ep", "3", "--seq-len", "16", "--global-batch", "3"],
            tmp_path / "o2",
        )
    assert "ep" in str(raised.value), raised.value
    assert "128" in str(raised.value), raised.value


def test_the_verdict_and_exit_code(tmp_path: Path) -> None:
    from trainer.loop import main

    args = ["--dry-run", "--model", "llama", *TINY_ARGS, "--out", str(tmp_path), "--no-progress"]
    assert main([*args, "--gpu-memory", "0.0001"]) == 2  # 100 KiB: the tiny model's states alone are more
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert report["fits"] is False
    assert report["biggest_item"] in report["ranks"][0]


def test_a_folder_with_only_config_json(tmp_path: Path) -> None:
    """--model-path with config.json alone (no weights): the dry run builds the architecture from the config; the
    same numbers as the preset it was written from."""
    from trainer.models import build_meta_model, preset_spec

    spec = preset_spec("nemotron", hidden_size=32, num_layers=4, mtp_depths=1, tie_embeddings=False, vocab_size=None)
    folder = tmp_path / "config_only"
    build_meta_model(spec).config.save_pretrained(str(folder))  # type: ignore[operator]
    assert [p.name for p in folder.iterdir()] == ["config.json"]
    args = ["--seq-len", "16", "--global-batch", "4", "--dp", "2", "--ep", "2"]
    from_folder = _dry(["--model-path", str(folder), *args], tmp_path / "a")
    assert from_folder["parameters"] == sum(p.numel() for p in build_meta_model(spec).parameters())
    assert sum(entry["parameter_bytes"] for entry in from_folder["ranks"]) == 4 * from_folder["parameters"]


class _Mlp(nn.Module):
    """x + W2 relu(W1 x + b1) + b2: autograd keeps the input x (for W1's gradient) and relu's output (relu's and W2's
    gradients share it), [B, S, H] and [B, S, 4H]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_checkpointed_layers_count_their_held_inputs_and_one_recomputation(fake: bool) -> None:
    """Under activation checkpointing the step holds every layer's input until that layer's backward, and while one
    layer's backward runs, the tensors its recomputation saved: the peak is layers x [B,S,H] + one [B,S,4H] (fp32),
    on real tensors (a real run) and on fake ones (the dry run) alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._composable import checkpoint
    from trainer.step_memory import SavedActivations

    batch, seq, hidden, layers = 2, 8, 16, 3
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:  # fake weights too, as the dry run's materialization makes them
        stack = nn.Sequential(*(_Mlp(hidden) for _ in range(layers)))
        for layer in stack:
            checkpoint(layer, preserve_rng_state=True, early_stop=False)
        x = torch.randn(batch, seq, hidden)
        with SavedActivations(recomputation=True) as saved:
            stack(x).pow(2).mean().backward()
        with SavedActivations() as without:  # the same step seen by the hooks only: the recomputation is missed
            stack(x).pow(2).mean().backward()
    row = batch * seq * hidden * 4
    assert saved.peak_bytes == layers * row + 4 * row
    # the hooks alone see the held inputs and the last output (kept by pow until the first backward op)
    assert without.peak_bytes == (layers + 1) * row


def test_flops_of_a_nemotron_moe_layer_match_the_hand_formula() -> None:
    """The step-time model's FLOPs (FlopCounterMode + `extra_flop_formulas`) of one Nemotron 3 Nano MoE mixer — its
    128 routed experts, top 6, ReLU² (no gate projection), one shared expert, at a reduced width — against the hand
    count for T tokens: router 2·T·H·E + routed experts 2·(2·T·k·H·I) + shared expert 2·(2·T·H·Is) in forward,
    twice that in backward (input and weight gradients). Whatever the routing, the experts together see T·k rows."""
    from torch.utils.flop_counter import FlopCounterMode
    from trainer.dry_run_comm import extra_flop_formulas
    from transformers import NemotronHConfig

    from am_models_nemotron import NemotronHForCausalLM
    from am_models_nemotron.config import as_hf_config
    from am_models_nemotron.presets import preset_dict

    config = preset_dict("nemotron-3-nano-30b-a3b")
    hidden, inter, shared = 64, 32, 48  # the published E = 128 experts and top k = 6 kept
    config.update(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        moe_shared_expert_intermediate_size=shared,
        hybrid_override_pattern="E",
        num_hidden_layers=1,
        vocab_size=128,
    )
    experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    assert (experts, top_k) == (128, 6)
    torch.manual_seed(0)
    model = NemotronHForCausalLM(as_hf_config(NemotronHConfig.from_dict(config))).float()
    moe = model.model.layers["0"].mixer
    batch, seq = 2, 16
    tokens = batch * seq
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as forward:
        out = moe(x)
    with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as backward:
        out.sum().backward()
    expected = (
        2 * tokens * hidden * experts + 2 * (2 * tokens * top_k * hidden * inter) + 2 * (2 * tokens * hidden * shared)
    )
    assert forward.get_total_flops() == expected
    assert backward.get_total_flops() == 2 * expected
