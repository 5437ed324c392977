"""``ModelSupports`` and ``is_hybrid_model`` on real tiny HuggingFace models (Llama, NemotronH, Gemma4, Mistral3)
and on small custom modules that exercise each attribute of the duck-typed protocol."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn

from am_capabilities import (
    MeshContext,
    ModelCapabilities,
    ModelSupports,
    implements_expert_parallelism,
    is_hybrid_model,
)
from am_model_contract import ContextParallelContract, ExpertParallelContract, ModelContract

# ================================================================================================================
# Real HuggingFace models
# ================================================================================================================


def _expected_from_hf_attributes(model: nn.Module) -> dict[str, bool]:
    """What the HF rules say, computed straight from the model's own attributes (independent of the package)."""
    return {
        "supports_tp": bool(model._tp_plan),
        "supports_pp": bool(model._pp_plan),
        "supports_gradient_checkpointing": type(model).supports_gradient_checkpointing is True,
        "supports_generate": hasattr(model, "generate"),
    }


def _assert_matches_hf_attributes(supports: ModelSupports, model: nn.Module) -> None:
    for flag, expected in _expected_from_hf_attributes(model).items():
        assert getattr(supports, flag) is expected, flag


def test_llama_supports_everything_but_ep(tiny_llama):
    model = tiny_llama()
    supports = ModelSupports(model)
    _assert_matches_hf_attributes(supports, model)
    assert model._supports_sdpa is True
    assert not is_hybrid_model(model)
    assert supports.supports_tp
    assert supports.supports_pp
    assert supports.supports_cp
    assert not supports.supports_ep
    assert supports.supports_sequence_packing  # forward takes **kwargs and SDPA packs
    assert supports.supports_gradient_checkpointing
    assert supports.supports_generate
    assert not supports.is_custom_model
    assert not supports.mtp_enabled
    # Declared-only flags are False for an undeclared model.
    assert not supports.supports_thd
    assert not supports.supports_mtp_cp
    assert not supports.supports_cp_vision_frame_sharding
    assert supports.declared_capabilities is None


def test_llama_base_model_cannot_generate(tiny_llama):
    model = tiny_llama(base=True)
    assert not ModelSupports(model).supports_generate
    assert ModelSupports(model).supports_pp  # the base model still carries a full pipeline plan


def test_hf_cp_with_packing_needs_a_model_owned_path(tiny_llama):
    model = tiny_llama()
    assert ModelSupports(model, MeshContext(cp_size=1)).supports_cp_with_sequence_packing
    assert not ModelSupports(model, MeshContext(cp_size=2)).supports_cp_with_sequence_packing


@pytest.mark.parametrize(
    "layer_spec",
    [
        {"layers_block_type": ["linear_attention", "full_attention"]},
        {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]},
        {"hybrid_override_pattern": "M*"},
    ],
    ids=["names-5.23", "names-with-moe", "legacy-pattern"],
)
def test_hf_nemotron_h_hybrid_is_not_cp_capable(tiny_nemotron_h, layer_spec):
    model = tiny_nemotron_h(**layer_spec)
    supports = ModelSupports(model)
    _assert_matches_hf_attributes(supports, model)
    assert is_hybrid_model(model)
    assert not supports.supports_cp  # Mamba layers have no CP path in the HF implementation
    assert supports.supports_tp  # HF ships a TP plan for NemotronH
    # transformers sets `_pp_plan = {}` for NemotronH: an empty plan is no plan.
    assert model._pp_plan == {}
    assert not supports.supports_pp
    # The HF Mamba scan does not reset at document boundaries, so packing would leak state.
    assert not supports.supports_sequence_packing


def test_hf_nemotron_h_legacy_pattern_is_read_as_names(tiny_nemotron_h):
    model = tiny_nemotron_h(hybrid_override_pattern="M*")
    assert model.config.layers_block_type == ["linear_attention", "full_attention"]
    assert model.config.hybrid_override_pattern == "M*"


def test_hf_nemotron_h_without_mamba_layers_is_plain_attention(tiny_nemotron_h):
    model = tiny_nemotron_h(layers_block_type=["full_attention", "mlp"])
    supports = ModelSupports(model)
    assert not is_hybrid_model(model)
    assert supports.supports_cp
    assert supports.supports_sequence_packing


