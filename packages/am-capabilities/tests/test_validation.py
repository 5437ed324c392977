"""``validate_for_mesh`` (every problem reported at once, one actionable line each) and
``attach_capabilities_and_validate`` (the model keeps its class; idempotence, deep copies, pickling; FSDP2 on gloo
is in ``test_mesh.py``'s one launch)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import pickle
import re
import weakref
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
import torch.nn as nn

from am_capabilities import MeshContext, ModelSupports, attach_capabilities_and_validate, validate_for_mesh
from am_model_contract import ExpertParallelContract, ModelContract, conventional_contract


class Plain(nn.Module):
    """Supports no model-side parallelism at all."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class HybridCustom(Plain):
    def __init__(self, attn: str) -> None:
        super().__init__()
        self.backend = SimpleNamespace(attn=attn)
        self.config = SimpleNamespace(layers_block_type=["mamba", "attention"])


class ExpertParallelHook:
    """What our MoE model classes implement: the hook that shards the experts over the ep ranks, declared in the
    contract (the rest of the contract from the class attributes, as for a model that declares none)."""

    moe: ClassVar[bool] = False

    def am_contract(self) -> ModelContract:
        contract = conventional_contract(self)
        return dataclasses.replace(
            contract, ep=ExpertParallelContract(is_moe=self.moe, apply=self.apply_expert_parallel)
        )

    def apply_expert_parallel(self, ep_mesh: Any) -> list[nn.Module]:
        return []


class DeclaredMoE(ExpertParallelHook, Plain):
    """Upstream's Gemma4-MoE shape: an MoE model that declares PP unsupported."""

    moe = True
    _owns_cp_attention = True

    class ModelCapabilities:
        supports_ep = True
        supports_cp = True


class Everything(ExpertParallelHook, Plain):
    moe = True
    _tp_plan: ClassVar[dict[str, str]] = {"proj": "colwise"}
    _owns_cp_attention = True


def _problems(error: pytest.ExceptionInfo[ValueError]) -> list[str]:
    lines = str(error.value).splitlines()
    assert all(line.startswith("  - ") for line in lines[1:])
    return [line[4:] for line in lines[1:]]


# ================================================================================================================
# validate_for_mesh
# ================================================================================================================


def test_none_mesh_is_a_no_op():
    assert validate_for_mesh(Plain(), None) is None


@pytest.mark.parametrize(
    "mesh", [MeshContext(), SimpleNamespace(), SimpleNamespace(tp_size=1, pp_size=1, cp_size=1, ep_size=1, dp_size=8)]
)
def test_size_one_axes_never_fail(mesh):
    validate_for_mesh(Plain(), mesh)


@pytest.mark.parametrize(
    ("axis", "pattern"),
    [
        ("tp", r"^tp_size=2: Plain cannot use tensor parallelism: .*`_tp_plan`.*\. Fix: set tp_size=1"),
        ("pp", r"^pp_size=2: Plain cannot use pipeline parallelism: .*`_pp_plan`.*\. Fix: set pp_size=1"),
        ("cp", r"^cp_size=2: Plain cannot use context parallelism: .*_supports_sdpa.*\. Fix: set cp_size=1"),
        (
            "ep",
            r"^ep_size=2: Plain cannot use expert parallelism: .*`apply_expert_parallel\(ep_mesh\)`.*\. "
            r"Fix: set ep_size=1",
        ),
    ],
)
def test_each_axis_error_names_axis_size_reason_and_fix(axis, pattern):
    with pytest.raises(ValueError, match=r"^Unsupported configuration for Plain \(1 problem\):") as info:
        validate_for_mesh(Plain(), SimpleNamespace(**{f"{axis}_size": 2}))
    (problem,) = _problems(info)
    assert re.search(pattern, problem), problem


def test_every_violation_is_reported_at_once():
    mesh = SimpleNamespace(tp_size=2, pp_size=4, cp_size=2, ep_size=8, dp_size=0)
    with pytest.raises(ValueError, match=r"\(5 problems\)") as info:
        validate_for_mesh(Plain(), mesh)
    problems = _problems(info)
    assert [p.split(":")[0] for p in problems] == ["dp_size=0", "tp_size=2", "pp_size=4", "cp_size=2", "ep_size=8"]


