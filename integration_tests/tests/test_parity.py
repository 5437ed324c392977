"""Parity: every parallel layout trains exactly like the single-process run of the same model and data.

Contract: fp32, 3 steps; the loss of every step and every final weight (the HF-format export of the last
checkpoint) equal the single-process run's within `RTOL` relative. Weights are compared per tensor by the Frobenius
norm of the difference over the norm of the reference (an element-wise relative error is meaningless for values
that cross zero). The references are the trainer itself at world size 1: the model's own loss is checked against
an independent oracle in test_units.py.
"""

from __future__ import annotations

import pytest
import torch

RTOL = 1e-5  # fp32: the layouts differ only in summation order (pipeline p2p, FSDP2 reduce-scatter, ring merges)

CASES = [
    ("nemotron-pp2-1f1b", "nemotron"),  # Nemotron-H with MTP, 1F1B
    ("nemotron-pp2-interleaved", "nemotron"),  # 2 stages per rank, Interleaved1F1B
    ("nemotron-pp2-dp2", "nemotron"),  # pipeline x FSDP2
    ("gemma4-moe-cp2", "gemma4-moe"),  # model-owned context parallelism, MoE
    ("gemma4-moe-cp2-dp2", "gemma4-moe"),  # CP x FSDP2 (FSDP2 over the flattened dp x cp axis)
    ("llama-tied-pp2", "llama-tied"),  # HF Llama, tied embeddings split across two stages
    ("gemma4-pp2", "gemma4"),  # Gemma 4 dense, tied head, pipeline
    ("nemotron-cp2", "nemotron"),  # Nemotron-H under CP: ring attention, Mamba2 state passing, MTP targets
    ("nemotron-pp2-cp2", "nemotron"),  # pipeline x CP (4 ranks): each stage runs its layers under the CP group
    ("gemma4-pp2-cp2", "gemma4"),  # pipeline x CP with sliding + full attention and a tied head
    ("gemma4-moe-pp2", "gemma4-moe"),  # Gemma 4 MoE through the pipeline (padding mask passed to every stage)
]


def assert_weights_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, rtol: float) -> None:
    assert actual.keys() == expected.keys(), f"different tensors: {sorted(actual.keys() ^ expected.keys())}"
    failures = []
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, f"{name}: {got.dtype} vs {want.dtype}"
        assert got.shape == want.shape, f"{name}: {tuple(got.shape)} vs {tuple(want.shape)}"
        error = (got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)
        if error > rtol:
            failures.append(f"{name}: relative error {error.item():.2e}")
    assert not failures, "weights differ from the single-process run:\n" + "\n".join(failures)


@pytest.mark.parametrize(("case", "reference"), CASES, ids=[case for case, _ in CASES])
def test_parallel_run_equals_single_process(runs, case: str, reference: str) -> None:
    """Loss at every step and the final weights equal the single-process run (fp32, RTOL)."""
    parallel, single = runs.get(case).check(), runs.get(reference).check()
    got, want = torch.tensor(parallel.summary["losses"]), torch.tensor(single.summary["losses"])
    assert got.shape == want.shape == (3,)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0)
    assert_weights_close(parallel.final_weights(), single.final_weights(), rtol=RTOL)


@pytest.mark.parametrize("reference", ["nemotron", "gemma4-moe", "llama-tied", "gemma4"])
def test_single_process_run_learns(runs, reference: str) -> None:
    """The reference runs really train: finite losses that change from step to step and non-zero gradients (a parity
    test against a run that does nothing would prove nothing)."""
    import math

    run = runs.get(reference).check()
    assert all(math.isfinite(loss) for loss in run.summary["losses"])
    assert all(norm > 0 for norm in run.summary["grad_norms"])
    assert len(set(run.summary["losses"])) == len(run.summary["losses"])


@pytest.mark.parametrize(
    ("case", "pp", "cp"), [("nemotron-cp2", 1, 2), ("nemotron-pp2-cp2", 2, 2), ("gemma4-pp2-cp2", 2, 2)]
)
def test_summary_records_the_cp_size_and_layout(runs, case: str, pp: int, cp: int) -> None:
    """summary.json's layout names the CP size and the CP layout that ran (both models use the contiguous one)."""
    layout = runs.get(case).check().summary["layout"]
    assert (layout["pp"], layout["dp"], layout["cp"]) == (pp, 1, cp)
    assert layout["cp_layout"] == "contiguous"


def test_summary_records_no_cp_layout_without_cp(runs) -> None:
    assert runs.get("nemotron").check().summary["layout"]["cp_layout"] is None