def test_gemma4_text_sliding_and_full_attention_is_not_hybrid(tiny_gemma4):
    model = tiny_gemma4()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    supports = ModelSupports(model)
    _assert_matches_hf_attributes(supports, model)
    assert not is_hybrid_model(model)
    assert supports.supports_cp
    assert supports.supports_sequence_packing


def test_gemma4_vlm_reads_the_text_config(tiny_gemma4):
    model = tiny_gemma4(vlm=True)
    supports = ModelSupports(model)
    _assert_matches_hf_attributes(supports, model)
    assert supports.supports_tp
    assert supports.supports_pp
    assert supports.supports_cp
    assert not supports.supports_ep


def test_gemma4_vlm_becomes_hybrid_when_its_text_config_says_so(tiny_gemma4):
    model = tiny_gemma4(vlm=True)
    model.config.text_config.layer_types = ["linear_attention", "full_attention"]
    assert is_hybrid_model(model)
    assert not ModelSupports(model).supports_cp


def test_mistral3_vlm(tiny_mistral3):
    model = tiny_mistral3()
    supports = ModelSupports(model)
    _assert_matches_hf_attributes(supports, model)
    assert not is_hybrid_model(model)
    assert supports.supports_tp
    assert supports.supports_pp
    assert supports.supports_cp
    assert supports.supports_sequence_packing
    assert supports.supports_generate


def test_hf_model_without_sdpa_cannot_use_cp(tiny_llama):
    model = tiny_llama()
    model._supports_sdpa = False  # an instance attribute shadows the class flag
    supports = ModelSupports(model)
    assert not supports.supports_cp
    assert not supports.supports_sequence_packing


# ================================================================================================================
# is_hybrid_model
# ================================================================================================================


class _WithConfig(nn.Module):
    def __init__(self, config: Any = None, **children: nn.Module) -> None:
        super().__init__()
        self.config = config
        for name, child in children.items():
            self.add_module(name, child)


def _cfg(**fields: Any) -> SimpleNamespace:
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (_cfg(hybrid_override_pattern="M*M-"), True),
        (_cfg(hybrid_override_pattern="m*-"), True),
        (_cfg(hybrid_override_pattern="*-E"), False),
        (_cfg(hybrid_override_pattern=""), False),
        (_cfg(hybrid_override_pattern=None), False),
        (_cfg(layers_block_type=["mamba", "attention", "mlp"]), True),
        (_cfg(layers_block_type=["MAMBA", "moe"]), True),
        (_cfg(layers_block_type=["linear_attention", "full_attention"]), True),
        (_cfg(layers_block_type=["M", "*"]), True),
        (_cfg(layers_block_type=["attention", "mlp", "moe"]), False),
        (_cfg(layers_block_type="mamba"), True),
        (_cfg(layers_block_type="moe"), False),
        (_cfg(layer_types=["linear_attention", "full_attention"]), True),
        (_cfg(layer_types=["sliding_attention", "full_attention"]), False),
        (_cfg(is_hybrid_model=True), True),
        (_cfg(is_hybrid_model="yes"), False),
        (_cfg(text_config=_cfg(layers_block_type=["mamba"])), True),
        (_cfg(text_config=_cfg(layer_types=["full_attention"])), False),
        ({"layers_block_type": ["mamba", "attention"]}, True),
        (_cfg(text_config={"hybrid_override_pattern": "M-"}), True),
        (_cfg(), False),
        (None, False),
    ],
)
def test_is_hybrid_model_on_outer_config(config, expected):
    assert is_hybrid_model(_WithConfig(config)) is expected


def test_is_hybrid_model_finds_inner_language_model_configs():
    inner = _WithConfig(_cfg(layers_block_type=["mamba", "attention"]))
    assert is_hybrid_model(_WithConfig(_cfg(), language_model=inner))
    wrapper = _WithConfig(_cfg(), language_model=_WithConfig(_cfg(layer_types=["full_attention"])))
    assert not is_hybrid_model(_WithConfig(_cfg(), model=wrapper))
    nested = _WithConfig(_cfg(), model=_WithConfig(_cfg(), language_model=inner))
    assert is_hybrid_model(nested)


def test_module_without_config_is_not_hybrid():
    assert not is_hybrid_model(nn.Linear(2, 2))


# ================================================================================================================
# Custom modules: the duck-typed protocol
# ================================================================================================================