def test_invalid_sizes_are_listed_with_capability_problems():
    mesh = SimpleNamespace(tp_size=0, pp_size=2.0, cp_size=2, ep_size="1")
    with pytest.raises(ValueError, match=r"^Unsupported configuration for ") as info:
        validate_for_mesh(Plain(), mesh)
    problems = _problems(info)
    assert len(problems) == 4
    assert problems[0].startswith("tp_size=0: sizes must be >= 1. Fix:")
    assert problems[1].startswith("pp_size=2.0:")
    assert "write pp_size=2 as an int" in problems[1]
    assert problems[2].startswith("ep_size='1':")  # a string is wrong even when it spells 1
    assert problems[3].startswith("cp_size=2: Plain cannot use context parallelism")


def test_supported_mesh_passes():
    validate_for_mesh(Everything(), MeshContext(tp_size=2, pp_size=2, cp_size=2, ep_size=2, dp_size=2))


def test_hybrid_cp_messages_depend_on_backend(tiny_nemotron_h):
    with pytest.raises(ValueError, match=r"^Unsupported configuration for ") as info:
        validate_for_mesh(HybridCustom("flex"), MeshContext(cp_size=2))
    (problem,) = _problems(info)
    assert "hybrid model" in problem
    assert "['te', 'sdpa']" in problem
    assert "got 'flex'" in problem
    validate_for_mesh(HybridCustom("sdpa"), MeshContext(cp_size=2))

    hf_model = tiny_nemotron_h(layers_block_type=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"^Unsupported configuration for ") as info:
        validate_for_mesh(hf_model, MeshContext(cp_size=2))
    (problem,) = _problems(info)
    assert problem.startswith("cp_size=2: NemotronHForCausalLM cannot use context parallelism")
    assert "Mamba/SSM" in problem


def test_real_hf_models_on_a_full_mesh(tiny_llama, tiny_nemotron_h):
    mesh = MeshContext(tp_size=2, pp_size=2, cp_size=2, ep_size=1, dp_size=2)
    validate_for_mesh(tiny_llama(), mesh)
    with pytest.raises(ValueError, match=r"^Unsupported configuration for ") as info:
        validate_for_mesh(tiny_nemotron_h(hybrid_override_pattern="M*"), mesh)
    problems = _problems(info)
    # transformers' NemotronH plan shards experts with 'moe_tp_experts' (experts are expert-parallel here) and names
    # expert modules this hybrid does not have: am-tensor-parallel could not apply it, so tp_size=2 is refused too
    assert [p.split(":")[0] for p in problems] == ["tp_size=2", "pp_size=2", "cp_size=2"]
    assert "'moe_tp_experts' is not supported" in problems[0]


def test_tp_needs_sizes_the_plan_can_split(hf):
    """A plan exists, but 1 KV head cannot be split over tp=2: refused with the reason, by both answers."""
    config = hf.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = hf.LlamaForCausalLM(config)
    assert ModelSupports(model).supports_tp  # tp_size 1: a plan exists
    assert not ModelSupports(model, MeshContext(tp_size=2)).supports_tp
    with pytest.raises(ValueError, match=r"\(1 problem\)") as info:
        validate_for_mesh(model, MeshContext(tp_size=2))
    (problem,) = _problems(info)
    assert problem.startswith("tp_size=2: LlamaForCausalLM cannot use tensor parallelism: its tensor-parallel plan")
    assert "1 key/value heads cannot be split over tp=2" in problem
    assert problem.endswith("Fix: choose a tp_size that divides these sizes, or set tp_size=1.")


def test_declared_capabilities_and_validator_agree():
    """The upstream disagreement: an MoE model declaring pp=False must be rejected for PP."""
    model = DeclaredMoE()
    assert not ModelSupports(model).supports_pp
    with pytest.raises(ValueError, match=r"^Unsupported configuration for ") as info:
        validate_for_mesh(model, MeshContext(pp_size=2, ep_size=2, cp_size=2))
    (problem,) = _problems(info)
    assert problem.startswith("pp_size=2:")
    assert "supports_pp=False" in problem


# ---- expert parallelism: the hook, not a marker or a declaration, is what makes ep_size > 1 run ----------------


class MarkedMoE(Plain):
    """An MoE model (marker) that does not implement expert parallelism."""

    def am_contract(self) -> ModelContract:
        return ModelContract(ep=ExpertParallelContract(is_moe=True))


