"""Grouped GEMM: the backend choice follows the documented rules, and both backends equal per-group matmuls.

Contract: `grouped_linear` computes `x[g] @ weight[g].T` for every group g, forward and backward (fp32, to rounding
of the same matmuls), with `torch._grouped_mm` and with the per-expert loop; empty groups give zero weight
gradients (never None); rows outside every group give 0 and pass no gradient, even though `torch._grouped_mm`
leaves them uninitialized.
"""

from __future__ import annotations

import pytest
import torch

from am_moe import GroupedExperts, GroupedMMChoice, GroupLayout, grouped_linear, select_grouped_mm_backend

# fp32, same matmuls in a different grouping: differences are a few ulps of the result
FP32_TOL = 1e-6
BACKENDS = ("grouped_mm", "loop")


def _layout(sizes: list[int], total_rows: int | None = None) -> GroupLayout:
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    rows = sum(sizes) if total_rows is None else total_rows
    valid = None if total_rows is None else torch.arange(rows) < sum(sizes)
    return GroupLayout(ends, sizes=sizes if total_rows is None else None, valid_rows=valid)


def _per_group(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for g, n in enumerate(sizes):
        outs.append(x[start : start + n] @ weight[g].T)
        start += n
    return torch.cat(outs)


def test_auto_prefers_grouped_mm_on_cpu_when_strides_allow() -> None:
    choice = select_grouped_mm_backend(device="cpu", dtype=torch.float32, sizes=(8, 16, 32))
    assert choice.backend == "grouped_mm"
    assert "cpu" in choice.reason


def test_auto_falls_back_with_the_reason_for_misaligned_sizes() -> None:
    choice = select_grouped_mm_backend(device="cpu", dtype=torch.float32, sizes=(8, 6, 5))
    assert choice == GroupedMMChoice(choice.backend, choice.reason)
    assert choice.backend == "loop"
    assert "[5, 6]" in choice.reason
    assert "16 bytes" in choice.reason
    # bf16 needs multiples of 8 elements: 12 is fine in fp32 but not in bf16
    assert select_grouped_mm_backend(device="cpu", dtype=torch.float32, sizes=(12,)).backend == "grouped_mm"
    assert select_grouped_mm_backend(device="cpu", dtype=torch.bfloat16, sizes=(12,)).backend == "loop"


def test_auto_falls_back_for_unsupported_dtype_and_device() -> None:
    assert "fp32/bf16/fp16" in select_grouped_mm_backend(device="cpu", dtype=torch.float64, sizes=(8,)).reason
    meta = select_grouped_mm_backend(device="meta", dtype=torch.float32, sizes=(8,))
    assert meta.backend == "loop"
    assert "'meta'" in meta.reason


def test_requested_grouped_mm_is_refused_with_every_reason() -> None:
    with pytest.raises(ValueError, match="cannot run here") as info:
        select_grouped_mm_backend(device="meta", dtype=torch.float64, sizes=(5,), requested="grouped_mm")
    assert "'meta'" in str(info.value)
    assert "float64" in str(info.value)


def test_requested_loop_and_unknown_names() -> None:
    assert select_grouped_mm_backend(device="cpu", dtype=torch.float32, sizes=(8,), requested="loop").backend == "loop"
    with pytest.raises(ValueError, match="unknown"):
        select_grouped_mm_backend(device="cpu", dtype=torch.float32, sizes=(8,), requested="cutlass")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [0, 0, 4], [0, 0, 0], [7]])
def test_grouped_linear_equals_per_group_matmuls(backend: str, sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(sizes) + len(sizes))
    x = torch.randn(sum(sizes), 8, generator=gen, requires_grad=True)
    weight = torch.randn(len(sizes), 12, 8, generator=gen, requires_grad=True)
    grad_out = torch.randn(sum(sizes), 12, generator=gen)
    out = grouped_linear(x, weight, _layout(sizes), backend=backend)
    out.backward(grad_out)
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = _per_group(x_ref, w_ref, sizes) if sum(sizes) else x_ref @ w_ref[0].T
    ref.backward(grad_out)
    torch.testing.assert_close(out, ref, rtol=FP32_TOL, atol=FP32_TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=FP32_TOL, atol=FP32_TOL)
    assert weight.grad is not None, "every expert weight must get a gradient, zero when no row reached it"
    torch.testing.assert_close(weight.grad, w_ref.grad if w_ref.grad is not None else torch.zeros_like(weight))


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_incoming_gradient(backend: str) -> None:
    """`.sum().backward()` hands an expanded (stride-0) gradient, which torch._grouped_mm's backward rejects."""
    x = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(2, 4, 8, requires_grad=True)
    grouped_linear(x, weight, _layout([2, 4]), backend=backend).sum().backward()
    torch.testing.assert_close(weight.grad[0], torch.ones(4, 2) @ x[:2].detach(), rtol=FP32_TOL, atol=FP32_TOL)