class Custom(nn.Module):
    """A custom model with a ``backend`` and a forward that takes ``seq_lens``."""

    def __init__(self, attn: str | None = "te", config: Any = None) -> None:
        super().__init__()
        self.backend = SimpleNamespace(attn=attn)
        self.config = config
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(x)


class NoSeqLensCustom(Custom):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.proj(x)


class MoECustom(Custom):
    def am_contract(self) -> ModelContract:
        return ModelContract(ep=ExpertParallelContract(is_moe=True))


class ExpertParallelMoE(MoECustom):
    """An MoE model that implements expert parallelism (the hook our MoE model classes declare)."""

    def am_contract(self) -> ModelContract:
        return ModelContract(ep=ExpertParallelContract(is_moe=True, apply=self.apply_expert_parallel))

    def apply_expert_parallel(self, ep_mesh: Any) -> list[nn.Module]:
        return []


HYBRID = _cfg(layers_block_type=["mamba", "attention"])


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: Custom("te"), True),
        (lambda: Custom("flex"), False),
        (lambda: Custom("magi"), True),
        (lambda: Custom("sdpa"), False),
        (lambda: Custom("te", config=HYBRID), True),
        (lambda: Custom("sdpa", config=HYBRID), True),
        (lambda: Custom("flex", config=HYBRID), False),
        (lambda: Custom("magi", config=HYBRID), False),
        (lambda: MoECustom("flex"), False),
        (lambda: MoECustom("te"), True),
    ],
    ids=["te", "flex", "magi", "sdpa", "hybrid-te", "hybrid-sdpa", "hybrid-flex", "hybrid-magi", "moe-flex", "moe-te"],
)
def test_custom_cp_support_table(build, expected):
    assert ModelSupports(build()).supports_cp is expected


def test_cp_sdpa_flag_admits_sdpa():
    model = Custom("sdpa")
    model._supports_cp_sdpa = True
    assert ModelSupports(model).supports_cp
    model.backend.attn = "flex"
    assert not ModelSupports(model).supports_cp


def test_injected_te_attention_counts_as_te():
    model = Custom("flex")
    model._te_attention_injected = True
    assert ModelSupports(model).supports_cp


def test_model_declared_cp_backends_replace_the_defaults():
    model = Custom("tilelang")
    model.am_contract = lambda: ModelContract(cp=ContextParallelContract(attention_backends=("tilelang", "cudnn")))
    assert ModelSupports(model).supports_cp
    model.backend.attn = "cudnn"
    assert ModelSupports(model).supports_cp
    model.backend.attn = "te"
    assert not ModelSupports(model).supports_cp


def test_owned_cp_attention_wins_over_backend():
    model = Custom("flex", config=HYBRID)
    model._owns_cp_attention = True
    assert ModelSupports(model).supports_cp


def test_flags_follow_live_changes():
    model = Custom("flex")
    supports = ModelSupports(model)
    assert not supports.supports_cp
    model.backend.attn = "te"
    assert supports.supports_cp


def test_plans_decide_tp_and_pp_on_undeclared_models():
    model = Custom()
    supports = ModelSupports(model)
    assert not supports.supports_tp
    assert not supports.supports_pp
    model._tp_plan = {"proj": "colwise"}
    model._pp_plan = {}
    assert supports.supports_tp
    assert not supports.supports_pp
    model._pp_plan = {"proj": (["x"], ["x"])}
    assert supports.supports_pp
    assert supports.supports_tp_plan is supports.supports_tp
    assert supports.supports_pp_plan is supports.supports_pp


def test_moe_marker_gives_pp_and_the_hook_gives_ep():
    marked, hooked, plain = MoECustom(), ExpertParallelMoE(), Custom()
    assert ModelSupports(marked).supports_pp
    assert not ModelSupports(marked).supports_ep  # an MoE model, but nothing would shard its experts
    assert ModelSupports(hooked).supports_ep
    assert not ModelSupports(plain).supports_ep
    assert implements_expert_parallelism(hooked)
    assert not implements_expert_parallelism(marked)


# ---- declarations combined with introspection -------------------------------------------------------------------


class DeclaredNoPP(ExpertParallelMoE):
    """Like upstream's Gemma4 MoE: an MoE model whose declaration says PP is unsupported."""

    class ModelCapabilities:
        supports_tp = True
        supports_cp = True
        supports_ep = True
        supports_thd = True
        supports_mtp_cp = True
        supports_cp_vision_frame_sharding = True


class DeclaredNoCP(Custom):
    class ModelCapabilities:
        supports_pp = True