class DeclaredWithoutHook(Plain):
    """Declares supports_ep=True but has nothing that would shard its experts."""

    class ModelCapabilities:
        supports_ep = True


class HookDeclaredOff(ExpertParallelHook, Plain):
    """Implements the hook, but its declaration for this config says no (e.g. a dense config)."""

    @classmethod
    def get_capabilities(cls, config: Any) -> dict[str, bool]:
        return {"supports_ep": config.moe}


class HookWithExperts(ExpertParallelHook, Plain):
    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.config = SimpleNamespace(**config)


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (MarkedMoE, r"parallelism: it has no `apply_expert_parallel\(ep_mesh\)` method, so nothing would shard"),
        (DeclaredWithoutHook, r"declaration says supports_ep=True, but it has no `apply_expert_parallel"),
        (lambda: _with_config(HookDeclaredOff(), moe=False), r"its capability declaration says supports_ep=False"),
    ],
    ids=["moe_marker_only", "declared_without_hook", "hook_but_declared_off"],
)
def test_ep_is_refused_without_an_implementation(build, reason):
    model = build()
    assert not ModelSupports(model).supports_ep
    name = type(model).__name__
    with pytest.raises(ValueError, match=rf"^Unsupported configuration for {name} \(1 problem\):") as info:
        validate_for_mesh(model, MeshContext(ep_size=2, dp_size=2))
    (problem,) = _problems(info)
    assert problem.startswith(f"ep_size=2: {name} cannot use expert parallelism: ")
    assert re.search(reason, problem), problem
    assert "Fix: set ep_size=1" in problem


def _with_config(model: nn.Module, **config: Any) -> nn.Module:
    model.config = SimpleNamespace(**config)
    return model


def test_ep_runs_for_models_with_the_hook():
    hook, declared_on = HookWithExperts(n_routed_experts=8), _with_config(HookDeclaredOff(), moe=True)
    for model in (hook, declared_on, DeclaredMoE()):
        assert ModelSupports(model).supports_ep
        validate_for_mesh(model, MeshContext(ep_size=4, dp_size=4))


def test_hf_moe_model_without_the_hook_is_refused(tiny_nemotron_h):
    model = tiny_nemotron_h(hybrid_override_pattern="ME")  # transformers' NemotronH: MoE, no expert parallelism
    assert not ModelSupports(model).supports_ep
    with pytest.raises(ValueError, match="NemotronHForCausalLM cannot use expert parallelism: it has no `apply_exp"):
        validate_for_mesh(model, MeshContext(ep_size=2))


def test_indivisible_experts_are_listed_with_every_other_problem():
    model = HookWithExperts(n_routed_experts=6, text_config=SimpleNamespace(num_experts=12))
    with pytest.raises(ValueError, match=r"\(2 problems\)") as info:
        validate_for_mesh(model, MeshContext(ep_size=4, tp_size=2))
    problems = _problems(info)
    assert problems[0].startswith("tp_size=2:")
    assert problems[1] == (
        "ep_size=4: HookWithExperts cannot use expert parallelism: its experts cannot be split evenly over "
        "ep_size=4 ranks (n_routed_experts=6 not divisible by 4). Fix: choose an ep_size that divides the number "
        "of experts."
    )
    validate_for_mesh(model, MeshContext(ep_size=2))
    validate_for_mesh(HookWithExperts(num_local_experts=8, num_experts=None), MeshContext(ep_size=8))


class DynamicNoConfig(Plain):
    """Declares capabilities per config, but this instance has no config."""

    @classmethod
    def get_capabilities(cls, config: Any) -> dict[str, bool]:
        return {"supports_tp": bool(config.tp)}


def test_size_one_mesh_never_evaluates_the_declaration():
    model = DynamicNoConfig()
    validate_for_mesh(model, MeshContext(dp_size=8))
    attach_capabilities_and_validate(model, SimpleNamespace(tp_size=1, dp_size=2))
    with pytest.raises(ValueError, match="a config is required"):
        validate_for_mesh(model, MeshContext(tp_size=2))


_MODELS = {
    "plain": Plain,
    "everything": Everything,
    "declared_moe": DeclaredMoE,
    "hybrid_flex": lambda: HybridCustom("flex"),
    "hybrid_te": lambda: HybridCustom("te"),
}


