"""The seed API called exactly as NeMo AutoModel documents it (`models/common/utils`): positional order, parameter
names, defaults, module attributes and the key phrases of its error messages. Calls run on tiny modules."""

from __future__ import annotations

import importlib.util
import inspect
from typing import ClassVar

import pytest
import torch
from torch import nn

import am_precision
from am_precision import (
    BackendConfig,
    CudaGraphConfig,
    Float32RMSNorm,
    MoKBackendConfig,
    TEFp8Config,
    cast_frozen_modules_to_compute_dtype,
    cast_model_to_dtype,
    compute_lm_head_logits,
    flags,
    get_rope_config,
    initialize_linear_module,
    initialize_rms_norm_module,
    is_tensor_unallocated,
    yield_fp32_model,
)


class _Tiny(nn.Module):
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["norm"]

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 8, bias=False)


def test_module_flags_under_upstream_names():
    for name in ("HAVE_TE", "HAVE_DEEP_EP", "HAVE_UCCL_EP", "HAVE_GMM"):
        assert isinstance(getattr(am_precision, name), bool)
    assert flags.IS_OPTIM_STEP is False
    assert flags.IS_FIRST_MICROBATCH is None
    try:
        flags.set_is_optim_step(True)
        flags.set_is_first_microbatch(True)
        assert flags.IS_OPTIM_STEP is True
        assert flags.get_is_optim_step() is True
        assert flags.IS_FIRST_MICROBATCH is True
        assert flags.get_is_first_microbatch() is True
        flags.set_is_first_microbatch(False)
        assert flags.IS_FIRST_MICROBATCH is False
    finally:
        flags.set_is_optim_step(False)
        flags.set_is_first_microbatch(None)


def test_is_tensor_unallocated():
    assert is_tensor_unallocated(torch.empty(0))
    assert is_tensor_unallocated(torch.empty(3, device="meta"))
    assert not is_tensor_unallocated(torch.ones(3))


def test_float32_rms_norm_positional():
    norm = Float32RMSNorm(8, 1e-6, "cpu", torch.bfloat16)  # (dim, eps, device, dtype)
    assert norm.weight.dtype == torch.bfloat16
    assert norm.eps == 1e-6
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch.testing.assert_close(norm(x), expected)


def test_initialize_rms_norm_module_upstream_call():
    norm = initialize_rms_norm_module("torch_fp32", 8, 1e-5, "cpu", torch.float32)
    assert isinstance(norm, Float32RMSNorm)
    assert norm.weight.dtype == torch.float32
    norm = initialize_rms_norm_module(rms_norm_impl="torch", dim=8, eps=1e-5, device="meta", dtype=torch.bfloat16)
    assert isinstance(norm, nn.RMSNorm)
    assert norm.weight.device.type == "meta"
    with pytest.raises(ValueError, match="Unsupported RMSNorm implementation: 'apex'"):
        initialize_rms_norm_module("apex", 8)


def test_initialize_linear_module_upstream_call():
    linear = initialize_linear_module("torch", 4, 6, True, "cpu", torch.float32)  # (impl, in, out, bias, dev, dt)
    assert isinstance(linear, nn.Linear)
    assert linear.bias is not None
    assert linear.weight.shape == (6, 4)
    linear = initialize_linear_module(linear_impl="torch", in_features=4, out_features=6)
    assert linear.bias is None
    assert linear.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Unsupported Linear implementation: 'fp8'"):
        initialize_linear_module("fp8", 4, 6)


def test_cast_model_to_dtype_positional_skip_modules():
    model = _Tiny()
    cast_model_to_dtype(model, torch.bfloat16, ("lm_head",))
    assert model.proj.weight.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.float32  # strict keep rule
    assert model.lm_head.weight.dtype == torch.float32  # skipped module left as is
    assert list(inspect.signature(cast_model_to_dtype).parameters) == ["model", "dtype", "skip_modules"]


def test_yield_fp32_model_and_frozen_cast():
    model = _Tiny().to(torch.bfloat16)
    with yield_fp32_model(model) as inner:
        assert inner is model
        assert model.proj.weight.dtype == torch.float32
    assert model.proj.weight.dtype == torch.bfloat16
    model = _Tiny()
    model.proj.requires_grad_(False)
    cast_frozen_modules_to_compute_dtype(model, torch.bfloat16)
    assert model.proj.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32


def test_compute_lm_head_logits_positional():
    head = nn.Linear(4, 8, bias=False)
    h = torch.randn(2, 5, 4)
    out = compute_lm_head_logits(head, h, 0, False, False, False)
    torch.testing.assert_close(out.logits, head(h))
    assert out.hidden_states is None
    out = compute_lm_head_logits(head, h[0], 2, True, True, True)  # THD [T, H], last 2 tokens, fp32 head
    assert out.logits.shape == (1, 2, 8)
    assert out.hidden_states.shape == (1, 5, 4)
    assert compute_lm_head_logits(None, h).logits is h  # non-final pipeline stage: pass through


