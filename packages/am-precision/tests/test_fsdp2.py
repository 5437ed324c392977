"""FSDP2 cases on a real 2-rank gloo group: casting, skip_modules, lm-head mixed precision, frozen casts, report.

The ranks are launched once for this module through am-testing's `run_group` (am_precision_fsdp2_worker.py runs
every case and returns facts per rank); each test asserts on one case for every rank. A rank that fails, hangs or
crashes fails the tests with its traceback, never a hang (the launch has a deadline).
"""

from __future__ import annotations

from typing import Any

import pytest

from am_testing import run_group

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 240  # imports + process group + all cases take ~15 s on 2 cores; generous for loaded CI

pytest.importorskip("transformers", reason="the lm-head case needs transformers (the 'hf' extra)")


@pytest.fixture(scope="module")
def rank_results() -> list[dict[str, Any]]:
    from am_precision_fsdp2_worker import run_on_group

    return run_group(WORLD_SIZE, run_on_group, timeout=LAUNCH_TIMEOUT_S)


def facts(rank_results: list[dict[str, Any]], case: str) -> list[dict[str, Any]]:
    """The facts of `case` on every rank; a case that raised on any rank fails with that rank's traceback."""
    per_rank = []
    for rank, results in enumerate(rank_results):
        result = results[case]
        if not result["ok"]:
            pytest.fail(f"case {case!r} failed on rank {rank}:\n{result['error']}")
        per_rank.append(result["facts"])
    return per_rank


STRICT = ("lm_head.weight",)
NON_STRICT = ("layers.0.norm.weight", "layers.1.norm.weight", "final_norm.weight")


def test_strict_params_stay_fp32_dtensors_with_exact_local_shards(rank_results):
    for f in facts(rank_results, "strict_and_non_strict_params"):
        for name in STRICT:
            assert f["params"][name] == {"dtensor": True, "dtype": "float32", "local_exact": True, "full_exact": True}


def test_non_strict_params_are_cast_with_a_warning_naming_them(rank_results):
    for f in facts(rank_results, "strict_and_non_strict_params"):
        for name in NON_STRICT:
            assert f["params"][name]["dtype"] == "bfloat16"
            assert f["params"][name]["dtensor"]
        (warning,) = f["warnings"]
        assert "_keep_in_fp32_modules_strict" in warning
        for name in NON_STRICT:
            assert name in warning


def test_other_params_are_bf16_dtensors_with_exactly_rounded_values(rank_results):
    for f in facts(rank_results, "strict_and_non_strict_params"):
        for name, p in f["params"].items():
            assert p["dtensor"], name
            assert p["local_exact"], name
            assert p["full_exact"], name
            if name not in STRICT:
                assert p["dtype"] == "bfloat16", name


def test_buffers_matching_any_rule_are_restored_bit_exactly(rank_results):
    for f in facts(rank_results, "strict_and_non_strict_params"):
        assert f["original_bias_rounds_in_bf16"]  # the values would not survive a bf16 round trip
        for name in ("layers.0.router.e_score_correction_bias", "final_norm.running_scale"):
            assert f["buffers"][name] == {"dtype": "float32", "exact": True}
        assert f["buffers"]["rotary_emb.inv_freq"]["dtype"] == "bfloat16"  # not protected by any keyword
        assert f["buffers"]["step"] == {"dtype": "int64", "exact": True}


def test_sharded_model_runs_and_matches_unsharded_reference_after_cast(rank_results):
    for f in facts(rank_results, "strict_and_non_strict_params"):
        assert f["forward_dtype"] == "float32"
        # Same dtypes, same values, same ops: FSDP2 all-gathers exactly what the reference holds.
        assert f["forward_max_abs_diff"] == 0.0
        assert f["lm_head_grad_dtype"] == "float32"


def test_fp32_report_on_the_fsdp2_model(rank_results):
    for f in facts(rank_results, "strict_and_non_strict_params"):
        assert f["contract_error"] is None
        entries = f["report_entries"]
        assert entries["lm_head.weight"] == {
            "dtensor": True,
            "dtype": "float32",
            "rule": ["lm_head", True],
            "pinned": True,
            "note": "",
        }
        assert entries["final_norm.weight"]["rule"] == ["norm", False]
        assert not entries["final_norm.weight"]["pinned"]
        assert "not pinned" in entries["final_norm.weight"]["note"]
        assert entries["layers.1.router.e_score_correction_bias"]["pinned"]
        assert f["report"].splitlines()[-1] == "16 tensors, 4 pinned to fp32, 0 violations"