def test_declaration_vetoes_introspected_support():
    model = DeclaredNoPP("te")
    supports = ModelSupports(model)
    assert not supports.supports_pp  # the MoE marker alone would have allowed PP
    assert supports.supports_tp  # declared, though the model has no _tp_plan
    assert supports.supports_ep
    assert supports.supports_cp


def test_declared_cp_still_needs_a_capable_backend():
    te, flex, undeclared_cp = DeclaredNoPP("te"), DeclaredNoPP("flex"), DeclaredNoCP("te")
    assert ModelSupports(te).supports_cp
    assert not ModelSupports(flex).supports_cp
    assert not ModelSupports(undeclared_cp).supports_cp


def test_declared_only_flags_come_from_the_declaration():
    model = DeclaredNoPP()
    supports = ModelSupports(model)
    assert supports.supports_thd
    assert supports.supports_mtp_cp
    assert supports.supports_cp_vision_frame_sharding
    assert not supports.supports_mtp_cp_pp
    assert supports.declared_capabilities == ModelCapabilities(
        supports_tp=True,
        supports_cp=True,
        supports_ep=True,
        supports_thd=True,
        supports_mtp_cp=True,
        supports_cp_vision_frame_sharding=True,
    )


# ---- sequence packing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: Custom("te"), True),
        (lambda: Custom("magi"), True),
        (lambda: Custom("flex"), False),
        (lambda: NoSeqLensCustom("te"), False),
        (lambda: Custom("te", config=HYBRID), True),  # a custom hybrid with a backend handles packing itself
    ],
    ids=["te", "magi", "flex", "no-seq-lens", "hybrid-te"],
)
def test_sequence_packing_needs_seq_lens_and_packing_attention(build, expected):
    model = build()
    assert ModelSupports(model).supports_sequence_packing is expected


def test_sequence_packing_via_kwargs_and_model_declared_backends():
    class KwargsCustom(Custom):
        def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
            return self.proj(x)

    model = KwargsCustom("flex")
    assert not ModelSupports(model).supports_sequence_packing
    model._packed_cp_attn_backends = ("flex",)
    assert ModelSupports(model).supports_sequence_packing
    model._packed_cp_attn_backends = None
    model._owns_packed_attention = True
    assert ModelSupports(model).supports_sequence_packing


def _cp_packing(model: nn.Module, cp_size: int) -> bool:
    return ModelSupports(model, MeshContext(cp_size=cp_size)).supports_cp_with_sequence_packing


def test_cp_with_sequence_packing_matrix():
    assert _cp_packing(Custom("te"), 2)
    assert _cp_packing(Custom("magi"), 2)
    assert not _cp_packing(Custom("flex"), 1)  # no packing at all
    no_cp_path = Custom("sdpa")
    no_cp_path._supports_sdpa = True  # packs through SDPA, but has no packed CP path
    assert _cp_packing(no_cp_path, 1)
    assert not _cp_packing(no_cp_path, 2)
    owned = Custom("sdpa")
    owned._supports_sdpa = True
    owned._owns_cp_attention = True
    assert _cp_packing(owned, 4)
    declared = Custom("flex")
    declared._packed_cp_attn_backends = ("flex",)
    assert _cp_packing(declared, 2)
    declared.backend.attn = "te"
    assert not _cp_packing(declared, 2)  # a declared tuple is exhaustive


# ---- gradient checkpointing, generate, MTP -------------------------------------------------------------------------


class GCTrue(nn.Module):
    supports_gradient_checkpointing = True


class GCFalseSub(GCTrue):
    supports_gradient_checkpointing = False


class GCPropertySub(GCTrue):
    @property
    def supports_gradient_checkpointing(self) -> bool:  # type: ignore[override]
        return False


class GCClassmethodSub(GCFalseSub):
    @classmethod
    def supports_gradient_checkpointing(cls) -> bool:  # type: ignore[override]
        return True


class GCTruthyNonBool(nn.Module):
    supports_gradient_checkpointing = 1


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (GCTrue, True),
        (GCFalseSub, False),
        (GCPropertySub, True),
        (GCClassmethodSub, False),
        (GCTruthyNonBool, False),
        (nn.Linear, False),
    ],
)
def test_gradient_checkpointing_mro_plain_value_rule(cls, expected):
    model = cls(2, 2) if cls is nn.Linear else cls()
    assert ModelSupports(model).supports_gradient_checkpointing is expected


