"""Per-chunk kernels: forward/backward equal autograd of a dense fp64 softmax; chunks merge exactly; empty rows are 0.

Both kernels are checked against the same reference: the plain-PyTorch kernel (default) and the optional fused
CPU flash kernel (skipped where torch lacks the op).
"""

from __future__ import annotations

import pytest
import torch

from am_context_parallel import (
    AttentionKernel,
    FlashCPUAttentionKernel,
    TorchAttentionKernel,
    merge_partial_attention,
    ring_attention,
    select_kernel,
)

# fp32 kernels vs fp64 autograd reference on tiny shapes.
FP32_ATOL = 2e-6

KERNELS = [
    pytest.param(TorchAttentionKernel(), id="torch"),
    pytest.param(
        FlashCPUAttentionKernel(),
        id="flash_cpu",
        marks=pytest.mark.skipif(not FlashCPUAttentionKernel.available(), reason="torch has no CPU flash op"),
    ),
]


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 6, generator=gen) > 0.4
    mask[0, 0, 2] = False  # a row with nothing to attend to
    return q, k, v, mask


@pytest.mark.parametrize("kernel", KERNELS)
def test_forward_backward_match_autograd(kernel: AttentionKernel) -> None:
    q, k, v, mask = _inputs()
    out, lse = kernel.forward(q.float(), k.float(), v.float(), mask, scale=0.3)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    expected = _dense(qr, kr, vr, mask, 0.3)
    dout = torch.randn_like(expected)
    expected.backward(dout)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), expected.detach(), atol=FP32_ATOL)
    assert (out[0, :, 2] == 0).all()
    assert torch.isinf(lse[0, :, 2]).all()
    delta = (dout.float() * out).sum(-1)
    grads = kernel.backward(
        q.float(), k.float(), v.float(), mask, scale=0.3, out=out, lse=lse, dout=dout.float(), delta=delta
    )
    for got, ref in zip(grads, (qr.grad, kr.grad, vr.grad), strict=True):
        assert torch.isfinite(got).all()
        assert torch.allclose(got.double(), ref, atol=FP32_ATOL)


@pytest.mark.parametrize("kernel", KERNELS)
def test_merge_of_two_key_halves_equals_whole(kernel: AttentionKernel) -> None:
    q, k, v, mask = _inputs()
    q, k, v = q.float(), k.float(), v.float()
    whole, whole_lse = kernel.forward(q, k, v, mask, scale=0.3)
    first = kernel.forward(q, k[:, :, :3], v[:, :, :3], mask[..., :3], scale=0.3)
    second = kernel.forward(q, k[:, :, 3:], v[:, :, 3:], mask[..., 3:], scale=0.3)
    merged, merged_lse = merge_partial_attention(*first, *second)
    assert torch.allclose(merged, whole, atol=FP32_ATOL)
    assert torch.equal(torch.isinf(merged_lse), torch.isinf(whole_lse))
    assert not torch.isnan(merged).any()


def test_fp64_inputs_accumulate_in_fp64() -> None:
    q, k, v, mask = _inputs()
    out, _ = TorchAttentionKernel().forward(q, k, v, mask, scale=0.3)
    assert out.dtype == torch.float64
    assert torch.allclose(out, _dense(q, k, v, mask, 0.3), atol=1e-12)


@pytest.mark.skipif(not FlashCPUAttentionKernel.available(), reason="torch has no CPU flash op")
def test_ring_with_flash_kernel_equals_default_kernel() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 12, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    docs = torch.tensor([[1] * 5 + [2] * 6 + [0]])
    results = []
    for kernel in (select_kernel(name="torch"), select_kernel("cpu", name="flash_cpu")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(
            *leaves, group=None, positions=torch.arange(12), doc_ids=docs, sliding_window=4, kernel=kernel
        )
        out.sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, atol=FP32_ATOL)


def test_select_kernel_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown attention kernel 'fast'"):
        select_kernel(name="fast")
    with pytest.raises(ValueError, match="needs CPU tensors"):
        select_kernel("cuda", name="flash_cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: a CUDA kernel backend is not shipped yet")
def test_default_kernel_runs_on_cuda() -> None:
    q = torch.randn(1, 2, 8, 16, device="cuda")
    out = ring_attention(q, q, q, group=None, positions=torch.arange(8, device="cuda"))
    assert out.shape == q.shape
