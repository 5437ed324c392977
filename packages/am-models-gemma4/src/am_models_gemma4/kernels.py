"""A block-sparse per-chunk kernel for am-context-parallel's ring: compute only the keys a query block can see.

What it is for: the ring computes each (query shard, key chunk) pair with one kernel call over the whole
`[S_local, S_local]` block, even where the mask is mostly empty — the causal diagonal chunk (half empty) and, on
sliding layers, the neighbour's chunk (only its last window-1 keys are visible). `BlockSparseAttentionKernel`
wraps any `AttentionKernel`: it cuts the queries into blocks, finds the key range each block's mask reaches, and
runs the inner kernel on that sub-block only. Results are identical (the skipped entries are masked out), the
work on a sliding layer drops from S_local² to about S_local·(block + window). The block ranges are host values;
the ring calls `prepare_mask` once per chunk and batch context (am-context-parallel's optional kernel hook), so the
attention calls themselves never synchronise with the device to find them.
What it must not do: communicate, or change the ring's contract (out/lse forward; backward from the GLOBAL out and
log-sum-exp — a row's probabilities are exp(score - lse_global), so block-wise backward is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from am_context_parallel import AttentionKernel, FlashCPUAttentionKernel, TorchAttentionKernel
from am_context_parallel.kernels import accumulation_dtype

__all__ = ["BlockSparseAttentionKernel", "default_ring_kernel"]

_Blocks = list[tuple[int, int, int, int] | tuple[int, int, None, None]]


@dataclass(frozen=True)
class BlockSparseMask:
    """A chunk mask `[B or 1, 1, Sq, Sk]` with its per-query-block key ranges (`BlockSparseAttentionKernel._blocks`)."""

    mask: torch.Tensor
    blocks: _Blocks


class BlockSparseAttentionKernel:
    """`inner` applied per block of `block` queries to the key range their mask reaches (same results)."""

    name = "block_sparse"

    def __init__(self, inner: AttentionKernel, *, block: int = 256) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1; got {block}")
        self.inner = inner
        self.block = block

    def prepare_mask(self, mask: torch.Tensor) -> BlockSparseMask:
        """The mask with its block ranges, computed once (one host sync) and reused by every call on the chunk."""
        return BlockSparseMask(mask, self._blocks(mask))

    def _split(self, mask: torch.Tensor | BlockSparseMask) -> tuple[torch.Tensor, _Blocks]:
        if isinstance(mask, BlockSparseMask):
            return mask.mask, mask.blocks
        return mask, self._blocks(mask)

    def _blocks(self, mask: torch.Tensor) -> _Blocks:
        """(q_start, q_end, k_start, k_end) per query block; k_start None when the block sees no key."""
        seen = mask.any(dim=0).any(dim=0)  # [Sq, Sk]
        sq, sk = seen.shape
        blocks = -(-sq // self.block)
        padded = torch.nn.functional.pad(seen, (0, 0, 0, blocks * self.block - sq))
        reached = padded.view(blocks, self.block, sk).any(dim=1)  # [blocks, Sk]: keys any query of the block sees
        any_key = reached.any(dim=1).tolist()
        first = reached.int().argmax(dim=1).tolist()
        last = (sk - reached.flip(1).int().argmax(dim=1)).tolist()
        out: _Blocks = []
        for index in range(blocks):
            start, end = index * self.block, min((index + 1) * self.block, sq)
            out.append((start, end, first[index], last[index]) if any_key[index] else (start, end, None, None))
        return out

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockSparseMask, *, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, hq = q.shape[:2]
        acc = accumulation_dtype(q.dtype)
        mask, blocks = self._split(mask)
        outs, lses = [], []
        for q0, q1, k0, k1 in blocks:
            if k0 is None:
                outs.append(torch.zeros(b, hq, q1 - q0, v.shape[-1], dtype=acc, device=q.device))
                lses.append(torch.full((b, hq, q1 - q0), float("-inf"), dtype=acc, device=q.device))
                continue
            out, lse = self.inner.forward(
                q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], mask[..., q0:q1, k0:k1], scale=scale
            )
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | BlockSparseMask,
        *,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        delta: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        mask, blocks = self._split(mask)
        for q0, q1, k0, k1 in blocks:
            if k0 is None:
                continue
            dq_b, dk_b, dv_b = self.inner.backward(
                q[:, :, q0:q1],
                k[:, :, k0:k1],
                v[:, :, k0:k1],
                mask[..., q0:q1, k0:k1],
                scale=scale,
                out=out[:, :, q0:q1],
                lse=lse[:, :, q0:q1],
                dout=dout[:, :, q0:q1],
                delta=delta[:, :, q0:q1],
            )
            dq[:, :, q0:q1] += dq_b
            dk[:, :, k0:k1] += dk_b
            dv[:, :, k0:k1] += dv_b
        return dq, dk, dv


def default_ring_kernel(device: torch.device | str | None) -> BlockSparseAttentionKernel:
    """Block-sparse around torch's fused CPU flash op on the CPU (when present), else the plain-PyTorch kernel."""
    on_cpu = device is None or torch.device(device).type == "cpu"
    inner: AttentionKernel = (
        FlashCPUAttentionKernel() if on_cpu and FlashCPUAttentionKernel.available() else TorchAttentionKernel()
    )
    return BlockSparseAttentionKernel(inner)
