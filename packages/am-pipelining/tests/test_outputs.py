"""`read_stage_output`: the last stage's output read by declared names (`pipeline_output_names`), upstream's
tuple convention without a declaration, and clear errors for declarations that do not fit."""

from __future__ import annotations

import pytest
import torch

from am_model_contract import ModelContract, PipelineContract
from am_pipelining import StageOutput, read_stage_output
from am_pipelining.outputs import output_names_problems, pipeline_output_names


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def test_declared_names_with_a_per_depth_group_take_every_depth():
    logits, h1, h2, h3, ids = _t(1, 4, 7), _t(1, 4, 3), _t(1, 4, 3), _t(1, 4, 3), _t(1, 4, dtype=torch.long)
    names = ("logits", "mtp_per_depth_h", "seq_idx")
    parts = read_stage_output((logits, h1, h2, h3, ids), names=names)
    assert parts.logits is logits
    assert parts.mtp_per_depth_h == (h1, h2, h3)
    assert parts.seq_idx is ids
    none = read_stage_output((logits, ids), names=names)
    assert none.mtp_per_depth_h == ()
    assert none.seq_idx is ids
    logits_only = read_stage_output((logits,), names=("logits",))
    assert logits_only.mtp_per_depth_h == ()
    assert logits_only.seq_idx is None


def test_undeclared_tuples_keep_the_upstream_convention():
    logits, h1, ids = _t(1, 4, 7), _t(1, 4, 3), _t(1, 4, dtype=torch.int32)
    parts = read_stage_output((logits, h1, ids))
    assert parts.mtp_per_depth_h == (h1, ids), "an undeclared int tensor is NOT taken for seq_idx"
    assert parts.seq_idx is None
    assert read_stage_output((logits, h1), mtp_outputs_are_logits=True).mtp_per_depth_logits == (h1,)
    assert read_stage_output(logits).logits is logits
    named = StageOutput(logits, seq_idx=ids)
    assert read_stage_output(named) is named


def test_model_outputs_are_read_by_attribute():
    class Output:
        logits = _t(1, 4, 7)
        mtp_per_depth_h = (_t(1, 4, 3),)

    parts = read_stage_output(Output())
    assert parts.logits is Output.logits
    assert parts.mtp_per_depth_h == Output.mtp_per_depth_h


def test_bad_declarations_and_lengths_are_errors():
    assert output_names_problems(("logits", "mtp_per_depth_h", "seq_idx")) == []
    problems = output_names_problems(("mtp_per_depth_h", "mtp_per_depth_logits", "hidden", "seq_idx", "seq_idx"))
    assert len(problems) == 4, problems
    with pytest.raises(ValueError, match="unknown names"):
        read_stage_output((_t(1),), names=("logits", "labels"))
    with pytest.raises(ValueError, match=r"returned 3 tensors but pipeline_output_names .* declares 2"):
        read_stage_output((_t(1), _t(1), _t(1)), names=("logits", "seq_idx"))
    with pytest.raises(ValueError, match="declares at least 2"):
        read_stage_output((_t(1),), names=("logits", "mtp_per_depth_h", "seq_idx"))


def test_declaration_is_read_from_the_contract():
    class Declared:
        def am_contract(self) -> ModelContract:
            return ModelContract(pp=PipelineContract(output_names=["logits", "seq_idx"]))  # a list works too

    assert pipeline_output_names(Declared()) == ("logits", "seq_idx")
    assert pipeline_output_names(object()) is None
    assert pipeline_output_names(None) is None
