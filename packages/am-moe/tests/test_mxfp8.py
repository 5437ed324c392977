"""MXFP8 experts: the quantization, the scale layout, the group padding and the grouped GEMM on the kernel's operands.

Contract: `quantize_mxfp8` gives one power-of-two E8M0 scale per 32 elements along K, `2**ceil(log2(amax/448))`
(clamped to E8M0's range), no element saturates, and the round trip error of every element is within e4m3's
rounding: half an ulp of 3 mantissa bits for normals (`|x| * 2**-4`), half the smallest subnormal step below
(`scale * 2**-10`). `to_blocked` is cuBLAS's 128x4-tile layout (checked against the documented index formula) and
`from_blocked` its inverse. The grouped GEMM on the kernel's operands (groups padded to 32 zero rows, scales blocked
per group) equals the dequantized reference, and the bf16 reference within MXFP8's error; its backward equals the
bf16 grouped GEMM's gradients. Only the CUDA kernel call itself is not run here (no Blackwell GPU): the same
operands go to `emulated_scaled_grouped_mm`; "mxfp8" is refused here naming the missing hardware.
"""

from __future__ import annotations

import math

import pytest
import torch

from am_moe import GroupedExperts, GroupLayout, grouped_linear, select_grouped_mm_backend
from am_moe import mxfp8 as mx

NORMAL_REL = 2.0**-4  # half an ulp of e4m3's 3 mantissa bits, relative to the value (normal range)
SUBNORMAL_ABS = 2.0**-10  # half of e4m3's smallest subnormal step 2**-9, in units of the block scale
# relative Frobenius error of a K=64..128 product of two MXFP8 operands against bf16: each element's error is at
# most 6.25% and about 2% rms; measured 3-4%
GEMM_REL = 0.06
# the experts chain two MXFP8 GEMMs (the second on an activation carrying the first's error): measured ~7%
EXPERTS_REL = 0.1
BF16_TOL = 2e-2  # gradients: bf16 grouped GEMMs vs fp32 per-group matmuls of the same bf16 inputs


def _expected_exponent(amax: float) -> int:
    if amax == 0:
        return -127
    return max(-127, min(127, math.ceil(math.log2(amax / 448.0))))


def test_scale_exponents_follow_the_rceil_rule_exactly() -> None:
    amaxes = [448.0, 449.0, 224.0, 1.0, 3.5, 2.0**-130, 0.0, 1e30, 448.0 * 2.0**-20, 447.99]
    rows = []
    for amax in amaxes:
        row = torch.zeros(32)
        row[7] = -amax  # the sign must not matter
        row[0] = amax / 3
        rows.append(row)
    data, scales = mx.quantize_mxfp8(torch.stack(rows))
    assert data.dtype == torch.float8_e4m3fn
    assert scales.dtype == torch.float8_e8m0fnu
    assert scales.shape == (len(amaxes), 1)
    biased = scales.view(torch.uint8).flatten().tolist()
    assert [b - 127 for b in biased] == [_expected_exponent(a) for a in amaxes]
    # powers of two times 448 are exact: amax 448 -> scale 1, 224 -> 2**-1
    assert biased[0] == 127
    assert biased[2] == 126
    nan_block = torch.zeros(1, 32)
    nan_block[0, 3] = float("nan")
    assert mx.quantize_mxfp8(nan_block)[1].view(torch.uint8).item() == 0xFF


def test_round_trip_error_is_within_e4m3_rounding_and_nothing_saturates() -> None:
    gen = torch.Generator().manual_seed(0)
    # blocks of very different magnitudes, and blocks with a wide range inside (subnormal elements)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-30, 30, 64).unsqueeze(-1)
    x[:, :32] *= torch.logspace(-6, 0, 32)
    data, scales = mx.quantize_mxfp8(x)
    scale = scales.float().repeat_interleave(mx.MX_BLOCK, -1)
    scaled = x / scale
    assert scaled.abs().max() <= mx.E4M3_MAX
    block_max = scaled.abs().unflatten(-1, (-1, 32)).amax(-1)
    assert (block_max > mx.E4M3_MAX / 2).all(), "the block maximum maps into (224, 448]"
    error = (mx.dequantize_mxfp8(data, scales) - x).abs()
    bound = torch.maximum(x.abs() * NORMAL_REL, scale * SUBNORMAL_ABS)
    assert (error <= bound).all()
    # values that e4m3 holds exactly (small integers times the scale) come back exactly
    exact = torch.tensor([[448.0, -3.0, 0.5, 0.0] * 8]) * 2.0**-5
    assert torch.equal(mx.dequantize_mxfp8(*mx.quantize_mxfp8(exact)), exact)


def test_quantize_refuses_k_not_a_multiple_of_the_block() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.quantize_mxfp8(torch.ones(2, 48))