def test_rows_outside_every_group_give_zero_and_no_gradient() -> None:
    """The no-sync path: 3 trailing rows stay behind the last group; torch._grouped_mm leaves them uninitialized."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 8, generator=gen, requires_grad=True)
    weight = torch.randn(2, 4, 8, generator=gen, requires_grad=True)
    out = grouped_linear(x, weight, _layout([2, 4], total_rows=9), backend="grouped_mm")
    assert torch.equal(out[6:], torch.zeros(3, 4))
    out.backward(torch.randn(9, 4, generator=gen))
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[6:], torch.zeros(3, 8))
    ref = _per_group(x.detach(), weight.detach(), [2, 4])
    torch.testing.assert_close(out[:6], ref, rtol=FP32_TOL, atol=FP32_TOL)


def test_loop_needs_host_sizes() -> None:
    with pytest.raises(ValueError, match="host"):
        grouped_linear(torch.zeros(2, 8), torch.zeros(1, 4, 8), _layout([2], total_rows=2), backend="loop")


def test_gmm_is_refused_naming_what_is_missing(monkeypatch) -> None:
    """`grouped_gemm` needs the package, CUDA and bf16: every missing piece in one message, never a fallback."""
    from am_moe import grouped_mm as module

    monkeypatch.setattr(module, "_installed", lambda package: package != "grouped_gemm")
    with pytest.raises(ValueError, match="'gmm' cannot run here") as err:
        select_grouped_mm_backend(device="cpu", dtype=torch.float32, sizes=(16,), requested="gmm")
    message = str(err.value)
    assert "`grouped_gemm` package is not installed" in message
    assert "only on CUDA" in message
    assert "bf16 only" in message


def test_gmm_calls_grouped_gemm_public_op_with_host_batch_sizes(monkeypatch) -> None:
    """grouped_linear(backend="gmm") calls `grouped_gemm.ops.gmm(a, b, batch_sizes, trans_b=True)` (its public API:
    b stacked [G, out, in], int64 batch sizes on the host) and pads rows past the last group with 0. The package
    needs CUDA, so a stand-in with its signature computes the per-group matmuls here."""
    from am_moe import grouped_mm as module

    calls = []

    class FakeOps:
        @staticmethod
        def gmm(a, b, batch_sizes, trans_b=False):
            calls.append((tuple(a.shape), batch_sizes.dtype, batch_sizes.device.type, trans_b))
            parts = a.split(batch_sizes.tolist())
            return torch.cat([p @ (w.T if trans_b else w) for p, w in zip(parts, b.unbind(0), strict=True)])

    monkeypatch.setattr(module, "_gmm_ops", lambda: FakeOps)
    x = torch.randn(7, 8)
    weight = torch.randn(3, 5, 8)
    sizes = [2, 0, 4]
    layout = GroupLayout(ends=torch.tensor([2, 2, 6], dtype=torch.int32), sizes=sizes)
    got = grouped_linear(x, weight, layout, backend="gmm")
    want = grouped_linear(x, weight, layout, backend="loop")
    torch.testing.assert_close(got, want)
    assert calls == [((6, 8), torch.int64, "cpu", True)]
    assert torch.equal(got[6], torch.zeros(5))


def test_te_is_refused_naming_what_is_missing(monkeypatch) -> None:
    """experts 'te' (Transformer Engine GroupedLinear) needs TE and CUDA: both named in one message, no fallback."""
    from am_moe import grouped_mm as module

    monkeypatch.setattr(module, "_installed", lambda package: package != "transformer_engine")
    with pytest.raises(ValueError, match="'te' cannot run here") as err:
        select_grouped_mm_backend(device="cpu", dtype=torch.float32, sizes=(16,), requested="te")
    message = str(err.value)
    assert "Transformer Engine is not installed" in message
    assert "only on CUDA" in message
    with pytest.raises(ValueError, match="Transformer Engine"):
        GroupedExperts(4, 16, 16, gated=True, activation="silu", grouped_mm="te")(
            torch.randn(3, 16), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
        )


def test_te_runs_grouped_linear_on_views_of_the_stacked_weight(monkeypatch) -> None:
    """grouped_linear(backend="te") calls a `GroupedLinear(num_gemms, in, out)` built on the meta device with its
    `weight{g}` parameters replaced by views of the ONE stacked weight, forward `(inp, m_splits)` (TE's public
    signature): outputs and the gradients of the rows and of the stacked weight equal the loop's. TE needs CUDA, so a
    stand-in module with TE's signature and parameter names computes the per-group matmuls here."""
    from am_moe import grouped_mm as module

    built = []

    class FakeGroupedLinear(torch.nn.Module):
        def __init__(self, num_gemms, in_features, out_features, *, bias, params_dtype, device) -> None:
            super().__init__()
            built.append((num_gemms, in_features, out_features, bias, params_dtype, device))
            for g in range(num_gemms):
                self.register_parameter(
                    f"weight{g}", torch.nn.Parameter(torch.empty(out_features, in_features, device=device))
                )

        def forward(self, inp, m_splits):
            parts = inp.split(m_splits)
            return torch.cat([p @ getattr(self, f"weight{g}").T for g, p in enumerate(parts)])

    class FakeTE:
        GroupedLinear = FakeGroupedLinear

    module._te_grouped_linear.cache_clear()
    monkeypatch.setattr(module.importlib, "import_module", lambda name: FakeTE)
    try:
        sizes = [2, 0, 4]
        layout = GroupLayout(ends=torch.tensor([2, 2, 6], dtype=torch.int32), sizes=sizes)
        results = []
        for backend in ("te", "loop"):
            x = torch.randn(7, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
            weight = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
            out = grouped_linear(x, weight, layout, backend=backend)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), x.grad, weight.grad))
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want)
        assert built == [(3, 8, 5, False, torch.float32, "meta")]
        assert torch.equal(results[0][0][6], torch.zeros(5))  # the row past the last group
    finally:
        module._te_grouped_linear.cache_clear()
