"""BackendConfig / TEFp8Config: machine-dependent defaults, run-time validation, immutability, FP8 recipes."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from am_precision import (
    ATTN_BACKENDS,
    DISPATCHER_BACKENDS,
    EXPERTS_BACKENDS,
    LINEAR_BACKENDS,
    BackendConfig,
    CudaGraphConfig,
    MoKBackendConfig,
    TEFp8Config,
    backend,
    flags,
)


@pytest.fixture
def no_te_no_cuda(monkeypatch):
    monkeypatch.setattr(flags, "HAVE_TE", False)
    monkeypatch.setattr(flags, "HAVE_DEEP_EP", False)
    monkeypatch.setattr(flags, "HAVE_UCCL_EP", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def te_and_cuda(monkeypatch):
    """Pretend TE is installed and CUDA is available; constructing a config never imports TE."""
    monkeypatch.setattr(flags, "HAVE_TE", True)
    monkeypatch.setattr(flags, "HAVE_DEEP_EP", False)
    monkeypatch.setattr(flags, "HAVE_UCCL_EP", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.usefixtures("no_te_no_cuda")
def test_defaults_without_te_or_cuda():
    cfg = BackendConfig()
    assert (cfg.attn, cfg.linear, cfg.rms_norm, cfg.rope) == ("sdpa", "torch", "torch_fp32", "torch")
    assert cfg.rope_fusion is False
    assert (cfg.experts, cfg.dispatcher) == ("torch", "torch")
    assert cfg.dispatcher_num_sms == 20
    assert cfg.dispatcher_share_token_dispatcher is True
    assert cfg.dispatcher_async_dispatch is False
    assert cfg.fake_balanced_gate is False
    assert cfg.fake_gate_noise == 0.0
    assert cfg.enable_hf_state_dict_adapter is True
    assert cfg.enable_fsdp_optimizations is False
    assert cfg.te_fp8 is None
    assert cfg.gate_precision is None
    assert cfg.compile_attn is False


@pytest.mark.usefixtures("te_and_cuda")
def test_defaults_with_te_and_cuda():
    cfg = BackendConfig()
    assert (cfg.attn, cfg.linear, cfg.rms_norm) == ("te", "te", "torch_fp32")
    assert cfg.rope_fusion is False  # nothing fuses RoPE (upstream forces it off as well)
    assert (cfg.experts, cfg.dispatcher) == ("torch_mm", "torch")


def test_dispatcher_default_prefers_deepep_then_uccl_on_cuda(te_and_cuda, monkeypatch):
    monkeypatch.setattr(flags, "HAVE_UCCL_EP", True)
    assert BackendConfig().dispatcher == "uccl_ep"
    monkeypatch.setattr(flags, "HAVE_DEEP_EP", True)
    assert BackendConfig().dispatcher == "deepep"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert BackendConfig().dispatcher == "torch"


@pytest.mark.usefixtures("te_and_cuda")
def test_rope_fusion_auto_resolves_off_and_explicit_true_is_kept_not_disabled():
    """Upstream forces rope_fusion off; here True is kept (am_precision.fused_rope; the models refuse it where TE or
    CUDA is missing, or where there is no RoPE)."""
    assert BackendConfig(rope="torch").rope_fusion is False
    assert BackendConfig(rope_fusion=False).rope_fusion is False
    assert BackendConfig(rope_fusion=True).rope_fusion is True
    assert BackendConfig(enable_fsdp_optimizations=True).enable_fsdp_optimizations is True


# A value of every field no am-* package implements, the same one the README table lists.
_UNIMPLEMENTED_VALUES = {
    "cuda_graph": CudaGraphConfig(modules=["attn"]),
    "mok": MoKBackendConfig(minibatch_size=8192),
    "enable_deepep": True,
}


def test_every_unimplemented_field_is_listed():
    """The table in backend.py is what the tests check: no field is silently missing from either."""
    assert set(backend._NOT_IMPLEMENTED) == set(_UNIMPLEMENTED_VALUES)
    assert set(_UNIMPLEMENTED_VALUES) <= {f.name for f in dataclasses.fields(BackendConfig)}


@pytest.mark.usefixtures("no_te_no_cuda")
@pytest.mark.parametrize(("name", "value"), list(_UNIMPLEMENTED_VALUES.items()))
def test_a_value_nothing_honours_is_refused_with_the_fix(name, value):
    extra = {"linear": "te"} if name == "te_fp8" else {}  # otherwise te_fp8 is also an invalid combination
    with pytest.raises(ValueError, match=r"\(1 problem\)") as err:
        BackendConfig(**{name: value}, **extra)
    message = str(err.value)
    assert f"{name}={value!r} is not implemented by any am-* package: " in message
    assert "leave" in message or "use rope='torch'" in message  # every refusal says what to do instead
    # The upstream default of the same field is accepted.
    default_field = {f.name: f for f in dataclasses.fields(BackendConfig)}[name]
    default = default_field.default
    if default is dataclasses.MISSING:  # nested option groups (cuda_graph, mok) default to a fresh instance
        default = default_field.default_factory()
    BackendConfig(**{name: default}, **extra)


def test_dispatcher_knobs_are_accepted_for_the_library_dispatchers_only():
    """am_moe.apply_expert_parallel honours dispatcher_num_sms / _async_dispatch / _share_token_dispatcher for
    deepep, hybridep and uccl_ep; the torch dispatcher has no kernels to tune, so other values are refused there."""
    for dispatcher in ("deepep", "hybridep", "uccl_ep"):
        cfg = BackendConfig(dispatcher=dispatcher, dispatcher_num_sms=32, dispatcher_async_dispatch=True)
        assert (cfg.dispatcher_num_sms, cfg.dispatcher_async_dispatch) == (32, True)
    assert (
        BackendConfig(dispatcher="torch", dispatcher_share_token_dispatcher=False).dispatcher_share_token_dispatcher
        is False
    )
    with pytest.raises(ValueError, match=r"\(1 problem\)") as err:
        BackendConfig(dispatcher="torch", dispatcher_num_sms=32, dispatcher_async_dispatch=True)
    assert "dispatcher_num_sms=32, dispatcher_async_dispatch=True tune(s) the communication kernels" in str(err.value)
    assert "but dispatcher='torch'" in str(err.value)


@pytest.mark.usefixtures("no_te_no_cuda")
def test_all_unimplemented_values_are_refused_at_once():
    with pytest.raises(ValueError, match=f"\\({len(_UNIMPLEMENTED_VALUES)} problems\\)"):
        BackendConfig(linear="te", **_UNIMPLEMENTED_VALUES)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("attn", "flash", ATTN_BACKENDS),
        ("linear", "fp8", LINEAR_BACKENDS),
        ("experts", "einsum", EXPERTS_BACKENDS),
        ("dispatcher", "nccl", DISPATCHER_BACKENDS),
    ],
)
def test_unknown_literal_names_field_value_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError, match="Invalid BackendConfig") as err:
        BackendConfig(**{field: value})
    message = str(err.value)
    assert f"{field}={value!r}" in message
    for option in allowed:
        assert repr(option) in message


def test_all_invalid_fields_are_listed_in_one_error():
    with pytest.raises(ValueError, match="Invalid BackendConfig") as err:
        BackendConfig(
            attn="flash",
            rms_norm="layernorm",
            rope="fused",
            dispatcher_num_sms=0,
            compile_attn="yes",
            fake_gate_noise=-1.0,
            gate_precision="float33",
        )
    message = str(err.value)
    assert "7 problems" in message
    for fragment in (
        "attn='flash'",
        "rms_norm='layernorm'",
        "rope='fused'",
        "dispatcher_num_sms=0",
        "compile_attn='yes'",
        "fake_gate_noise=-1.0",
        "gate_precision='float33'",
    ):
        assert fragment in message


@pytest.mark.parametrize(
    ("name", "dtype"), [("float32", torch.float32), ("torch.float32", torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_gate_precision_string_becomes_dtype(name, dtype):
    assert BackendConfig(gate_precision=name).gate_precision is dtype
    assert BackendConfig(gate_precision=dtype).gate_precision is dtype


def test_gate_precision_rejects_integer_dtype():
    with pytest.raises(ValueError, match=r"gate_precision=torch\.int64"):
        BackendConfig(gate_precision=torch.int64)


@pytest.mark.usefixtures("no_te_no_cuda")
def test_te_fp8_becomes_a_tefp8config_and_needs_a_te_backend():
    """Upstream's rules (issue 26: te_fp8 is honoured, am-models-nemotron enters its autocast): a dict becomes a
    TEFp8Config, and FP8 without a TE linear or TE experts is one problem naming both fields."""
    assert BackendConfig(linear="te", te_fp8={"recipe": "block"}).te_fp8 == TEFp8Config(recipe="block")
    assert BackendConfig(experts="te", dispatcher="deepep", te_fp8={}).te_fp8 == TEFp8Config()
    with pytest.raises(ValueError, match=r"\(1 problem\)") as err:
        BackendConfig(te_fp8=TEFp8Config())
    assert "te_fp8 requires at least one TE backend" in str(err.value)
    assert "linear='torch'" in str(err.value)
    assert "experts='torch'" in str(err.value)


def test_te_fp8_bad_dict_lists_the_fields():
    with pytest.raises(ValueError, match="not a valid TEFp8Config") as err:
        BackendConfig(linear="te", te_fp8={"recipie": "block"})
    assert "fields: recipe" in str(err.value)


def test_field_and_combination_problems_are_reported_together():
    with pytest.raises(ValueError, match="2 problems") as err:
        BackendConfig(attn="flash", experts="gmm", dispatcher="torch")
    assert "attn='flash'" in str(err.value)
    assert "experts='gmm'" in str(err.value)


def test_grouped_gemm_experts_with_torch_dispatcher_raise_instead_of_rewriting():
    with pytest.raises(ValueError, match="experts='gmm'") as err:
        BackendConfig(experts="gmm", dispatcher="torch")
    assert "'deepep'" in str(err.value)
    assert BackendConfig(experts="gmm", dispatcher="deepep").experts == "gmm"


def test_quack_rope_with_explicit_rope_fusion_raises():
    with pytest.raises(ValueError, match="rope_fusion=True"):
        BackendConfig(rope="quack", rope_fusion=True)


def test_config_is_immutable_and_replace_returns_a_validated_copy():
    base = BackendConfig(attn="sdpa", linear="torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.gate_precision = torch.float32  # type: ignore[misc]
    variant = base.replace(gate_precision="float32")
    assert variant.gate_precision is torch.float32
    assert base.gate_precision is None
    with pytest.raises(ValueError, match="attn='nope'"):
        base.replace(attn="nope")


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        BackendConfig("sdpa")  # type: ignore[misc]


def test_tefp8config_defaults_and_validation():
    assert TEFp8Config().recipe == "current"
    with pytest.raises(ValueError, match="recipe='fp4'") as err:
        TEFp8Config(recipe="fp4")
    for option in ("'current'", "'block'", "'mxfp8'"):
        assert option in str(err.value)


@pytest.mark.usefixtures("no_te_no_cuda")
def test_tefp8config_without_te_builds_none_and_a_null_context():
    assert TEFp8Config(recipe="mxfp8").build_recipe() is None
    ctx = TEFp8Config().maybe_te_autocast()
    assert isinstance(ctx, contextlib.nullcontext)
    with ctx:
        pass


def test_tefp8config_passes_a_prebuilt_recipe_object_through(monkeypatch):
    """A non-string recipe is returned unchanged (TE reported as installed; nothing is imported for it)."""
    monkeypatch.setattr(flags, "HAVE_TE", True)
    recipe = object()
    assert TEFp8Config(recipe=recipe).build_recipe() is recipe


@pytest.mark.skipif(not flags.te_usable(), reason="Transformer Engine with CUDA is not available on this machine")
@pytest.mark.parametrize(("recipe", "cls_name"), [("current", "Float8CurrentScaling"), ("block", "Float8BlockScaling")])
def test_tefp8config_builds_te_recipes(recipe, cls_name):
    built = TEFp8Config(recipe=recipe).build_recipe()
    assert type(built).__name__ == cls_name


def test_fake_balanced_gate_is_accepted_and_its_noise_validated():
    """Issue 25: the MoE models honour the fake balanced gate (am_moe.balanced_routing), so it is no longer refused;
    its noise must be a finite number >= 0."""
    cfg = BackendConfig(fake_balanced_gate=True, fake_gate_noise=0.1)
    assert cfg.fake_balanced_gate is True
    assert cfg.fake_gate_noise == 0.1
    for bad in (float("nan"), float("inf"), -0.5):
        with pytest.raises(ValueError, match=r"fake_gate_noise=.* must be finite and >= 0"):
            BackendConfig(fake_gate_noise=bad)
