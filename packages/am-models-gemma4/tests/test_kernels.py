"""Block-sparse ring kernel: forward (out, lse) and backward (dq, dk, dv) equal the dense inner kernel."""

from __future__ import annotations

import pytest
import torch

from am_context_parallel import FlashCPUAttentionKernel, TorchAttentionKernel
from am_models_gemma4.kernels import BlockSparseAttentionKernel


def _mask(kind: str, sq: int, sk: int, offset: int) -> torch.Tensor:
    """Masks in global positions: queries at offset..offset+sq, keys at 0..sk (a chunk before or at the queries)."""
    query = torch.arange(offset, offset + sq).view(-1, 1)
    key = torch.arange(sk).view(1, -1)
    allowed = key <= query
    if kind == "sliding":
        allowed &= key > query - 5
    allowed = allowed.expand(2, sq, sk).clone()
    allowed[1, :, : sk // 3] = False  # another document in row 1
    allowed[1, -2:] = False  # padding rows
    return allowed.unsqueeze(1)


@pytest.mark.parametrize("inner", [TorchAttentionKernel(), FlashCPUAttentionKernel()], ids=["torch", "flash_cpu"])
@pytest.mark.parametrize(("kind", "offset"), [("causal", 0), ("sliding", 0), ("sliding", 12)])
def test_block_sparse_equals_dense(inner: object, kind: str, offset: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, 12, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 12, 8, generator=gen) for _ in range(2))
    mask = _mask(kind, 12, 12, offset)
    sparse = BlockSparseAttentionKernel(inner, block=4)  # type: ignore[arg-type]
    out, lse = inner.forward(q, k, v, mask, scale=1.0)  # type: ignore[attr-defined]
    got_out, got_lse = sparse.forward(q, k, v, mask, scale=1.0)
    torch.testing.assert_close(got_out, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse, lse, rtol=1e-6, atol=1e-6)
    delta = (dout * out).sum(-1)
    grads = inner.backward(q, k, v, mask, scale=1.0, out=out, lse=lse, dout=dout, delta=delta)  # type: ignore[attr-defined]
    got = sparse.backward(q, k, v, mask, scale=1.0, out=out, lse=lse, dout=dout, delta=delta)
    for a, b in zip(got, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # flash sums blocks in another order
    # The ring hands the kernel its prepared mask (block ranges computed once): the same results, bit for bit.
    prepared = sparse.prepare_mask(mask)
    assert torch.equal(sparse.forward(q, k, v, prepared, scale=1.0)[0], got_out)
    again = sparse.backward(q, k, v, prepared, scale=1.0, out=out, lse=lse, dout=dout, delta=delta)
    assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))


def test_blocks_skip_keys_outside_the_window() -> None:
    """A sliding neighbour chunk: each 4-query block reaches at most 4 + window - 1 keys, the first block only 4."""
    mask = _mask("sliding", 12, 12, 12)[:1]
    blocks = BlockSparseAttentionKernel(TorchAttentionKernel(), block=4)._blocks(mask)
    assert blocks[0] == (0, 4, 8, 12)
    assert blocks[1][2] is None  # queries 16..19 reach no key below 12 with a window of 5
