"""MXFP8 grouped GEMM for the experts (upstream's `BackendConfig.experts="torch_mm_mxfp8"`, am-moe's "mxfp8").

What it is for: `mxfp8_grouped_linear` computes `out[g] = x[g] @ weight[g].T` for every expert group like
`grouped_linear`, with both operands quantized to MXFP8 (OCP Microscaling Formats v1.0: float8_e4m3fn elements, one
float8_e8m0fnu power-of-two scale per block of 32 consecutive elements along the contraction dimension K) and
multiplied by torch's block-scaled grouped GEMM (`torch.nn.functional.scaled_grouped_mm`, recipe `BlockWise1x32`,
scales in the `SWIZZLE_32_4_4` layout; torch's MSLK/CUTLASS kernel, NVIDIA data-centre Blackwell, sm100), bf16
output. The backward is bf16: the input and weight gradients are the bf16 grouped GEMMs of the UNQUANTIZED saved
inputs (`torch._grouped_mm`), i.e. the quantization is a straight-through estimator; torchao's MXFP8 MoE training
quantizes the backward GEMMs as well, which this module does not do.
What it must not do: run anywhere but where the kernel exists (`mxfp8_problems` names what is missing, and
`grouped_mm.select_grouped_mm_backend` refuses "mxfp8" with it), or fall back to another kernel. On the CPU the
quantization, the scale layout and the group padding are pure torch and tested; `emulated_scaled_grouped_mm`
consumes exactly the kernel's operands (fp8 data, blocked e8m0 scales, offsets), so the only part the CPU tests do
not run is the kernel call itself.

Scale rule: the block's shared exponent is `ceil(log2(amax / 448))` ("RCEIL", what NVIDIA's Blackwell quantizer,
Transformer Engine and torchao's default MXFP8 cast use), so the block maximum maps into (224, 448] and no element
saturates. The spec's example rule `floor(log2(amax)) - 8` maps it into [256, 512) and clamps values above 448 (up to
12.5% error on the block maximum). Both give a power-of-two E8M0 scale; exponents are clamped to E8M0's [-127, 127].

Kernel operands (torch 2.15, `_check_scales_blocked` in ATen's GroupedBlas.cpp and torch's own MXFP8 grouped test):
  mat_a [M, K] fp8 row-major, groups of rows ending at `offs` [G] int32 (device);
  mat_b [G, K, N] fp8 column-major (the transpose of the stacked `[G, N, K]` weight, no copy);
  scale_a: each group's `[M_g, K/32]` scales in the blocked layout, padded to `[round_up(M_g, 128), round_up(K/32, 4)]`
      and the groups concatenated along rows;
  scale_b: `[G, round_up(N, 128) * round_up(K/32, 4)]`, each expert's blocked scales flattened.
Token groups are padded with zero rows to multiples of 32 (`GROUP_ALIGNMENT`, torchao's / torchtitan's token-group
alignment for MXFP8, the only one torch's tests run) before quantization; the padding rows are dropped again.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "GROUP_ALIGNMENT",
    "MX_BLOCK",
    "MXFP8Operands",
    "dequantize_mxfp8",
    "emulated_scaled_grouped_mm",
    "from_blocked",
    "mxfp8_grouped_linear",
    "mxfp8_operands",
    "mxfp8_problems",
    "quantize_mxfp8",
    "to_blocked",
]

MX_BLOCK = 32  # elements sharing one E8M0 scale, along K (OCP MX v1.0)
GROUP_ALIGNMENT = 32  # token rows per expert group are padded to a multiple of this
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_E8M0_BIAS = 127
_SCALE_ROWS, _SCALE_COLS = 128, 4  # the blocked scale tile: 128 rows x 4 scale columns (cuBLAS block scaling layout)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def mxfp8_problems(
    device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype, sizes: tuple[int, ...]
) -> list[str]:
    """Every reason the MXFP8 grouped GEMM cannot run for `dtype` inputs on this device (empty: it runs).

    sizes: every contraction and output width of the experts (H, I, 2I); all must be multiples of 32 (the MX block
    along K; the kernel also needs K and N multiples of 16).
    """
    problems = []
    if not hasattr(torch.nn.functional, "scaled_grouped_mm") or not hasattr(torch, "float8_e8m0fnu"):
        problems.append(f"torch {torch.__version__} has no torch.nn.functional.scaled_grouped_mm with e8m0 scales")
    elif not any(flag in torch.__config__.show() for flag in ("USE_MSLK", "USE_FBGEMM_GENAI")):
        problems.append("this torch build has no MXFP8 grouped kernel (built without USE_MSLK / USE_FBGEMM_GENAI)")
    if device_type != "cuda":
        problems.append(f"the MXFP8 grouped GEMM runs only on CUDA, not {device_type!r}")
    elif capability is None or capability[0] != 10:
        problems.append(
            f"the MXFP8 grouped GEMM needs an NVIDIA data-centre Blackwell GPU (compute capability 10.x, B200 / "
            f"GB200), not {capability}"
        )
    if dtype != torch.bfloat16:
        problems.append(f"the MXFP8 experts take bf16 inputs (the kernel writes bf16), not {dtype}")
    misaligned = sorted({s for s in sizes if s % MX_BLOCK})
    if misaligned:
        problems.append(
            f"MXFP8 scales blocks of {MX_BLOCK} along K: sizes {misaligned} are not multiples of {MX_BLOCK}"
        )
    return problems


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 along the last dimension. x: `[..., K]` float, K a multiple of 32 ->
    (data `[..., K]` float8_e4m3fn, scales `[..., K/32]` float8_e8m0fnu) with `x ~= data * scale` per block.

    The scale is `2**ceil(log2(amax / 448))` (exact: from `frexp`), clamped to E8M0's `2**-127 .. 2**127`; an
    all-zero block gets `2**-127`, a block holding NaN a NaN scale (E8M0 0xFF).
    """
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"quantize_mxfp8: the last dimension ({x.shape[-1]}) must be a multiple of {MX_BLOCK}")
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(-1)
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)  # amax/448 = m * 2**e, m in [0.5, 1)
    # ceil(log2(m * 2**e)) is e, except for m == 0.5 (an exact power of two, 2**(e-1)); zero gives m == 0
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = torch.where(amax == 0, -_E8M0_BIAS, exponent).clamp(-_E8M0_BIAS, _E8M0_BIAS)
    biased = (exponent + _E8M0_BIAS).to(torch.uint8)
    biased = torch.where(amax.isnan(), torch.full_like(biased, 0xFF), biased)
    scaled = blocks * torch.exp2(-exponent.float()).unsqueeze(-1)
    # the clamp catches a division rounded just past 448 (and inf); e4m3fn has no inf, overflow would become NaN
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return data, biased.view(torch.float8_e8m0fnu)


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """data `[..., K]` float8_e4m3fn, scales `[..., K/32]` float8_e8m0fnu -> `[..., K]` float32."""
    return (data.float().unflatten(-1, (-1, MX_BLOCK)) * scales.float().unsqueeze(-1)).flatten(-2)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """`[..., rows, cols]` scales -> `[..., round_up(rows, 128), round_up(cols, 4)]` in the hardware's blocked order
    (leading dimensions, e.g. experts, are blocked independently).

    The padded matrix is cut into 128 x 4 tiles (row-major over tiles); inside a tile, the scale of row r, column c
    sits at `(r % 32) * 16 + (r // 32) * 4 + c` (cuBLAS "1D block scaling factors layout"). The result's storage is
    that order; its shape only says how much there is.
    """
    *lead, rows, cols = scales.shape
    padded_rows, padded_cols = _round_up(rows, _SCALE_ROWS), _round_up(cols, _SCALE_COLS)
    is_e8m0 = scales.dtype == torch.float8_e8m0fnu
    raw = scales.view(torch.uint8) if is_e8m0 else scales  # e8m0 lacks fill / copy kernels on some devices: move bytes
    padded = raw.new_zeros(*lead, padded_rows, padded_cols)
    padded[..., :rows, :cols] = raw
    tiles = padded.view(*lead, padded_rows // 128, 128, padded_cols // 4, 4).transpose(-3, -2)  # [..., tr, tc, 128, 4]
    swizzled = tiles.reshape(*lead, -1, 4, 32, 4).transpose(-3, -2).reshape(*lead, padded_rows, padded_cols)
    return swizzled.view(torch.float8_e8m0fnu) if is_e8m0 else swizzled


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `to_blocked`: blocked scales (any shape holding `round_up(rows,128) * round_up(cols,4)`
    elements) -> `[rows, cols]`."""
    padded_rows, padded_cols = _round_up(rows, _SCALE_ROWS), _round_up(cols, _SCALE_COLS)
    is_e8m0 = blocked.dtype == torch.float8_e8m0fnu
    raw = blocked.reshape(-1).view(torch.uint8) if is_e8m0 else blocked.reshape(-1)
    tiles = raw.view(-1, 32, 4, 4).transpose(1, 2).reshape(padded_rows // 128, padded_cols // 4, 128, 4)
    plain = tiles.permute(0, 2, 1, 3).reshape(padded_rows, padded_cols)[:rows, :cols].contiguous()
    return plain.view(torch.float8_e8m0fnu) if is_e8m0 else plain


@dataclass
class MXFP8Operands:
    """The kernel's operands for one grouped GEMM (see the module docstring), and where the real rows went.

    data_a `[M_pad, K]` e4m3, scale_a `[sum_g round_up(P_g, 128), round_up(K/32, 4)]` e8m0 (blocked per group),
    data_b `[G, N, K]` e4m3 (pass `.transpose(-2, -1)`), scale_b `[G, round_up(N, 128) * round_up(K/32, 4)]` e8m0,
    offs `[G]` int32 padded group ends, rows `[total]` int64: the padded row of each real row (in group order).
    """

    data_a: torch.Tensor
    scale_a: torch.Tensor
    data_b: torch.Tensor
    scale_b: torch.Tensor
    offs: torch.Tensor
    rows: torch.Tensor
    padded_sizes: list[int]


def mxfp8_operands(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> MXFP8Operands:
    """Quantize `x [sum(sizes), K]` (rows grouped by expert, `sizes` on the host) and `weight [G, N, K]` for the
    kernel: groups padded with zero rows to multiples of `GROUP_ALIGNMENT`, both quantized along K, scales blocked."""
    groups, _n_out, k = weight.shape
    padded_sizes = [_round_up(s, GROUP_ALIGNMENT) for s in sizes]
    sizes_t = torch.tensor(sizes, device=x.device)
    starts = torch.cumsum(sizes_t, 0) - sizes_t
    padded_t = torch.tensor(padded_sizes, device=x.device)
    padded_starts = torch.cumsum(padded_t, 0) - padded_t
    group_of_row = torch.repeat_interleave(torch.arange(groups, device=x.device), sizes_t, output_size=sum(sizes))
    rows = torch.arange(sum(sizes), device=x.device) - starts[group_of_row] + padded_starts[group_of_row]
    x_padded = x.new_zeros(sum(padded_sizes), k)
    x_padded[rows] = x
    data_a, scales_a = quantize_mxfp8(x_padded)
    blocked_a = [to_blocked(part) for part in scales_a.split(padded_sizes) if part.shape[0]]
    scale_cols = _round_up(k // MX_BLOCK, _SCALE_COLS)
    scale_a = torch.cat(blocked_a) if blocked_a else scales_a.new_empty(0, scale_cols)
    data_b, scales_b = quantize_mxfp8(weight)
    scale_b = to_blocked(scales_b).reshape(groups, -1)
    offs = torch.cumsum(padded_t, 0).to(torch.int32)
    return MXFP8Operands(data_a, scale_a, data_b, scale_b, offs, rows, padded_sizes)


def _scaled_grouped_mm(operands: MXFP8Operands) -> torch.Tensor:
    """The kernel: torch's block-scaled grouped GEMM (CUDA sm100), bf16 `[M_pad, N]`."""
    functional: Any = importlib.import_module("torch.nn.functional")
    blockwise, swizzle = functional.ScalingType.BlockWise1x32, functional.SwizzleType.SWIZZLE_32_4_4
    return functional.scaled_grouped_mm(
        operands.data_a,
        operands.data_b.transpose(-2, -1),
        operands.scale_a,
        blockwise,
        operands.scale_b,
        blockwise,
        swizzle_a=swizzle,
        swizzle_b=swizzle,
        offs=operands.offs,
        output_dtype=torch.bfloat16,
    )


def emulated_scaled_grouped_mm(operands: MXFP8Operands) -> torch.Tensor:
    """What the kernel computes, from the same operands, in plain torch (any device): each group's blocked scales
    unblocked, both operands dequantized, multiplied in fp32, rounded to bf16. `[M_pad, N]` bf16."""
    _groups, n_out, k = operands.data_b.shape
    scale_cols = k // MX_BLOCK
    out = torch.zeros(operands.data_a.shape[0], n_out, dtype=torch.float32, device=operands.data_a.device)
    start, scale_row = 0, 0
    for g, size in enumerate(operands.padded_sizes):
        if size:
            blocked_rows = _round_up(size, _SCALE_ROWS)
            scales = from_blocked(operands.scale_a[scale_row : scale_row + blocked_rows], size, scale_cols)
            a = dequantize_mxfp8(operands.data_a[start : start + size], scales)
            b = dequantize_mxfp8(operands.data_b[g], from_blocked(operands.scale_b[g], n_out, scale_cols))
            out[start : start + size] = a @ b.T
            start, scale_row = start + size, scale_row + blocked_rows
    return out.to(torch.bfloat16)


class _MXFP8GroupedLinear(torch.autograd.Function):
    """Forward: MXFP8 grouped GEMM. Backward: bf16 grouped GEMMs of the unquantized inputs (straight-through)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        sizes: list[int],
        emulate: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.ends = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)  # type: ignore[attr-defined]
        if x.shape[0] == 0:  # no rows reached these experts (an ep rank can receive none): no kernel call
            return x.new_zeros(0, weight.shape[1])
        operands = mxfp8_operands(x, weight, sizes)
        out = (emulated_scaled_grouped_mm if emulate else _scaled_grouped_mm)(operands)
        return out[operands.rows].to(x.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        ends = ctx.ends  # type: ignore[attr-defined]
        if x.shape[0] == 0:  # every expert still gets a (zero) gradient, as with the other backends
            return torch.zeros_like(x), torch.zeros_like(weight), None, None
        grad = grad.contiguous()  # an expanded (stride-0) gradient is not a valid grouped-GEMM operand
        grad_x = torch._grouped_mm(grad, weight, offs=ends)  # [M, N] x [G, N, K] -> [M, K]
        grad_w = torch._grouped_mm(grad.t(), x, offs=ends)  # [N, M] x [M, K] over row groups -> [G, N, K]
        return grad_x, grad_w, None, None


def mxfp8_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, sizes: list[int], *, emulate: bool = False
) -> torch.Tensor:
    """`out[rows of group g] = x[rows of group g] @ weight[g].T` with MXFP8 operands. x: `[N, K]` bf16 (rows past
    `sum(sizes)` give 0 and no gradient), weight: `[G, out, K]` bf16, sizes: rows per group on the host ->
    `[N, out]` bf16.

    emulate: run `emulated_scaled_grouped_mm` instead of the CUDA kernel (the CPU tests; same operands).
    """
    total = sum(sizes)
    out = _MXFP8GroupedLinear.apply(x[:total], weight, sizes, emulate)
    if total < x.shape[0]:
        out = torch.cat([out, out.new_zeros(x.shape[0] - total, weight.shape[1])])
    return out