@pytest.mark.parametrize(("name", "axis"), list(itertools.product(_MODELS, ("tp", "pp", "cp", "ep"))))
def test_validator_rejects_exactly_what_model_supports_denies(name, axis):
    model = _MODELS[name]()
    supported = getattr(ModelSupports(model), f"supports_{axis}")
    mesh = SimpleNamespace(**{f"{axis}_size": 2})
    if supported:
        validate_for_mesh(model, mesh)
    else:
        with pytest.raises(ValueError, match=f"{axis}_size=2"):
            validate_for_mesh(model, mesh)


# ================================================================================================================
# attach_capabilities_and_validate
# ================================================================================================================


def test_attach_keeps_the_class(tiny_llama):
    """No dynamic subclass: ``type(model)`` stays the original class (FSDP2, pickle and isinstance see no wrapper)."""
    model = tiny_llama()
    original = type(model)
    assert attach_capabilities_and_validate(model, MeshContext(tp_size=2)) is model
    assert type(model) is original
    assert model.supports.tp_size == 2
    assert model.supports.describes(model)


def test_attach_is_idempotent():
    first, second = Plain(), Plain()
    attach_capabilities_and_validate(first)
    attach_capabilities_and_validate(first, MeshContext(dp_size=2))
    attach_capabilities_and_validate(second)
    assert type(first) is Plain
    assert type(second) is Plain
    assert not {"supports", "supports_tp", "supports_cp"} & set(vars(Plain))  # the class is not patched
    assert first.supports.mesh == MeshContext(dp_size=2)
    assert second.supports.mesh is None


def test_attach_validates_and_leaves_a_rejected_model_untouched():
    model = Plain()
    with pytest.raises(ValueError, match="tp_size=2"):
        attach_capabilities_and_validate(model, MeshContext(tp_size=2))
    assert type(model) is Plain
    assert not hasattr(model, "supports")


def test_unattached_instances_of_an_attached_class_are_unaffected():
    """Attaching one instance changes nothing for the others of its class, and never hides instance attributes."""
    attach_capabilities_and_validate(Plain())
    other = Plain()
    assert not hasattr(other, "supports")
    with pytest.raises(AttributeError, match="'Plain' object has no attribute 'supports_tp'"):
        _ = other.supports_tp
    other.supports_tp = "own value"  # assignable, and it wins over the descriptor
    assert other.supports_tp == "own value"
    attach_capabilities_and_validate(other)
    assert other.supports_tp == "own value"
    assert other.supports.supports_tp is False


def test_reattach_updates_the_mesh():
    model = Everything()
    attach_capabilities_and_validate(model, MeshContext(ep_size=1))
    assert model.supports.ep_size == 1
    attach_capabilities_and_validate(model, SimpleNamespace(ep_size=4))
    assert model.supports.ep_size == 4
    assert model.supports.mesh == MeshContext(ep_size=4)


def test_flags_on_supports_and_model_owned_names(tiny_llama):
    custom = attach_capabilities_and_validate(Everything())
    assert custom.supports.supports_tp
    assert custom.supports.supports_ep
    assert custom.supports.supports_cp
    assert not custom.supports.is_custom_model
    assert custom.supports.supports_tp_plan
    assert not custom.supports.supports_thd
    assert not hasattr(custom, "supports_tp")  # no forwarding copies: they would need a patched or swapped class

    model = tiny_llama()
    hf_value = type(model).supports_gradient_checkpointing
    attach_capabilities_and_validate(model, MeshContext(ep_size=1))
    # HF's own class attribute is not shadowed; ours is on model.supports.
    assert "supports_gradient_checkpointing" not in vars(type(model))
    assert model.supports_gradient_checkpointing is hf_value
    assert model.supports.supports_gradient_checkpointing is True
    assert model.supports.supports_cp is True
    assert model.supports.supports_sequence_packing is True


def test_flags_follow_live_changes():
    model = attach_capabilities_and_validate(HybridCustom("flex"))
    supports = model.supports
    assert supports.supports_cp is False
    model.backend = SimpleNamespace(attn="sdpa")
    assert supports.supports_cp is True
    assert model.supports.supports_cp is True
    assert model.supports.mtp_enabled is False
    model.mtp_config = SimpleNamespace(enabled=True)
    assert model.supports.mtp_enabled is True


