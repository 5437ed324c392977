"""fp32_report / assert_fp32_contract on plain models (the FSDP2 case is in test_fsdp2.py)."""

from __future__ import annotations

import pytest
import torch
from am_precision_toy_models import ToyLM
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from am_precision import KeepRule, assert_fp32_contract, cast_model_to_dtype, fp32_report

BF16 = torch.bfloat16


def test_report_lists_every_tensor_with_rule_and_dtype_after_cast():
    model = ToyLM()
    cast_model_to_dtype(model, BF16)
    report = fp32_report(model, storage_dtype=BF16)
    expected_names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert [e.name for e in report.entries] == expected_names
    bias = report["layers.0.router.e_score_correction_bias"]
    assert (bias.kind, bias.dtype, bias.rule, bias.pinned) == (
        "buffer",
        torch.float32,
        KeepRule("router.e_score_correction_bias", strict=True),
        True,
    )
    norm = report["final_norm.weight"]
    assert (norm.kind, norm.rule, norm.pinned, norm.is_dtensor) == (
        "param",
        KeepRule("norm", strict=False),
        True,
        False,
    )
    head = report["lm_head.weight"]
    assert (head.dtype, head.rule, head.pinned, head.expected_dtype) == (BF16, None, False, BF16)
    step = report["step"]
    assert (step.dtype, step.expected_dtype, step.violation) == (torch.int64, None, None)
    assert report.violations == ()
    assert {e.name for e in report.pinned} == {
        n for n in expected_names if "norm" in n or "e_score_correction_bias" in n
    }
    assert assert_fp32_contract(model, storage_dtype=BF16).entries == report.entries


def test_a_plain_to_breaks_the_contract_and_every_violation_is_listed():
    model = ToyLM().to(BF16)
    with pytest.raises(AssertionError, match=r"fp32 contract violated by (\d+) tensor") as err:
        assert_fp32_contract(model)
    message = str(err.value)
    pinned = [n for n, _ in [*model.named_parameters(), *model.named_buffers()] if "norm" in n or "correction" in n]
    assert f"violated by {len(pinned)} tensor(s)" in message
    for name in pinned:
        assert f"{name!r} is bfloat16, expected float32 (pinned by" in message
    assert "keep rule" in message  # the table follows


def test_storage_dtype_flags_unpinned_tensors_left_in_fp32():
    model = ToyLM()
    report = fp32_report(model, storage_dtype=BF16)
    assert "lm_head.weight" in {e.name for e in report.violations}
    assert "final_norm.weight" not in {e.name for e in report.violations}
    assert fp32_report(model).violations == ()  # without storage_dtype only pins are checked


def test_skipped_modules_carry_no_requirement():
    model = ToyLM()
    model._fp32_params = nn.Linear(2, 2)
    cast_model_to_dtype(model, BF16, skip_modules=("_fp32_params",))
    report = assert_fp32_contract(model, storage_dtype=BF16, skip_modules=("_fp32_params",))
    assert report["_fp32_params.weight"].note == "skipped module"
    with pytest.raises(AssertionError, match=r"_fp32_params\.weight"):
        assert_fp32_contract(model, storage_dtype=BF16)


def test_report_resolves_checkpoint_wrapper_names():
    model = ToyLM()
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    cast_model_to_dtype(model, BF16)
    entry = fp32_report(model)["layers.0._checkpoint_wrapped_module.norm.weight"]
    assert entry.rule == KeepRule("norm", strict=False)
    assert entry.pinned


def test_str_renders_a_table_with_a_summary():
    model = ToyLM()
    cast_model_to_dtype(model, BF16)
    text = str(fp32_report(model))
    lines = text.splitlines()
    assert lines[0].split() == ["name", "kind", "dtype", "dtensor", "keep", "rule", "expected", "status"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    row = next(line for line in lines if line.startswith("layers.0.router.e_score_correction_bias"))
    assert "'router.e_score_correction_bias' (strict)" in row
    assert "float32" in row
    assert row.rstrip().endswith("ok")
    n = len(list(model.parameters())) + len(list(model.buffers()))
    assert lines[-1].startswith(f"{n} tensors, ")
    assert lines[-1].endswith("0 violations")


def test_unknown_name_lookup_raises_key_error():
    with pytest.raises(KeyError, match="no parameter or buffer named 'nope'"):
        fp32_report(ToyLM())["nope"]
