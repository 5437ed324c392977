"""Local attention kernels: one query shard against one key/value chunk, returning the log-sum-exp.

What it is for: the per-chunk compute of the ring attention (`ring.py`). A kernel computes the attention of the
local queries against ONE key/value chunk under a boolean mask, in fp32, and returns the output together with the
row log-sum-exp, so that the ring can merge chunks exactly; its backward takes the GLOBAL (merged) output and
log-sum-exp, so that every chunk's gradient is the exact gradient of the full softmax.
What it must not do: communicate, or import a CUDA-only library at import time. `TorchAttentionKernel` is plain
PyTorch, runs on every device, and is the reference the tests check against; faster kernels plug in through the
`AttentionKernel` protocol (`select_kernel` picks one).

Accumulation is fp32 (fp64 for fp64 inputs, so references can be computed exactly); results come back in that dtype.
Shapes: q `[B, Hq, Sq, d]`, k/v `[B, Hkv, Sk, d]` with `Hq % Hkv == 0` (GQA: query head h reads key head
h // (Hq // Hkv), as in HF's `repeat_kv`), mask `[B or 1, 1, Sq, Sk]` (True = may attend), lse `[B, Hq, Sq]`.
A query row whose mask is all False has output 0 and lse −inf (never NaN), in the forward and in the backward.

Optional hook: a kernel may define `prepare_mask(mask) -> object`. The ring then calls it ONCE per chunk and batch
context (at setup, where host synchronisation is allowed) and passes the returned object as `mask` to every
forward/backward on that chunk — e.g. precomputed block ranges, so that the attention calls never wait for the device.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "AttentionKernel",
    "FlashCPUAttentionKernel",
    "TorchAttentionKernel",
    "accumulation_dtype",
    "merge_partial_attention",
    "select_kernel",
]


@runtime_checkable
class AttentionKernel(Protocol):
    """The interface a per-chunk attention kernel implements (all results in fp32)."""

    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q against one chunk -> (out fp32 `[B, Hq, Sq, d]`, lse fp32 `[B, Hq, Sq]`)."""
        ...

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        *,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        delta: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients (fp32) of one chunk given the GLOBAL merged `out`, its `lse` and `delta = rowsum(dout * out)`.

        Returns (dq `[B, Hq, Sq, d]`, dk `[B, Hkv, Sk, d]`, dv `[B, Hkv, Sk, d]`): this chunk's contribution to dq and
        the full gradient of the chunk's keys and values with respect to this shard's queries.
        """
        ...


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs; fp64 inputs keep fp64 (reference computations)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    # [B, Hq, S, d] -> [B, Hkv, G, S, d]: query heads that share a key head sit next to each other (HF repeat_kv).
    b, hq, s, d = q.shape
    return q.reshape(b, num_kv_heads, hq // num_kv_heads, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    # fp32 scores [B, Hkv, G, Sq, Sk] with masked entries at -inf.
    acc = accumulation_dtype(q.dtype)
    qg = _group_queries(q.to(acc), k.shape[1])
    scores = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
    return scores.masked_fill(~mask.unsqueeze(2), float("-inf"))


class TorchAttentionKernel:
    """Plain-PyTorch kernel: materializes the `[Sq, Sk]` scores of one chunk in fp32 (the CPU default)."""

    name = "torch"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, hq, sq, _ = q.shape
        scores = _scores(q, k, mask, scale)
        lse = torch.logsumexp(scores, dim=-1)  # -inf on rows with nothing to attend to
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp(scores - safe_lse.unsqueeze(-1))  # exp(-inf) = 0 on masked entries and empty rows
        out = torch.matmul(probs, v.to(probs.dtype).unsqueeze(2))
        return out.reshape(b, hq, sq, v.shape[-1]), lse.reshape(b, hq, sq)

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        *,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        delta: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        del out  # delta carries what the backward needs of it
        hkv = k.shape[1]
        scores = _scores(q, k, mask, scale)
        lse_g = _group_queries(lse.unsqueeze(-1), hkv)
        safe_lse = torch.where(torch.isinf(lse_g), torch.zeros_like(lse_g), lse_g)
        # Probabilities of the FULL softmax restricted to this chunk: the rows sum to < 1 across a single chunk.
        probs = torch.exp(scores - safe_lse)
        acc = probs.dtype
        dout_g = _group_queries(dout.to(acc), hkv)
        dv = torch.matmul(probs.transpose(-1, -2), dout_g).sum(dim=2)
        dprobs = torch.matmul(dout_g, v.to(acc).unsqueeze(2).transpose(-1, -2))
        dscores = probs * (dprobs - _group_queries(delta.unsqueeze(-1), hkv)) * scale
        dq = torch.matmul(dscores, k.to(acc).unsqueeze(2)).reshape(q.shape)
        dk = torch.matmul(dscores.transpose(-1, -2), _group_queries(q.to(acc), hkv)).sum(dim=2)
        return dq, dk, dv


class FlashCPUAttentionKernel:
    """torch's fused CPU flash-attention op (`aten::_scaled_dot_product_flash_attention_for_cpu`) per chunk.

    Optional and CPU-only: the op and its backward take an additive mask and return / accept the log-sum-exp, so
    the ring's global-lse backward maps onto it directly. It never materializes the `[Sq, Sk]` scores, so it is
    much faster and lighter than `TorchAttentionKernel`, but it is a private aten op (feature-detected with
    `available()`); the plain kernel stays the default and the reference. Inputs are computed in fp32 (fp64 kept);
    GQA repeats K/V heads for the call and sums their gradients back.
    """

    name = "flash_cpu"

    @staticmethod
    def available() -> bool:
        return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
            torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
        )

    @staticmethod
    def _prepare(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = accumulation_dtype(q.dtype)
        group = q.shape[1] // k.shape[1]
        k_full = k.to(acc).repeat_interleave(group, dim=1) if group > 1 else k.to(acc)
        v_full = v.to(acc).repeat_interleave(group, dim=1) if group > 1 else v.to(acc)
        bias = torch.zeros(mask.shape, dtype=acc, device=q.device).masked_fill(~mask, float("-inf"))
        empty_rows = ~mask.any(dim=-1)  # [B or 1, 1, Sq]
        return q.to(acc).contiguous(), k_full.contiguous(), v_full.contiguous(), bias, empty_rows

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qf, kf, vf, bias, empty_rows = self._prepare(q, k, v, mask)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qf, kf, vf, 0.0, False, attn_mask=bias, scale=scale
        )
        # The op reports lse 0 (and output 0) for rows with no visible key; the merge needs -inf there.
        lse = lse.masked_fill(empty_rows.expand_as(lse), float("-inf"))
        return out.masked_fill(empty_rows.unsqueeze(-1).expand_as(out), 0.0), lse

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        *,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        delta: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        del delta  # the op recomputes rowsum(dout * out) from `out`
        qf, kf, vf, bias, _ = self._prepare(q, k, v, mask)
        acc = qf.dtype
        # Rows with nothing to attend to anywhere have lse -inf; any finite value gives them zero probabilities.
        finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(acc).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(acc).contiguous(),
            qf,
            kf,
            vf,
            out.to(acc).contiguous(),
            finite_lse,
            0.0,
            False,
            attn_mask=bias,
            scale=scale,
        )
        # GQA: the gradients of a key/value head's repeats (adjacent query heads) summed back onto it
        dk = dk.unflatten(1, (k.shape[1], -1)).sum(dim=2)
        dv = dv.unflatten(1, (k.shape[1], -1)).sum(dim=2)
        return dq, dk, dv


def merge_partial_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets through their log-sum-exp (fp32, −inf safe).

    out_*: `[B, H, S, d]` fp32, lse_*: `[B, H, S]` fp32. Rows empty in both stay 0 with lse −inf.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    # exp(-inf - finite) = 0, so a side with nothing to attend to contributes nothing; both empty -> 0 * out = 0.
    weight_a = torch.exp(lse_a - safe_lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - safe_lse).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def select_kernel(device: torch.device | str | None = None, *, name: str | None = None) -> AttentionKernel:
    """The kernel for tensors on `device`: `name` "torch" (default, every device) or "flash_cpu" (CPU only).

    No CUDA kernel ships yet: FlexAttention has no CPU backward to test against here, and a CUDA kernel must accept
    the global log-sum-exp in its backward (flash-attn's internal `_flash_attn_backward` does) — pass any object
    implementing `AttentionKernel` as `ring_attention(..., kernel=...)` to use one.

    Raises:
        ValueError: for an unknown name, or "flash_cpu" where it cannot run.
    """
    if name in (None, "torch"):
        return TorchAttentionKernel()
    if name == "flash_cpu":
        on_cpu = device is None or torch.device(device).type == "cpu"
        if not (on_cpu and FlashCPUAttentionKernel.available()):
            raise ValueError(f"kernel 'flash_cpu' needs CPU tensors and torch's CPU flash op; got device {device}")
        return FlashCPUAttentionKernel()
    raise ValueError(f"unknown attention kernel {name!r}; choose 'torch' or 'flash_cpu'")
