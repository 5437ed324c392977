"""Issue 23 §1: no rank ever holds the whole model.

The trainer builds the model on the meta device, applies the layout (here FSDP2 over dp 4) and only then gives each
rank storage for its own blocks, initialized per unit (trainer/build.py). The peak resident memory of each rank while
it builds and materializes, counted by the kernel (VmHWM after /proc/self/clear_refs, `AM_TRAIN_MEMORY_REPORT`), stays
well below the model's fp32 size: its quarter plus one decoder layer in full, never the whole model. That every
layout holds the single process's values is test_parity.py's (the single-process reference runs the same path).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import launch

# A llama preset of ~38M parameters (151 MB in fp32): 16 layers of 2.4M parameters (9.4 MB each).
SIZE = ["--model", "llama", "--hidden-size", "512", "--layers", "16"]
RUN = [*SIZE, "--seq-len", "16", "--global-batch", "4", "--steps", "1", "--dtype", "fp32", "--no-progress"]


def _full_model_bytes(layers: int = 16) -> int:
    from trainer.models import build_meta_model, preset_spec

    spec = preset_spec("llama", hidden_size=512, num_layers=layers, mtp_depths=0, tie_embeddings=False, vocab_size=None)
    model = build_meta_model(spec)
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _run_and_measure(args: list[str], *, nproc: int, tmp_path) -> list[tuple[dict, int]]:
    """Run the trainer with `AM_TRAIN_MEMORY_REPORT`; per rank: its memory facts and how many bytes its peak resident
    memory grew by while it built and materialized the model (VmHWM minus the RSS before the build)."""
    report = tmp_path / "memory"
    launch(args, nproc=nproc, out=tmp_path / "run", env={"AM_TRAIN_MEMORY_REPORT": str(report)}).check()
    per_rank = [json.loads((report / f"memory_rank{rank}.json").read_text()) for rank in range(nproc)]
    return [(facts, (facts["hwm_kib"] - facts["rss_start_kib"]) * 1024) for facts in per_rank]


def test_each_rank_builds_only_its_share_at_dp4(tmp_path) -> None:
    measured = _run_and_measure([*RUN, "--dp", "4"], nproc=4, tmp_path=tmp_path)
    full = _full_model_bytes()
    assert full > 140e6, full
    for rank, (facts, grown) in enumerate(measured):
        # this rank's FSDP2 shards: a quarter of the model (layers split row-wise over 4 ranks)
        assert abs(facts["local_tensor_bytes"] - full / 4) < 0.02 * full, (rank, facts, full)
        # its shards (38 MB) plus one unit in full (~9 MB) and what the build imports and the allocator keeps
        # (measured 58-85 MB under load); a whole-model build would grow by at least the model (152 MB)
        assert grown < 0.7 * full, f"rank {rank} grew by {grown / 1e6:.0f} MB building a {full / 1e6:.0f} MB model"


# ------------------------------------------------------------------------------------------------------------------
# §2: the published configurations as --model names (validated on the meta device; never materialized here)
# ------------------------------------------------------------------------------------------------------------------

REAL = ["--seq-len", "16", "--global-batch", "8", "--steps", "1", "--no-progress"]
# name -> (layout, parameters counted on the meta device, the published total it must match within 1 %)
PUBLISHED = {
    "nemotron-3-nano-30b-a3b": (["--dp", "8", "--ep", "8"], 31.6e9),
    "gemma4-26b-a4b": (["--dp", "8", "--ep", "8"], 25.2e9),
    "gemma4-31b": (["--dp", "8"], 30.7e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configurations_validate_on_the_meta_device(tmp_path, name: str) -> None:
    from trainer.config import REAL_SIZE_MODELS, parse_args
    from trainer.validation import validate

    from am_models_gemma4.presets import PRESET_NAMES as GEMMA4
    from am_models_nemotron.presets import PRESET_NAMES as NEMOTRON

    assert set(REAL_SIZE_MODELS) == set(NEMOTRON) | set(GEMMA4), "the trainer names every package preset"
    layout, published = PUBLISHED[name]
    validated = validate(parse_args(["--model", name, *layout, *REAL, "--out", str(tmp_path)]), world_size=8)
    model = validated.model
    assert all(p.is_meta for p in model.parameters()), "validation holds no weights"
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - published) < 0.01 * published, (name, count)
    assert validated.plan.ep == (8 if "--ep" in layout else 1)


def test_published_configurations_refuse_tiny_sizes_and_a_layout_that_does_not_divide_them(tmp_path) -> None:
    from trainer.config import parse_args
    from trainer.validation import BadInput, validate

    args = ["--model", "nemotron-3-nano-30b-a3b", "--hidden-size", "64", "--dp", "6", "--ep", "3", *REAL]
    with pytest.raises(BadInput) as info:
        validate(parse_args([*args, "--global-batch", "6", "--out", str(tmp_path)]), world_size=6)
    message = str(info.value)
    assert "--hidden-size 64: --model nemotron-3-nano-30b-a3b is the published configuration" in message, message
    assert "n_routed_experts=128 not divisible by 3" in message, message


def test_a_tied_model_path_split_over_two_stages_equals_one_process(tmp_path) -> None:
    """A Gemma 4 folder (tied embedding, no lm_head tensor) at pp 2: the first stage reads the embedding, the last
    stage's head copy gets its values (am-pipelining's sync), and the run equals the single process's."""
    from conftest import PARITY, without_preset_sizes
    from trainer.models import build_model, preset_spec

    spec = preset_spec("gemma4", hidden_size=32, num_layers=4, mtp_depths=0, tie_embeddings=False, vocab_size=None)
    spec.save(build_model(spec, seed=5), tmp_path / "gemma4")
    args = ["--model-path", str(tmp_path / "gemma4"), *without_preset_sizes(PARITY)]
    one = launch(args, nproc=1, out=tmp_path / "pp1").check()
    two = launch([*args, "--pp", "2"], nproc=2, out=tmp_path / "pp2").check()
    assert two.summary["losses"] == pytest.approx(one.summary["losses"], rel=1e-5)
    expected, actual = one.final_weights(), two.final_weights()
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_each_rank_materializes_only_its_tp_shards_at_tp2(tmp_path) -> None:
    """Under --tp the plan (TP included) is applied on the meta model and only then does each rank materialize: its
    local tensors are half the model (embedding, attention, MLP and head split over 2 ranks; the replicated norms
    are ~0.1 %) and its peak grows by that half plus one unit, never by the whole model (the old order, each rank
    materializing its stage whole and TP splitting it afterwards, grew by at least the model)."""
    run = [*RUN[RUN.index("--seq-len") :], "--model", "llama", "--hidden-size", "512", "--layers", "32", "--tp", "2"]
    measured = _run_and_measure(run, nproc=2, tmp_path=tmp_path)
    full = _full_model_bytes(layers=32)  # ~76M parameters, 302 MB in fp32: large against the fixed import overhead
    assert full > 290e6, full
    for rank, (facts, grown) in enumerate(measured):
        assert abs(facts["local_tensor_bytes"] - full / 2) < 0.02 * full, (rank, facts, full)
        # its half (151 MB) + one decoder layer (9 MB) + imports and the allocator (~20-50 MB): 0.6-0.7 of the model
        assert grown < 0.8 * full, f"rank {rank} grew by {grown / 1e6:.0f} MB building a {full / 1e6:.0f} MB model"
