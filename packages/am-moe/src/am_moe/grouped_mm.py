"""Grouped GEMM over expert-sorted rows: `torch._grouped_mm` where it runs, per-group matmuls elsewhere, or, when
asked for, the `grouped_gemm` package's CUTLASS kernel ("gmm", upstream's `BackendConfig.experts="gmm"`) or
Transformer Engine's `GroupedLinear` ("te", upstream's `experts="te"`); both libraries are imported on first use; or
torch's MXFP8 block-scaled grouped GEMM ("mxfp8", upstream's `experts="torch_mm_mxfp8"`, `am_moe.mxfp8`: Blackwell).

What it is for: `select_grouped_mm_backend` decides ONCE per (device, dtype, matrix sizes) which kernel multiplies
the row groups — by rules on the device, dtype and strides, never by trying a call and catching its failure — and
says why (`GroupedMMChoice.reason`). `grouped_linear` then computes `out[g] = x[g] @ weight[g].T` for every group g
of consecutive rows, forward and backward, with either backend; both are numerically the per-expert matmul.
What it must not do: fall back silently. A backend asked for by name that cannot run here is refused with the reason;
an automatic choice is recorded and reported by the caller.

Weights are stacked `[G, out, in]`, the `nn.Linear` layout of every expert, so `weight[g]` is the expert's
HF-format `*.weight` tensor and `weight.transpose(-2, -1)` is the column-major right operand that the CUDA grouped
kernels read without a copy.

`torch._grouped_mm` constraints (torch 2.15, ATen `GroupedMMUtils.h`): fp32 / bf16 / fp16; every matrix's leading
stride a multiple of 16 bytes (so hidden and intermediate sizes must be multiples of 16 / element size); its backward
rejects a stride-0 (expanded) incoming gradient; rows past the last group end come back UNINITIALIZED (forward and
input gradient). On CUDA the fused kernel runs for bf16 on sm90/sm100; other CUDA dtypes/GPUs run torch's own
per-group loop inside the op; on the CPU the op is a per-group loop too.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .mxfp8 import mxfp8_grouped_linear, mxfp8_problems

__all__ = ["GROUPED_MM_BACKENDS", "GroupLayout", "GroupedMMChoice", "grouped_linear", "select_grouped_mm_backend"]

GROUPED_MM_BACKENDS: tuple[str, ...] = ("auto", "grouped_mm", "loop", "gmm", "te", "mxfp8")
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GroupedMMChoice:
    """Which kernel multiplies the expert groups, and why (`backend` is "grouped_mm", "loop", "gmm", "te" or "mxfp8").

    seconds: `((backend, seconds), ...)` when `grouped_mm="auto"` measured the candidates (`am_moe.tuning`), else ().
    """

    backend: str
    reason: str
    seconds: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class GroupLayout:
    """Rows `[N, ...]` grouped by expert: group g is rows `[ends[g-1], ends[g])`.

    ends: `[G]` int32 cumulative row counts on the rows' device (what `torch._grouped_mm` reads).
    sizes: the same counts on the host when the caller already has them (the loop backend needs them).
    valid_rows: `[N]` bool, True for rows inside a group, when rows past `ends[-1]` exist (padding pairs kept in
        place to avoid a device-to-host sync); their outputs and gradients are forced to 0.
    """

    ends: torch.Tensor
    sizes: list[int] | None = None
    valid_rows: torch.Tensor | None = None

    @classmethod
    def from_sizes(cls, sizes: list[int], *, device: torch.device) -> GroupLayout:
        """The layout of rows grouped back to back with these host row counts per group (`ends` on `device`)."""
        ends = torch.tensor(sizes, dtype=torch.int64, device=device).cumsum(0).to(torch.int32)
        return cls(ends, sizes=sizes)


def select_grouped_mm_backend(
    *, device: torch.device | str, dtype: torch.dtype, sizes: tuple[int, ...], requested: str = "auto"
) -> GroupedMMChoice:
    """The grouped-GEMM backend for experts on `device` in `dtype` whose matrices have the inner `sizes`.

    sizes: every contraction and output width the experts multiply (hidden size, intermediate size, 2 x intermediate
        for gated experts). requested: "auto" (the fastest that runs), "grouped_mm" (refused with the reason when it
        cannot run), "loop", "gmm" (the `grouped_gemm` package: bf16 on CUDA) or "te" (Transformer Engine's
        `GroupedLinear`: CUDA) or "mxfp8" (MXFP8 operands, torch's block-scaled grouped GEMM: bf16 on CUDA
        compute capability 10.x, every size a multiple of 32); a library or hardware backend is refused naming
        everything that is missing.
    """
    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    capability = torch.cuda.get_device_capability(device) if cuda else None
    return _select(device.type, capability, dtype, tuple(int(s) for s in sizes), requested)


@functools.cache
def _select(
    device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype, sizes: tuple[int, ...], requested: str
) -> GroupedMMChoice:
    if requested not in GROUPED_MM_BACKENDS:
        raise ValueError(f"grouped GEMM backend {requested!r} is unknown; choose one of {GROUPED_MM_BACKENDS}")
    if requested == "loop":
        return GroupedMMChoice("loop", "requested: one matmul per expert over split views")
    if requested == "gmm":
        return _select_gmm(device_type, dtype)
    if requested == "te":
        return _select_te(device_type, dtype)
    if requested == "mxfp8":
        problems = mxfp8_problems(device_type, capability, dtype, sizes)
        if problems:
            raise ValueError("grouped GEMM backend 'mxfp8' cannot run here: " + "; ".join(problems))
        return GroupedMMChoice(
            "mxfp8",
            f"requested: MXFP8 operands (e4m3, e8m0 scales per 32 along K) and torch's block-scaled grouped GEMM on "
            f"cuda {capability}; bf16 backward",
        )
    refusals = []
    if not hasattr(torch, "_grouped_mm"):
        refusals.append(f"torch {torch.__version__} has no torch._grouped_mm")
    if device_type not in ("cpu", "cuda"):
        refusals.append(f"torch._grouped_mm is only used on cpu and cuda, not {device_type!r}")
    if dtype not in _GROUPED_MM_DTYPES:
        refusals.append(f"torch._grouped_mm takes fp32/bf16/fp16, not {dtype}")
    else:
        alignment = 16 // torch.empty((), dtype=dtype).element_size()
        misaligned = sorted({s for s in sizes if s % alignment})
        if misaligned:
            refusals.append(
                f"torch._grouped_mm needs row strides that are multiples of 16 bytes: sizes {misaligned} are not "
                f"multiples of {alignment} in {dtype}"
            )
    if refusals:
        if requested == "grouped_mm":
            raise ValueError("grouped GEMM backend 'grouped_mm' cannot run here: " + "; ".join(refusals))
        return GroupedMMChoice("loop", "; ".join(refusals) + " -> one matmul per expert over split views")
    if device_type == "cuda":
        fused = dtype == torch.bfloat16 and capability is not None and capability[0] in (9, 10)
        kernel = "fused grouped kernel (bf16, sm90/sm100)" if fused else "torch's per-group loop inside the op"
        return GroupedMMChoice("grouped_mm", f"torch._grouped_mm on cuda {capability}, {dtype}: {kernel}")
    return GroupedMMChoice("grouped_mm", f"torch._grouped_mm on cpu, {dtype} (a per-group loop inside the op)")


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _select_te(device_type: str, dtype: torch.dtype) -> GroupedMMChoice:
    refusals = []
    if not _installed("transformer_engine"):
        refusals.append(
            "Transformer Engine is not installed (`transformer_engine.pytorch`; "
            "`pip install transformer_engine[pytorch]` on a CUDA machine)"
        )
    if device_type != "cuda":
        refusals.append(f"Transformer Engine's GroupedLinear runs only on CUDA, not {device_type!r}")
    if dtype not in _GROUPED_MM_DTYPES:
        refusals.append(f"Transformer Engine's GroupedLinear takes fp32/bf16/fp16, not {dtype}")
    if refusals:
        raise ValueError("grouped GEMM backend 'te' cannot run here: " + "; ".join(refusals))
    return GroupedMMChoice(
        "te", "requested: transformer_engine.pytorch.GroupedLinear (one grouped GEMM per projection)"
    )


@functools.cache
def _te_grouped_linear(groups: int, in_features: int, out_features: int, dtype: torch.dtype) -> Any:
    """One weightless TE `GroupedLinear` per shape: built on the meta device (TE's deferred initialisation), its
    `weight{g}` parameters are replaced at each call by views of the stacked expert weight (`functional_call`), so
    the experts keep ONE `[G, out, in]` parameter (EP / FSDP2 / checkpoints unchanged) and TE allocates no copy."""
    te = importlib.import_module("transformer_engine.pytorch")  # imports TE's CUDA extension: first use only
    return te.GroupedLinear(groups, in_features, out_features, bias=False, params_dtype=dtype, device="meta")


def _te_linear(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    module = _te_grouped_linear(weight.shape[0], weight.shape[2], weight.shape[1], weight.dtype)
    weights = {f"weight{g}": w for g, w in enumerate(weight.unbind(0))}
    # GroupedLinear.forward(inp, m_splits): rows [sum(m_splits), in] grouped in order -> [sum(m_splits), out]
    return torch.func.functional_call(module, weights, (x, sizes))


def _select_gmm(device_type: str, dtype: torch.dtype) -> GroupedMMChoice:
    refusals = []
    if not _installed("grouped_gemm"):
        refusals.append("the `grouped_gemm` package is not installed (`pip install grouped_gemm` on a CUDA machine)")
    if device_type != "cuda":
        refusals.append(f"grouped_gemm runs only on CUDA, not {device_type!r}")
    if dtype != torch.bfloat16:
        refusals.append(f"grouped_gemm multiplies bf16 only, not {dtype}")
    if refusals:
        raise ValueError("grouped GEMM backend 'gmm' cannot run here: " + "; ".join(refusals))
    return GroupedMMChoice("gmm", "requested: grouped_gemm.ops.gmm (CUTLASS grouped GEMM, bf16 on cuda)")


def _gmm_ops() -> Any:
    # Imported on first use only: importing grouped_gemm loads its CUDA extension.
    return importlib.import_module("grouped_gemm.ops")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (`_grouped_mm`'s backward rejects stride-0 ones)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, layout: GroupLayout, *, backend: str) -> torch.Tensor:
    """`out[rows of group g] = x[rows of group g] @ weight[g].T` for every group. x: `[N, in]`, weight: `[G, out, in]`
    -> `[N, out]` in x's dtype. Rows outside every group (`layout.valid_rows` False) give 0 and pass no gradient.

    backend: a `GroupedMMChoice.backend` ("grouped_mm", "loop", "gmm", "te" or "mxfp8"); all but grouped_mm need
        `layout.sizes`.
    """
    valid = None if layout.valid_rows is None else layout.valid_rows.unsqueeze(-1)
    if valid is not None:
        # torch.where, not a multiply: rows past the last group are uninitialized (NaN/inf possible) in the output and
        # in the input gradient of torch._grouped_mm; masking the input here zeroes that gradient on its way back.
        x = torch.where(valid, x, x.new_zeros(()))
    if backend == "grouped_mm":
        out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=layout.ends)
        out = _ContiguousGrad.apply(out)
    elif backend in ("loop", "gmm", "te", "mxfp8"):
        if layout.sizes is None:
            raise ValueError(f"the {backend} backend needs the group sizes on the host (GroupLayout.sizes)")
        sizes, total = layout.sizes, sum(layout.sizes)
        if backend == "loop":
            # unbind, not weight[g]: the weight gradient is one stack, not a zero-filled [G, out, in] tensor per group.
            # Empty groups are kept so every expert's weight gets a (zero) gradient even when no row reaches it.
            out = torch.cat(
                [F.linear(part, w) for part, w in zip(x[:total].split(sizes), weight.unbind(0), strict=True)]
            )
        elif backend == "gmm":
            # grouped_gemm's public op: gmm(a [N, in], b [G, out, in], batch_sizes int64 on the host, trans_b=True).
            out = _gmm_ops().gmm(x[:total], weight, torch.tensor(sizes, dtype=torch.int64), trans_b=True)
        elif backend == "te":
            out = _te_linear(x[:total], weight, sizes)
        else:
            out = mxfp8_grouped_linear(x, weight, sizes)
        if out.shape[0] < x.shape[0]:  # rows past the last group (padding pairs) give 0
            out = torch.cat([out, out.new_zeros(x.shape[0] - out.shape[0], weight.shape[1])])
    else:
        raise ValueError(
            f"grouped_linear backend must be 'grouped_mm', 'loop', 'gmm', 'te' or 'mxfp8', not {backend!r}"
        )
    if valid is not None:
        out = torch.where(valid, out, out.new_zeros(()))
    return out
