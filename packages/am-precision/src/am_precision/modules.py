"""RMSNorm and linear layer factories, and `Float32RMSNorm`.

What it is for: build the norm / linear module that a `BackendConfig` names ("torch", "torch_fp32", "te",
"quack"), on any device including "meta"; materialize later with `to_empty()` + `reset_parameters()`.
What it must not do: import transformer_engine or quack at import time; they are imported only when that
implementation is requested, with an ImportError that says how to install them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backend import LINEAR_BACKENDS, RMS_NORM_BACKENDS
from .te_modules import TEModuleClasses, te_module_classes

__all__ = ["Float32RMSNorm", "initialize_linear_module", "initialize_rms_norm_module"]


class Float32RMSNorm(nn.Module):
    """RMSNorm that always computes in fp32, whatever the storage dtype of its input and weight.

    x: [..., dim] any float dtype -> [..., dim] in x's dtype.
    y = (x32 * rsqrt(mean(x32², -1) + eps)) * weight, computed in fp32 and cast back to x's dtype.

    Args:
        dim: size of the normalized (last) dimension.
        eps: added to the mean square before the reciprocal square root.
        device: where to create the weight ("meta" to defer allocation).
        dtype: storage dtype of the weight (bf16 by default; the math still runs in fp32).
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fill the weight with ones (no-op on the meta device)."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight_dtype={self.weight.dtype}"


class _QuackRMSNorm(Float32RMSNorm):
    """RMSNorm backed by QuACK's CuTe kernel (CUDA only). x: [..., dim] -> [..., dim]."""

    def __init__(self, dim: int, eps: float, *, device: torch.device | str | None, dtype: torch.dtype) -> None:
        rmsnorm = _import_quack("rms_norm", "quack.rmsnorm").rmsnorm  # before any parameter: a missing package raises
        super().__init__(dim, eps, device=device, dtype=dtype)
        self._rmsnorm = rmsnorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rmsnorm(x, self.weight, eps=self.eps)


def _import_quack(option: str, module_name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"{option}='quack' requires the 'quack-kernels' package (CUDA only): `pip install quack-kernels`, "
            f"or choose another {option} implementation. Import of {module_name!r} failed: {err}"
        ) from err


def _te_classes(option: str) -> TEModuleClasses:
    try:
        return te_module_classes()
    except ImportError as err:
        raise ImportError(
            f"{option}='te' requires Transformer Engine with CUDA: `pip install am-precision[te]` on a machine "
            f"with a GPU, or choose another {option} implementation. Import failed: {err}"
        ) from err


def initialize_rms_norm_module(
    rms_norm_impl: str,
    dim: int,
    eps: float = 1e-5,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """Build an RMSNorm over the last dimension with the implementation `rms_norm_impl`.

    Upstream calling convention: `initialize_rms_norm_module(rms_norm_impl, dim, eps, device, dtype)`.

    Args:
        rms_norm_impl: "torch" (`nn.RMSNorm`, computes in the input dtype), "torch_fp32" (`Float32RMSNorm`), "te"
            (Transformer Engine's, with `te_module_classes`' behaviours) or "quack" (QuACK kernel).
        dim: normalized size.
        eps: numerical epsilon.
        device: device for the weight; "meta" defers allocation (then `to_empty()` + `reset_parameters()`).
        dtype: storage dtype of the weight.

    Raises:
        ValueError: `rms_norm_impl` is not one of `RMS_NORM_BACKENDS`.
        ImportError: the optional package behind "te" / "quack" is missing.
    """
    impl = rms_norm_impl
    if impl == "torch":
        return nn.RMSNorm(dim, eps=eps, device=device, dtype=dtype)
    if impl == "torch_fp32":
        return Float32RMSNorm(dim, eps, device=device, dtype=dtype)
    if impl == "te":
        return _te_classes("rms_norm").rms_norm(normalized_shape=dim, eps=eps, device=device, params_dtype=dtype)
    if impl == "quack":
        return _QuackRMSNorm(dim, eps, device=device, dtype=dtype)
    allowed = ", ".join(repr(a) for a in RMS_NORM_BACKENDS)
    raise ValueError(f"Unsupported RMSNorm implementation: {impl!r}; choose one of {allowed}")


def initialize_linear_module(
    linear_impl: str,
    in_features: int,
    out_features: int,
    bias: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """Build a linear layer `y = x Wᵀ (+ b)` with the implementation `linear_impl`.

    x: [..., in_features] -> [..., out_features]. Upstream calling convention:
    `initialize_linear_module(linear_impl, in_features, out_features, bias, device, dtype)`.

    Args:
        linear_impl: "torch" (`nn.Linear`), "te" (Transformer Engine `Linear` with `te_module_classes`' behaviours) or
            "quack" (`quack.linear.Linear`).
        in_features: input size.
        out_features: output size.
        bias: add a learnable bias.
        device: device for the parameters; "meta" defers allocation.
        dtype: storage dtype of the parameters.

    Raises:
        ValueError: `linear_impl` is not one of `LINEAR_BACKENDS`.
        ImportError: the optional package behind "te" / "quack" is missing.
    """
    impl = linear_impl
    if impl == "torch":
        return nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    if impl == "te":
        return _te_classes("linear").linear(in_features, out_features, bias=bias, device=device, params_dtype=dtype)
    if impl == "quack":
        quack_linear = _import_quack("linear", "quack.linear")
        return quack_linear.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    allowed = ", ".join(repr(a) for a in LINEAR_BACKENDS)
    raise ValueError(f"Unsupported Linear implementation: {impl!r}; choose one of {allowed}")
