"""The schema: defaults, normalisation, and every invalid field listed in one error."""

from __future__ import annotations

import pytest

import am_model_contract
from am_model_contract import (
    ContextParallelContract,
    ExpertParallelContract,
    ModelContract,
    PipelineContract,
    TensorParallelContract,
)
from am_testing import root_api_problems


def test_root_api_follows_the_rule() -> None:
    assert root_api_problems(am_model_contract) == []


def test_defaults_declare_nothing() -> None:
    contract = ModelContract()
    assert contract.cp.layout == "load_balanced"
    assert not contract.cp.owns_attention
    assert contract.cp.options is None
    assert contract.cp.problems is None
    assert contract.pp == PipelineContract(plan=None, keeps_own_forward=False, output_names=None)
    assert contract.ep.apply is None
    assert contract.ep.is_moe is False
    assert contract.tp.plan is None


def test_name_sequences_become_tuples() -> None:
    assert PipelineContract(output_names=["logits", "seq_idx"]).output_names == ("logits", "seq_idx")
    assert ContextParallelContract(packed_attention_backends=["sdpa"]).packed_attention_backends == ("sdpa",)


def test_every_invalid_cp_field_is_listed() -> None:
    with pytest.raises(ValueError, match="invalid ContextParallelContract") as info:
        ContextParallelContract(
            layout="striped",  # type: ignore[arg-type]
            owns_attention=1,  # type: ignore[arg-type]
            attention_backends="sdpa",  # type: ignore[arg-type]
            problems="none",  # type: ignore[arg-type]
        )
    message = str(info.value)
    for expected in (
        "layout must be one of",
        "owns_attention must be a bool",
        "attention_backends must be a",
        "problems",
    ):
        assert expected in message


def test_options_need_the_contiguous_layout() -> None:
    with pytest.raises(ValueError, match='only for layout="contiguous"'):
        ContextParallelContract(options=lambda: None)
    assert ContextParallelContract(layout="contiguous", options=lambda: None).options is not None


def test_invalid_pp_ep_tp_fields() -> None:
    with pytest.raises(ValueError, match="output_names must be a sequence of strings"):
        PipelineContract(output_names="logits")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keeps_own_forward must be a bool"):
        PipelineContract(keeps_own_forward="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="apply must be a callable"):
        ExpertParallelContract(apply=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="plan must be a mapping"):
        TensorParallelContract(plan=["colwise"])  # type: ignore[arg-type]


def test_model_contract_fields_are_typed() -> None:
    with pytest.raises(TypeError, match="cp must be a ContextParallelContract; got dict"):
        ModelContract(cp={"layout": "contiguous"})  # type: ignore[arg-type]


def test_contracts_are_frozen() -> None:
    with pytest.raises(AttributeError):
        ModelContract().cp.layout = "contiguous"  # type: ignore[misc]


def test_prepare_and_loss_hooks_are_callables_or_none() -> None:
    assert ContextParallelContract().prepare is None
    assert PipelineContract().loss is None
    with pytest.raises(ValueError, match="prepare must be a callable"):
        ContextParallelContract(prepare="prepare_batch_for_cp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss must be a callable"):
        PipelineContract(loss="combined_loss")  # type: ignore[arg-type]