def test_model_with_its_own_supports_attribute_is_refused():
    class OwnSupports(Plain):
        supports = "mine"

    with pytest.raises(TypeError, match="already defines 'supports'"):
        attach_capabilities_and_validate(OwnSupports())
    model = Plain()
    model.supports = "mine"
    with pytest.raises(TypeError, match="instance holds its own 'supports'"):
        attach_capabilities_and_validate(model)


def test_attached_model_is_freed_by_reference_counting():
    """``model.supports`` refers to the model weakly: dropping the last reference frees it without the cycle
    collector, and the flags then say so instead of answering for a freed model."""
    model = attach_capabilities_and_validate(Plain(), MeshContext(dp_size=2))
    supports = model.supports
    assert supports.describes(model)
    assert not supports.supports_tp
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert alive() is None
    finally:
        gc.enable()
    with pytest.raises(ReferenceError, match=r"garbage-collected.*Fix: keep a reference to the model"):
        _ = supports.supports_tp


def test_deep_copy_gets_its_own_supports(tiny_llama):
    """PP stages are deep copies of the model: each copy must describe itself, even after the original is gone."""
    model = tiny_llama()
    attach_capabilities_and_validate(model, MeshContext(pp_size=2))
    stage = copy.deepcopy(model)
    assert type(stage) is type(model)
    assert stage.supports.describes(stage)
    assert stage.supports.pp_size == 2
    assert model.supports.describes(model)
    del model
    gc.collect()
    assert stage.supports.supports_pp
    assert stage.supports.supports_cp
    tokens = torch.randint(0, 64, (1, 4))
    assert stage(tokens).logits.shape == (1, 4, 64)


def test_deep_copy_of_a_compiled_attached_model_runs_its_own_weights():
    """``Module.compile()`` stores a compiled call bound to the instance; a copy must not inherit it (the copy's
    forward would silently run the original's weights), exactly as a plain deep copy drops it."""
    model = Plain()
    model.compile(backend="eager")
    attach_capabilities_and_validate(model)
    clone = copy.deepcopy(model)
    assert "_compiled_call_impl" not in vars(clone)
    with torch.no_grad():
        clone.proj.weight.zero_()
        clone.proj.bias.fill_(3.0)
    x = torch.ones(2, 4)
    assert torch.equal(clone(x), torch.full((2, 4), 3.0))
    assert not torch.equal(model(x), clone(x))


def test_a_wrapper_class_swapped_in_later_keeps_the_capabilities():
    """What FSDP2's ``fully_shard`` does (a dynamic subclass over the model's class) needs no cooperation from us;
    the real FSDP2 case runs on gloo in ``test_mesh.py``."""
    model = attach_capabilities_and_validate(Plain(), MeshContext(dp_size=2))
    wrapper = type("FSDPModuleStandIn", (nn.Module,), {})
    model.__class__ = type("FSDPPlain", (wrapper, Plain), {})
    assert model.supports.describes(model)
    assert model.supports.mesh == MeshContext(dp_size=2)
    clone = copy.deepcopy(model)
    assert type(clone) is type(model)
    assert clone.supports.describes(clone)
    assert clone.supports.mesh == MeshContext(dp_size=2)


def test_deep_copy_keeps_shared_submodules_shared():
    model = Plain()
    model.alias = model.proj  # two names, one module
    attach_capabilities_and_validate(model)
    clone = copy.deepcopy(model)
    assert clone.alias is clone.proj
    assert clone.proj is not model.proj


def test_pickle_round_trip_restores_an_attached_model(tiny_llama):
    model = tiny_llama()
    attach_capabilities_and_validate(model, MeshContext(tp_size=2))
    restored = pickle.loads(pickle.dumps(model))
    assert type(restored) is type(model)
    assert restored.supports.describes(restored)
    assert restored.supports.tp_size == 2
    tokens = torch.randint(0, 64, (1, 5))
    torch.testing.assert_close(restored(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def test_pickled_bytes_hold_only_the_mesh():
    model = attach_capabilities_and_validate(Plain(), MeshContext(pp_size=1, dp_size=2))
    payload = pickle.dumps(model)
    restored: Any = pickle.loads(payload)
    assert type(restored) is Plain
    assert b"ModelSupports" not in payload  # the weak reference never travels
    assert restored.supports.mesh == MeshContext(dp_size=2)
