"""The pipeline layout is planned once (am-pipelining's `plan_pipeline`) and runs exactly as asked, or is refused
before any collective.

Contract: `--stages-per-rank k` runs exactly k x pp stages (it used to be turned into a layers-per-stage target and
back, so 8 layers, pp=2, 3 per rank silently ran 4 stages); `summary.json` records the layout that ran, and the run
trains exactly like the single-process one. A configuration with several pipeline problems, or a `--model-path`
model with too few layers, ends on every rank with exit code 2 and ONE message listing every problem, before the
process group exists: exit code 2 (only `validate()` raises `BadInput`, before `init_process_group`) and no rank
connecting to the rendezvous (`_launch_ranks_by_hand`). No wall-clock bound is asserted: on a loaded 2-core machine
starting two Python processes alone can take a minute.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PARITY, launch, without_preset_sizes
from test_bad_input import EXIT_BAD_INPUT, _launch_ranks_by_hand
from test_parity import RTOL, assert_weights_close

EIGHT_LAYERS = ["--model", "llama", *PARITY, "--layers", "8"]


@pytest.fixture(scope="module")
def eight_layer_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    single = launch(EIGHT_LAYERS, nproc=1, out=root / "single")
    pipelined = launch(
        [*EIGHT_LAYERS, "--pp", "2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "3"],
        nproc=2,
        out=root / "pp2-spr3",
    )
    return single, pipelined


def test_stages_per_rank_runs_exactly_as_asked(eight_layer_runs) -> None:
    """8 layers, pp=2, 3 stages per rank: 6 stages of 2, 2, 1, 1, 1, 1 layers, and the same training as pp=1."""
    single, pipelined = (run.check() for run in eight_layer_runs)
    layout = pipelined.summary["layout"]
    assert layout["pp"] == 2
    assert (layout["dp"], layout["cp"]) == (1, 1)
    assert layout["schedule"] == "Interleaved1F1B"
    assert layout["stages"] == 6
    assert layout["stages_per_rank"] == 3
    assert layout["layers_per_stage"] == [2, 2, 1, 1, 1, 1]
    assert layout["rank_stages"] == [[0, 2, 4], [1, 3, 5]]
    assert layout["microbatches"] == 4
    got, want = torch.tensor(pipelined.summary["losses"]), torch.tensor(single.summary["losses"])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0)
    assert_weights_close(pipelined.final_weights(), single.final_weights(), rtol=RTOL)
    reference = single.summary["layout"]
    assert (reference["pp"], reference["stages"], reference["layers_per_stage"]) == (1, 1, [8])


def test_several_pipeline_problems_are_refused_before_any_collective(tmp_path) -> None:
    args = [
        "--model", "llama", *PARITY,
        "--layers", "3",  # 4 stages cannot each hold a layer
        "--pp", "2", "--schedule", "1F1B", "--stages-per-rank", "2",  # 1F1B runs one stage per rank
        "--global-batch", "5", "--microbatch-size", "2",  # 5 sequences cannot make microbatches of 2
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    (code0, out0), (code1, out1) = _launch_ranks_by_hand(args, world_size=2)
    assert (code0, code1) == (EXIT_BAD_INPUT, EXIT_BAD_INPUT), out0[-3000:] + out1[-3000:]
    assert out0.count("refusing to start (3 problems)") == 1, out0
    assert "refusing to start" not in out1
    for expected in (
        "Single stage schedule Schedule1F1B requires exactly 1 stage per rank, but got 2 stages per rank",
        "Number of stages (4) cannot exceed number of layers (3)",
        "(--global-batch 5 / --dp 1 = 5) is not divisible by --microbatch-size 2",
    ):
        assert expected in out0, f"not reported: {expected}\n{out0}"
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_model_path_with_too_few_layers_is_refused(tmp_path) -> None:
    """The layer count comes from the model `validate()` builds, so an HF folder is checked like a preset."""
    from trainer.models import build_model, preset_spec

    spec = preset_spec("llama", hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=False, vocab_size=None)
    spec.save(build_model(spec, seed=0), tmp_path / "two-layers")
    args = [
        *without_preset_sizes(PARITY), "--model-path", str(tmp_path / "two-layers"),
        "--pp", "2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "2",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    (code0, out0), (code1, out1) = _launch_ranks_by_hand(args, world_size=2)
    assert (code0, code1) == (EXIT_BAD_INPUT, EXIT_BAD_INPUT), out0[-3000:] + out1[-3000:]
    assert "Number of stages (4) cannot exceed number of layers (2)" in out0, out0