def test_cast_after_forward_with_an_unsharded_root(rank_results):
    for f in facts(rank_results, "cast_after_forward_while_root_is_unsharded"):
        assert f["root_unsharded_before_cast"]  # the situation under test really arose
        # Strict pins in the root group: sharded fp32 DTensors again, values exact.
        assert f["root_params"] == {"embed.weight": [True, "float32"], "final_norm.weight": [True, "float32"]}
        assert f["root_exact"]
        assert f["block_proj"] == "bfloat16"
        (warning,) = f["warnings"]  # only the blocks' non-strict norms are cast, and named
        assert "layers.0.norm.weight" in warning
        assert "final_norm.weight" not in warning


def test_plain_to_after_sharding_is_reported_as_violations(rank_results):
    for f in facts(rank_results, "plain_to_after_sharding_breaks_contract"):
        assert f["violations"] == [
            "final_norm.running_scale",
            "layers.0.router.e_score_correction_bias",
            "layers.1.router.e_score_correction_bias",
            "lm_head.weight",
        ]


def test_skip_modules_keeps_an_fsdp2_fp32_holder_fp32(rank_results):
    for f in facts(rank_results, "skip_modules_keeps_fp32_holder"):
        assert f["with_skip"] == {
            "dtensor": True,
            "dtype": "float32",
            "full_exact": True,
            "local_exact": True,
            "other_dtype": "bfloat16",
        }
        # Control: without skip_modules the holder is rounded to bf16.
        assert f["without_skip"]["dtype"] == "bfloat16"
        assert not f["without_skip"]["full_exact"]


def test_lm_head_input_is_cast_to_the_fsdp2_param_dtype(rank_results):
    for f in facts(rank_results, "lm_head_uses_fsdp_param_dtype"):
        assert f["weight_storage_dtype"] == "float32"
        assert f["logits_dtype"] == "bfloat16"
        assert f["logits_shape"] == [2, 3, 6]
        assert f["logits_max_abs_diff"] == 0.0
        assert f["direct_call_error"] is not None  # the cast is what makes the fp32 input work


def test_frozen_cast_skips_dtensor_weights_but_casts_siblings_and_buffers(rank_results):
    for f in facts(rank_results, "frozen_cast_skips_dtensor_weights"):
        assert f == {
            "sharded_weight": [True, "float32"],
            "plain_sibling": "bfloat16",
            "tower_buffer": "bfloat16",
            "head": "float32",
        }


def test_yield_fp32_model_on_a_sharded_model(rank_results):
    for f in facts(rank_results, "yield_fp32_on_sharded_model"):
        assert f["inside"] == ["float32"]
        assert f["after"]["lm_head.weight"] == "float32"
        assert {d for n, d in f["after"].items() if n != "lm_head.weight"} == {"bfloat16"}
        assert f["head_exact"]
        assert f["embed_rounded_once"]


def test_deferred_gradient_sync_gives_plain_fsdp_gradients_reducing_only_at_the_last_backward(rank_results):
    """enable_fsdp_optimizations: `prepare_for_grad_accumulation` / `prepare_for_final_backward` (upstream's
    MoEFSDPSyncMixin rule) reduce-scatter only in the last backward of a step, with the gradients of plain FSDP2
    accumulation."""
    for f in facts(rank_results, "deferred_sync_accumulates_the_same_gradients"):
        plain, deferred = f["calls"]["plain"], f["calls"]["deferred"]
        assert deferred["units"] == 3
        assert plain["reduced_early"] == [True, True]  # plain FSDP2: a reduce-scatter after every backward
        assert deferred["reduced_early"] == [False, False]  # deferred: only the last backward reduce-scatters
        assert f["max_diff"] < 1e-6  # fp32, the same sums in another order
        assert f["pp_noop"] == 0
