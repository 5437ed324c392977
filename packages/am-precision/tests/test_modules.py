"""Float32RMSNorm and the norm / linear factories: math, dtypes, meta-device creation and materialization."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from am_precision import Float32RMSNorm, flags, initialize_linear_module, initialize_rms_norm_module

HAVE_QUACK = importlib.util.find_spec("quack") is not None


def _reference_rms_norm_fp64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_rmsnorm_matches_fp64_reference_and_returns_input_dtype(dtype):
    torch.manual_seed(0)
    norm = Float32RMSNorm(16, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(2, 5, 16).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    expected = _reference_rms_norm_fp64(x, norm.weight, 1e-6).to(dtype)
    # fp32 math then one rounding to the output dtype: at most one output ulp from the fp64 reference rounded.
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_float32_rmsnorm_beats_bf16_math():
    """Computing in fp32 is closer to the exact result than nn.RMSNorm computing in bf16."""
    torch.manual_seed(0)
    x = (torch.randn(64, 256) * 3).bfloat16()
    exact = _reference_rms_norm_fp64(x, torch.ones(256), 1e-5)
    ours = Float32RMSNorm(256, dtype=torch.bfloat16)(x)
    bf16 = nn.RMSNorm(256, eps=1e-5, dtype=torch.bfloat16)(x)
    assert (ours.double() - exact).abs().mean() <= (bf16.double() - exact).abs().mean()


def test_float32_rmsnorm_on_meta_then_materialized():
    norm = Float32RMSNorm(8, device="meta", dtype=torch.bfloat16)
    assert norm.weight.is_meta
    norm.to_empty(device="cpu")
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(8, dtype=torch.bfloat16))
    assert norm.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(("impl", "cls"), [("torch", nn.RMSNorm), ("torch_fp32", Float32RMSNorm)])
def test_rms_norm_factory(impl, cls):
    norm = initialize_rms_norm_module(impl, 12, eps=1e-6, device="meta", dtype=torch.bfloat16)
    assert isinstance(norm, cls)
    assert norm.weight.is_meta
    assert norm.weight.dtype == torch.bfloat16
    norm.to_empty(device="cpu")
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(12, dtype=torch.bfloat16))
    assert norm.eps == 1e-6


@pytest.mark.parametrize("bias", [False, True])
def test_linear_factory_torch_on_meta_then_materialized(bias):
    linear = initialize_linear_module("torch", 6, 4, bias=bias, device="meta", dtype=torch.bfloat16)
    assert isinstance(linear, nn.Linear)
    assert linear.weight.is_meta
    assert (linear.bias is not None) == bias
    linear.to_empty(device="cpu")
    linear.reset_parameters()
    assert linear.weight.dtype == torch.bfloat16
    assert linear.weight.abs().sum() > 0  # Kaiming init, not the garbage of to_empty
    x = torch.randn(3, 6, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x), nn.functional.linear(x, linear.weight, linear.bias))


def test_unknown_implementations_list_the_allowed_ones():
    with pytest.raises(ValueError, match="Unsupported RMSNorm implementation: 'apex'") as err:
        initialize_rms_norm_module("apex", 4)
    for option in ("'torch'", "'torch_fp32'", "'te'", "'quack'"):
        assert option in str(err.value)
    with pytest.raises(ValueError, match="Unsupported Linear implementation: 'fp8'") as err:
        initialize_linear_module("fp8", 4, 4)
    for option in ("'torch'", "'te'", "'quack'"):
        assert option in str(err.value)


@pytest.mark.skipif(HAVE_QUACK, reason="quack-kernels is installed; this checks the missing-package error")
def test_quack_without_the_package_says_how_to_install():
    with pytest.raises(ImportError, match="rms_norm='quack' requires the 'quack-kernels' package"):
        initialize_rms_norm_module("quack", 4)
    with pytest.raises(ImportError, match="linear='quack' requires the 'quack-kernels' package"):
        initialize_linear_module("quack", 4, 4)


@pytest.mark.skipif(flags.te_usable(), reason="Transformer Engine with CUDA is available; this checks its absence")
def test_te_without_transformer_engine_says_how_to_install():
    with pytest.raises(ImportError, match=r"am-precision\[te\]"):
        initialize_linear_module("te", 4, 4)
    with pytest.raises(ImportError, match=r"am-precision\[te\]"):
        initialize_rms_norm_module("te", 4)


@pytest.mark.skipif(not flags.te_usable(), reason="Transformer Engine with CUDA is not available on this machine")
def test_te_factories_build_patched_te_modules():
    import transformer_engine.pytorch as te

    linear = initialize_linear_module("te", 16, 32, device="cuda", dtype=torch.bfloat16)
    norm = initialize_rms_norm_module("te", 16, device="cuda", dtype=torch.bfloat16)
    assert isinstance(linear, te.Linear)
    assert isinstance(norm, te.RMSNorm)
    empty = torch.empty(0, 16, device="cuda", dtype=torch.bfloat16)
    assert linear(empty).shape == (0, 32)
    assert norm(empty).shape == (0, 16)