def test_get_rope_config_upstream_call():
    class Config:
        rope_parameters: ClassVar[dict[str, object]] = {"rope_theta": 10000.0, "rope_type": "default"}
        partial_rotary_factor = 0.5

    theta, params, partial = get_rope_config(Config())
    assert theta == 10000.0
    assert params is Config.rope_parameters
    assert partial == 0.5


def test_backend_config_upstream_fields():
    cfg = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", gate_precision="float32")
    assert cfg.gate_precision is torch.float32
    assert cfg.rope_fusion is False
    assert BackendConfig(enable_deepep=None).enable_deepep is None  # upstream configs spell the removed field
    with pytest.raises(ValueError, match="dispatcher='deepep'"):
        BackendConfig(enable_deepep=True)
    with pytest.raises(TypeError):
        BackendConfig("sdpa")  # keyword-only, as upstream's kw_only dataclass


def test_te_fp8_config_without_te():
    cfg = TEFp8Config()
    assert cfg.recipe == "current"
    if not am_precision.HAVE_TE:
        assert cfg.build_recipe() is None
        with cfg.maybe_te_autocast():
            pass


def test_cuda_graph_config_upstream_rules():
    assert CudaGraphConfig().modules == ()
    cfg = CudaGraphConfig(modules=["te_dpa", "moe_router", "moe_preprocess"])
    assert cfg.modules == ("te_dpa", "moe_router", "moe_preprocess")
    assert cfg.enabled
    with pytest.raises(TypeError, match="must be a list of strings"):
        CudaGraphConfig(modules="attn")
    with pytest.raises(TypeError):
        CudaGraphConfig(["attn"])  # keyword-only, as upstream
    with pytest.raises(ValueError, match=r"\(4 problems\)") as err:
        CudaGraphConfig(modules=["attn", "te_dpa", "moe_preprocess", "mlp", "attn"])
    message = str(err.value)
    for phrase in ("unknown name 'mlp'", "['attn'] listed more than once", "only one of them", "add 'moe_router'"):
        assert phrase in message


def test_mok_backend_config_upstream_defaults_and_rules():
    cfg = MoKBackendConfig()
    assert (cfg.fwd_num_comm_sms, cfg.bwd_num_comm_sms) == (40, 28)
    assert (cfg.minibatch_size, cfg.macrobatch_size) == (4096, 131072)
    assert cfg.schedule_capacity_multiplier == 0.5
    assert cfg.all_gather_top_experts_chunk_bytes == 2048
    with pytest.raises(ValueError, match=r"\(6 problems\)") as err:
        MoKBackendConfig(
            fwd_num_comm_sms=41,
            bwd_num_comm_sms=0,
            minibatch_size=1000,
            macrobatch_size=3001,
            schedule_capacity_multiplier=float("inf"),
            all_gather_top_experts_chunk_bytes=24,
        )
    message = str(err.value)
    for phrase in (
        "must be even",
        "bwd_num_comm_sms=0 must be a positive int",
        "multiple of 256",
        "multiple of 16",
        "multiple of minibatch_size=1000",
    ):
        assert phrase in message
    if importlib.util.find_spec("mok") is None:
        with pytest.raises(ImportError, match="Mixture-of-Kittens"):
            cfg.build()


def test_backend_config_nested_groups_as_upstream():
    cfg = BackendConfig(cuda_graph={"modules": []}, mok={"minibatch_size": 4096})  # dicts, as YAML gives them
    assert cfg.cuda_graph == CudaGraphConfig()
    assert cfg.mok == MoKBackendConfig()
    assert BackendConfig().cuda_graph == CudaGraphConfig()
    assert BackendConfig().mok == MoKBackendConfig()
    with pytest.raises(ValueError, match=r"\(2 problems\)") as err:
        BackendConfig(cuda_graph={"modules": ["attn"]}, mok={"minibatch_size": 8192}, attn="sdpa")
    message = str(err.value)
    assert "cuda_graph=CudaGraphConfig(modules=('attn',)) is not implemented by any am-* package" in message
    assert "mok=MoKBackendConfig(" in message
    assert "leave mok=MoKBackendConfig()" in message
    with pytest.raises(ValueError, match=r"\(2 problems\)") as err:
        BackendConfig(cuda_graph=["attn"], mok={"minibatch_size": 100})
    assert "cuda_graph=['attn'] must be a CudaGraphConfig" in str(err.value)
    assert "is not a valid MoKBackendConfig" in str(err.value)