class MoEGC(ExpertParallelMoE):
    supports_gradient_checkpointing = True


def test_gradient_checkpointing_follows_the_declaration_under_expert_parallelism():
    """The core rule: the class's declaration decides on every mesh (a class that declares True states that its
    recomputed layers are exact; am-moe's are, see the trainer's dp 2 x ep 2 parity runs with checkpointing).
    Upstream's veto at ep_size > 1 is `am_capabilities.upstream.ModelSupports`."""
    from am_capabilities import upstream

    model = MoEGC()
    for ep in (1, 2):
        assert ModelSupports(model, MeshContext(ep_size=ep)).supports_gradient_checkpointing
    assert upstream.ModelSupports(model, MeshContext(ep_size=1)).supports_gradient_checkpointing
    assert not upstream.ModelSupports(model, MeshContext(ep_size=2)).supports_gradient_checkpointing
    declined = GCFalseSub()
    assert not ModelSupports(declined, MeshContext(ep_size=2)).supports_gradient_checkpointing
    plain = Custom()
    plain.__class__ = type("PlainGC", (Custom,), {"supports_gradient_checkpointing": True})
    assert upstream.ModelSupports(plain, MeshContext(ep_size=2)).supports_gradient_checkpointing  # no EP: no veto
    # the upstream flavour survives copying and pickling with its rule
    strong = upstream.ModelSupports(model, MeshContext(ep_size=2))
    for copied in (copy.copy(strong), copy.deepcopy(strong), pickle.loads(pickle.dumps(strong))):
        assert type(copied) is upstream.ModelSupports
        assert not copied.supports_gradient_checkpointing


def test_mtp_enabled_is_live():
    model = Custom()
    supports = ModelSupports(model)
    assert not supports.mtp_enabled
    model.mtp_config = SimpleNamespace(enabled=True)
    assert supports.mtp_enabled
    model.mtp_config.enabled = False
    assert not supports.mtp_enabled


def test_generate_needs_a_callable():
    model = Custom()
    assert not ModelSupports(model).supports_generate
    model.generate = lambda: None
    assert ModelSupports(model).supports_generate
    model.generate = "not callable"
    assert not ModelSupports(model).supports_generate


# ================================================================================================================
# ModelSupports object behaviour
# ================================================================================================================


def test_mesh_sizes_are_read_from_any_mesh_form():
    model = Custom()
    assert ModelSupports(model).cp_size == 1
    supports = ModelSupports(model, SimpleNamespace(cp_size=2, ep_size=4))
    assert (supports.tp_size, supports.pp_size, supports.cp_size, supports.ep_size) == (1, 1, 2, 4)
    assert supports.mesh == MeshContext(cp_size=2, ep_size=4)
    with pytest.raises(ValueError, match="cp_size=0"):
        ModelSupports(model, SimpleNamespace(cp_size=0))


def test_model_supports_keeps_its_model_alive():
    """Changed from a weak reference: ``ModelSupports(make())`` works when the caller keeps no other reference."""
    model = Custom("te")
    supports = ModelSupports(model)
    assert supports.model is model
    assert supports.describes(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is not None
    assert supports.supports_cp

    temporary = ModelSupports(Custom("te"))
    gc.collect()
    assert temporary.supports_cp
    assert "cp=True" in repr(temporary)
    assert not ModelSupports(Custom("flex")).supports_cp


def test_repr_lists_every_flag():
    model = Custom("te")
    text = repr(ModelSupports(model, MeshContext(cp_size=2)))
    assert text.startswith("ModelSupports(Custom: ")
    for flag in (
        "tp=False",
        "pp=False",
        "cp=True",
        "ep=False",
        "sequence_packing=True",
        "gradient_checkpointing=",
        "generate=False",
        "mtp_enabled=False",
        "is_custom_model=False",
        "cp_size=2",
    ):
        assert flag in text, flag


def test_copies_describe_the_same_model_and_pickle_carries_model_and_mesh():
    model = Custom()
    supports = ModelSupports(model, MeshContext(tp_size=2))
    for clone in (copy.copy(supports), copy.deepcopy(supports)):
        assert clone.describes(model)
        assert clone.mesh == supports.mesh
    restored = pickle.loads(pickle.dumps(supports))
    assert type(restored.model) is Custom
    assert restored.mesh == supports.mesh
    assert restored.supports_cp == supports.supports_cp
