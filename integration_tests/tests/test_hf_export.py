"""The streamed HF export (trainer/export.py) writes what the model's own `save_pretrained` writes, and no writer
ever holds more than its shard budget.

Contract: for a multi-rank run (pp x dp, pp x ep, dp x ep, dp x tp, tied heads across pipeline stages), the exported
folder of its last checkpoint equals — tensor by tensor, bitwise, same keys and dtypes, same config.json (and
generation_config.json) — the single process's `save_pretrained` of the SAME final weights (the checkpoint's DCP
state loaded into one unsharded model), its index names every key, and it loads back with our `from_pretrained` /
transformers' `AutoModelForCausalLM` to exactly those weights. The launches are the parity runs (conftest's
RunCache): this module adds no launch; "nemotron-pp2-dp2" exports with `--hf-shard-size 16KB`, so its writers
write many files and report the most bytes they held.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Run

from am_model_io import INDEX_FILE, read_safetensors_folder

# the reference loads the checkpoint's DCP state in this process, which has no process group (DCP says so)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
SMALL_BUDGET = 16_000  # --hf-shard-size 16KB of "nemotron-pp2-dp2": smaller than an embedding (256 x 32 x fp32)

# (RunCache launch, preset, tied embeddings)
CASES = [
    ("nemotron-pp2-dp2", "nemotron", False),  # pipeline x FSDP2, the small budget
    ("nemotron-pp2-dp2-ep2", "nemotron", False),  # pipeline x EP: per-expert keys from (expert_dp, ep) shards
    ("gemma4-moe-dp2-ep2", "gemma4-moe", True),  # EP, stacked expert keys, tied head
    ("gemma4-tp2-dp2", "gemma4", True),  # FSDP2 over TP DTensors: 2-D (dp_cp, tp) strided shards
    ("llama-tied-pp2", "llama", True),  # transformers: the tied head's output copy on the last stage left out
    ("llama-tied-tp2", "llama", True),  # transformers' own TP plan, vocabulary-parallel tied embedding
]


def _checkpoint(run: Run) -> Path:
    root = run.out / "checkpoints"
    return root / (root / "latest").read_text().strip()


def _reference_model(preset: str, tied: bool, checkpoint: Path) -> tuple[Any, torch.nn.Module]:
    """The run's final weights in one unsharded model: the checkpoint's DCP model state (resharded by DCP on load,
    no process group) loaded into the preset built whole."""
    import torch.distributed.checkpoint as dcp
    from trainer.models import build_model, preset_spec

    spec = preset_spec(preset, hidden_size=32, num_layers=4, mtp_depths=1, tie_embeddings=tied, vocab_size=None)
    model = build_model(spec, seed=0)
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(checkpoint / "dcp"))
    model.load_state_dict(state)
    return spec, model


def _same_folder(got: Path, want: Path) -> None:
    """`got` holds exactly `want`'s tensors (keys, dtypes, bitwise values) and metadata files."""
    actual, expected = read_safetensors_folder(got), read_safetensors_folder(want)
    assert actual.keys() == expected.keys(), f"different keys: {sorted(actual.keys() ^ expected.keys())}"
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, f"{key}: {actual[key].dtype} vs {tensor.dtype}"
        assert torch.equal(actual[key], tensor), f"{key}: values differ from save_pretrained's"
    for name in ("config.json", "generation_config.json"):
        assert (got / name).is_file() == (want / name).is_file(), name
        if (want / name).is_file():
            assert json.loads((got / name).read_text()) == json.loads((want / name).read_text()), name
    files = sorted(p.name for p in got.glob("*.safetensors"))
    if len(files) > 1:  # the index names every key, in files that exist
        weight_map = json.loads((got / INDEX_FILE).read_text())["weight_map"]
        assert weight_map.keys() == actual.keys()
        assert sorted(set(weight_map.values())) == files
    assert not list(got.glob("*.partial")), "provisional shard files left behind"


@pytest.mark.parametrize(("case", "preset", "tied"), CASES, ids=[case for case, _, _ in CASES])
def test_streamed_export_equals_save_pretrained_of_the_same_weights(
    runs, tmp_path: Path, case: str, preset: str, tied: bool
) -> None:
    """The multi-rank export equals the single process's save_pretrained of the same final weights (bitwise) and
    loads back (ours: the registered class through `folder_spec`; llama: transformers' AutoModelForCausalLM) to
    exactly those weights."""
    from trainer.models import build_model, folder_spec

    run = runs.get(case).check()
    checkpoint = _checkpoint(run)
    spec, reference = _reference_model(preset, tied, checkpoint)
    spec.save(reference, tmp_path / "save_pretrained")
    exported = checkpoint / "model"
    _same_folder(exported, tmp_path / "save_pretrained")

    if preset == "llama":
        from transformers import AutoModelForCausalLM

        loaded, info = AutoModelForCausalLM.from_pretrained(
            str(exported), dtype=torch.float32, output_loading_info=True
        )
        assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    else:
        loaded = build_model(folder_spec(exported), seed=1)  # our class: strict, every weight from the folder
    want = reference.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key].to(tensor.dtype), tensor), key


def test_writers_hold_at_most_the_shard_budget(runs) -> None:
    """With `--hf-shard-size 16KB` every writer (one per pipeline stage: 2 of the 4 ranks) writes many files, each
    within the budget unless it holds a single bigger tensor, and the most tensor bytes its ShardWriter held at
    once is at most max(budget, the biggest tensor); the report in trainer_state.json says so."""
    from safetensors.torch import load_file

    run = runs.get("nemotron-pp2-dp2").check()
    checkpoint = _checkpoint(run)
    report = json.loads((checkpoint / "trainer_state.json").read_text())["hf_export"]
    folder = checkpoint / "model"
    files = sorted(folder.glob("*.safetensors"))
    assert report["max_shard_bytes"] == SMALL_BUDGET
    assert report["files"] == len(files) > 4, report
    assert [writer["rank"] for writer in report["writers"]] == [0, 2], report  # the first rank of each stage
    biggest = 0
    for path in files:
        nbytes = [t.numel() * t.element_size() for t in load_file(str(path)).values()]
        biggest = max(biggest, *nbytes)
        assert sum(nbytes) <= SMALL_BUDGET or len(nbytes) == 1, (path.name, nbytes)
    assert biggest > SMALL_BUDGET  # the budget is really exceeded by one tensor: the bound below is max(...)
    for writer in report["writers"]:
        assert 0 < writer["peak_held_bytes"] <= max(SMALL_BUDGET, biggest), writer
    assert sum(writer["bytes"] for writer in report["writers"]) == sum(
        t.numel() * t.element_size() for t in read_safetensors_folder(folder).values()
    )


@pytest.mark.parametrize("size", ["0", "5 apples", "-1GB", "GB"])
def test_a_shard_size_that_is_not_a_positive_size_is_named(size: str) -> None:
    """`--hf-shard-size` must be bytes or save_pretrained's spelling ("5GB", "200MB", "64KB"): refused up front,
    named, with what to give instead; a valid size is no problem."""
    from trainer.config import find_problems, parse_args

    problems = find_problems(parse_args([f"--hf-shard-size={size}"]), world_size=1)
    named = [p for p in problems if p.startswith(f"--hf-shard-size {size}: ")]
    assert len(named) == 1, problems
    assert "give bytes (int) or e.g. '5GB', '200MB', '64KB'" in named[0]
    assert not [p for p in find_problems(parse_args(["--hf-shard-size", "64KB"]), world_size=1) if "shard" in p]
