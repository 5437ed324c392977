"""`contract_of`: a model's own declaration, and the documented default of a model that declares none (an unmodified
HuggingFace model; NeMo AutoModel's class flags)."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from am_model_contract import (
    ContextParallelContract,
    ExpertParallelContract,
    ModelContract,
    PipelineContract,
    TensorParallelContract,
    contract_of,
    conventional_contract,
    declared_tp_plan,
    declares_contract,
)


class Declared(nn.Module):
    """A model that declares its contract, with hooks bound to the instance."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def am_contract(self) -> ModelContract:
        return ModelContract(
            cp=ContextParallelContract(layout="contiguous", owns_attention=True, problems=self.cp_limits),
            pp=PipelineContract(keeps_own_forward=True, output_names=("logits", "seq_idx")),
            ep=ExpertParallelContract(is_moe=True, apply=self.shard_experts),
        )

    def cp_limits(self, *, seq_len: int, local_seq_len: int, cp_size: int) -> list[str]:
        return [] if local_seq_len >= 2 else ["too short"]

    def shard_experts(self, ep_mesh: Any) -> Any:
        return self


def test_a_declared_contract_is_read_with_its_hooks_bound_to_the_instance() -> None:
    model = Declared()
    contract = contract_of(model)
    assert declares_contract(model)
    assert contract.cp.layout == "contiguous"
    assert contract.cp.owns_attention
    assert contract.cp.problems is not None
    assert contract.cp.problems(seq_len=2, local_seq_len=1, cp_size=2)
    assert contract.pp.output_names == ("logits", "seq_idx")
    assert contract.pp.keeps_own_forward
    assert contract.ep.apply is not None
    assert contract.ep.apply(None) is model
    # a copy (a pipeline stage) answers for itself
    stage = copy.deepcopy(model)
    stage_contract = contract_of(stage)
    assert stage_contract.ep.apply is not None
    assert stage_contract.ep.apply(None) is stage


def test_a_broken_declaration_names_the_fix() -> None:
    class Wrong(nn.Module):
        def am_contract(self) -> dict[str, str]:
            return {"layout": "contiguous"}

    class NotCallable(nn.Module):
        am_contract = "contiguous"

    with pytest.raises(TypeError, match=r"Wrong.am_contract\(\) must return an am_model_contract.ModelContract"):
        contract_of(Wrong())
    with pytest.raises(TypeError, match=r"NotCallable\.am_contract must be a method"):
        contract_of(NotCallable())


def test_an_unmodified_hf_model_gets_the_contract_its_class_describes() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    contract = contract_of(model)
    assert not declares_contract(model)
    assert contract.cp == ContextParallelContract(sdpa_attention=True)  # ring attention stands in for its SDPA
    assert contract.pp.plan is not None
    assert "model.layers" in contract.pp.plan
    assert contract.pp.keeps_own_forward is False
    assert contract.pp.output_names is None
    assert contract.tp.plan is not None
    assert contract.tp.plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert contract.ep == ExpertParallelContract()


def test_nemo_automodel_class_flags_are_translated() -> None:
    class NemoStyle(nn.Module):
        _owns_cp_attention = True
        _supports_cp_sdpa = True
        _owns_packed_attention = True
        _packed_cp_attn_backends = ("te", "sdpa")
        _pp_keep_self_forward = True

    model = NemoStyle()
    model._te_attention_injected = True
    contract = contract_of(model)
    assert contract.cp == ContextParallelContract(
        owns_attention=True,
        attention_backends=("te", "sdpa"),
        te_attention=True,
        owns_packed_attention=True,
        packed_attention_backends=("te", "sdpa"),
    )
    assert contract.pp.keeps_own_forward


def test_a_plain_module_declares_nothing() -> None:
    assert contract_of(nn.Linear(2, 2)) == ModelContract()
    assert contract_of(object()) == ModelContract()
    empty_plan = nn.Linear(2, 2)
    empty_plan._pp_plan = {}  # transformers sets `{}` on models without a plan: it declares nothing
    assert contract_of(empty_plan).pp.plan is None


class _Attention(nn.Module):
    _tp_plan: ClassVar[dict[str, str]] = {"q": "colwise", "o": "rowwise"}  # patterns relative to this module

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.o = nn.Linear(4, 4)


class _Mixer(nn.Module):
    _tp_plan: ClassVar[dict[str, str]] = {"": "module"}  # "" names the module itself


class _Stack(nn.Module):
    _tp_plan: ClassVar[dict[str, str]] = {"head": "colwise_rep"}

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Attention(), _Mixer()])
        self.head = nn.Linear(4, 4)

    def am_contract(self) -> ModelContract:
        return ModelContract(tp=TensorParallelContract(plan=declared_tp_plan(self)))


def test_tp_plan_merges_every_module_class_plan_under_its_name() -> None:
    """A declared contract's `tp.plan` from `declared_tp_plan` is the whole model's plan: each class's `_tp_plan`
    under the module's name ("" = the module itself), not only the top-level class's (`head`)."""
    plan = contract_of(_Stack()).tp.plan
    assert plan == {"head": "colwise_rep", "layers.0.q": "colwise", "layers.0.o": "rowwise", "layers.1": "module"}
    # an instance plan set by hand is the fallback of a model whose classes declare none
    plain = nn.Linear(2, 2)
    assert declared_tp_plan(plain) is None
    plain._tp_plan = {"": "colwise"}  # type: ignore[assignment]
    assert contract_of(plain).tp.plan == {"": "colwise"}
    # a class (read before any instance exists, e.g. for its attention flags) gives its own class plan
    assert conventional_contract(_Stack).tp.plan == {"head": "colwise_rep"}