@pytest.mark.parametrize(("rows", "cols"), [(128, 4), (200, 7), (1, 1), (300, 8)])
def test_blocked_layout_is_cublas_and_from_blocked_inverts_it(rows: int, cols: int) -> None:
    scales = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 1
    blocked = mx.to_blocked(scales)
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert blocked.shape == (padded_rows, padded_cols)
    flat = blocked.reshape(-1)
    tiles_per_row = padded_cols // 4
    for r in range(rows):
        for c in range(cols):
            offset = 512 * ((r // 128) * tiles_per_row + c // 4) + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4
            assert flat[offset] == scales[r, c]
    assert int((flat == 0).sum()) == padded_rows * padded_cols - rows * cols  # the padding is zero
    assert torch.equal(mx.from_blocked(blocked, rows, cols), scales)
    e8m0 = (torch.arange(rows * cols) % 250).to(torch.uint8).view(torch.float8_e8m0fnu).reshape(rows, cols)
    back = mx.from_blocked(mx.to_blocked(e8m0), rows, cols)
    assert back.dtype == torch.float8_e8m0fnu
    assert torch.equal(back.view(torch.uint8), e8m0.view(torch.uint8))


def test_operands_pad_groups_to_32_rows_and_block_scales_per_group() -> None:
    gen = torch.Generator().manual_seed(1)
    sizes = [3, 0, 40, 33, 32]
    x = torch.randn(sum(sizes), 64, generator=gen).bfloat16()
    weight = torch.randn(5, 48, 64, generator=gen).bfloat16()
    ops = mx.mxfp8_operands(x, weight, sizes)
    assert ops.padded_sizes == [32, 0, 64, 64, 32]
    assert ops.offs.dtype == torch.int32
    assert ops.offs.tolist() == [32, 32, 96, 160, 192]
    assert ops.data_a.shape == (192, 64)
    assert ops.data_a.dtype == torch.float8_e4m3fn
    # the real rows sit at the start of their padded group, in order; the padding rows are zero
    assert ops.rows.tolist() == [*range(0, 3), *range(32, 72), *range(96, 129), *range(160, 192)]
    padding = torch.ones(192, dtype=torch.bool)
    padding[ops.rows] = False
    assert (ops.data_a[padding].float() == 0).all()
    # scale_a: each non-empty group blocked on its own, 128 rows per group of up to 128, K/32 = 2 -> 4 columns;
    # what torch's kernel checks: rows >= M
    assert ops.scale_a.shape == (4 * 128, 4)
    assert ops.scale_a.dtype == torch.float8_e8m0fnu
    assert ops.scale_a.shape[0] >= ops.data_a.shape[0]
    # scale_b: [G, round_up(N, 128) * round_up(K/32, 4)], torch's check for the 3-D operand
    assert ops.scale_b.shape == (5, 128 * 4)
    _, w_scales = mx.quantize_mxfp8(weight)
    per_expert = torch.stack([mx.to_blocked(w).reshape(-1) for w in w_scales.unbind(0)])
    assert torch.equal(ops.scale_b.view(torch.uint8), per_expert.view(torch.uint8)), "experts blocked independently"
    # the quantization of a row does not depend on its group: the same as quantizing x alone
    data, scales = mx.quantize_mxfp8(x)
    assert torch.equal(ops.data_a[ops.rows].view(torch.uint8), data.view(torch.uint8))
    third = mx.from_blocked(ops.scale_a[256:384], 64, 2)  # group 3 (33 real rows) is the third blocked group
    assert torch.equal(third[:33].view(torch.uint8), scales[43:76].view(torch.uint8))
    assert (third[33:].view(torch.uint8) == 0).all(), "zero rows get the smallest scale 2**-127"


def _dequantized_reference(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    dx = mx.dequantize_mxfp8(*mx.quantize_mxfp8(x))
    dw = mx.dequantize_mxfp8(*mx.quantize_mxfp8(weight))
    return torch.cat([p @ w.T for p, w in zip(dx.split(sizes), dw.unbind(0), strict=True)])


@pytest.mark.parametrize("sizes", [[3, 0, 40, 33], [0, 0, 5], [64, 64], [1], [0, 0]])
def test_grouped_gemm_on_the_kernel_operands_equals_the_dequantized_reference(sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(sizes) + sum(sizes))
    x = torch.randn(sum(sizes) + 2, 128, generator=gen).bfloat16()  # two trailing rows outside every group
    weight = (torch.randn(len(sizes), 96, 128, generator=gen) * 0.05).bfloat16()
    x.requires_grad_()
    weight.requires_grad_()
    out = mx.mxfp8_grouped_linear(x, weight, sizes, emulate=True)
    assert out.dtype == torch.bfloat16
    assert out.shape == (sum(sizes) + 2, 96)
    assert torch.equal(out[sum(sizes) :], torch.zeros(2, 96, dtype=torch.bfloat16))
    total = sum(sizes)
    reference = _dequantized_reference(x.detach()[:total].float(), weight.detach().float(), sizes)
    # the same fp32 products, rounded once to bf16
    torch.testing.assert_close(out.detach()[:total].float(), reference.bfloat16().float(), rtol=0, atol=0)
    exact = torch.cat(
        [p.float() @ w.float().T for p, w in zip(x.detach()[:total].split(sizes), weight.detach(), strict=True)]
    )
    if total:
        assert float((out.detach()[:total].float() - exact).norm() / exact.norm()) < GEMM_REL
    # backward: the bf16 grouped GEMM's gradients of the unquantized inputs (straight-through)
    grad = torch.randn(total + 2, 96, generator=gen).bfloat16()
    out.backward(grad)
    x_ref = x.detach().float().requires_grad_()
    w_ref = weight.detach().float().requires_grad_()
    ref = torch.cat([p @ w.T for p, w in zip(x_ref[:total].split(sizes), w_ref.unbind(0), strict=True)])
    ref.backward(grad[:total].float())
    assert x.grad is not None
    assert weight.grad is not None
    torch.testing.assert_close(x.grad[:total].float(), x_ref.grad[:total], rtol=BF16_TOL, atol=BF16_TOL)
    assert torch.equal(x.grad[total:], torch.zeros_like(x.grad[total:]))
    w_expected = w_ref.grad if w_ref.grad is not None else torch.zeros_like(w_ref)
    torch.testing.assert_close(weight.grad.float(), w_expected, rtol=BF16_TOL, atol=BF16_TOL)


def test_mxfp8_is_refused_off_blackwell_naming_what_is_missing() -> None:
    with pytest.raises(ValueError, match="'mxfp8' cannot run here") as err:
        select_grouped_mm_backend(device="cpu", dtype=torch.float32, sizes=(64, 48), requested="mxfp8")
    message = str(err.value)
    assert "only on CUDA, not 'cpu'" in message
    assert "bf16 inputs" in message
    assert "[48]" in message
    assert "multiples of 32" in message
    problems = mx.mxfp8_problems("cuda", (9, 0), torch.bfloat16, (64,))
    assert len(problems) == 1
    assert "Blackwell" in problems[0]
    assert "(9, 0)" in problems[0]
    assert mx.mxfp8_problems("cuda", (10, 0), torch.bfloat16, (64, 128)) == []


def test_experts_run_the_mxfp8_backend_through_grouped_linear(monkeypatch) -> None:
    """The experts' wiring (host group sizes, rows outside every group, both projections): with the rule granting
    "mxfp8" and the emulation standing in for the kernel, GroupedExperts equals the bf16 loop backend within MXFP8's
    error, and every expert weight gets a gradient."""
    from am_moe import grouped_mm

    monkeypatch.setattr(grouped_mm, "mxfp8_problems", lambda *args: [])
    grouped_mm._select.cache_clear()
    monkeypatch.setattr(mx, "_scaled_grouped_mm", mx.emulated_scaled_grouped_mm)
    try:
        torch.manual_seed(0)
        experts = GroupedExperts(4, 64, 32, gated=True, activation="silu", grouped_mm="mxfp8", dtype=torch.bfloat16)
        experts.init_weights(std=0.05)
        loop = GroupedExperts(4, 64, 32, gated=True, activation="silu", grouped_mm="loop", dtype=torch.bfloat16)
        loop.load_state_dict(experts.state_dict())
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(10, 64, generator=gen).bfloat16()
        weights, index = torch.rand(10, 4, generator=gen).softmax(-1).topk(2, -1)
        mask = torch.ones(10, dtype=torch.bool)
        mask[-1] = False
        out = experts(x, index, weights, token_mask=mask)
        assert experts.grouped_mm_choice is not None
        assert experts.grouped_mm_choice.backend == "mxfp8"
        expected = loop(x, index, weights, token_mask=mask)
        diff = (out.detach().float() - expected.detach().float()).norm() / expected.detach().float().norm()
        assert float(diff) < EXPERTS_REL
        assert torch.equal(out[-1], torch.zeros(64, dtype=torch.bfloat16))
        out.float().sum().backward()
        assert experts.gate_up_proj.grad is not None
        assert experts.down_proj.grad is not None
        # grouped_linear's mask for rows outside every group (the no-sync layout) composes with the backend
        layout = GroupLayout(torch.tensor([4, 8], dtype=torch.int32), sizes=[4, 4], valid_rows=torch.arange(9) < 8)
        rows = torch.randn(9, 64, generator=gen).bfloat16()
        y = grouped_linear(rows, experts.down_proj.detach()[:2].transpose(1, 2).contiguous(), layout, backend="mxfp8")
        assert torch.equal(y[8], torch.zeros(32, dtype=torch.bfloat16))
    finally:
        grouped_mm._select.cache_clear()
