"""Ring attention over a context-parallel process group, in plain PyTorch point-to-point sends.

What it is for: exact attention of sequence-sharded Q/K/V (`[B, heads, S_local, d]` on each of C ranks), with masks
stated in GLOBAL token positions, so one implementation serves every layout (load-balanced head-tail, contiguous,
packed) — the positions carry the layout. Supports causal and bidirectional attention, sliding windows, packed
documents (`doc_ids`, 0 = padding), GQA, a given softmax scale, and bf16/fp16 inputs with fp32 accumulation.
What it must not do: use torch's experimental `context_parallel` or FlexAttention (neither trains on the CPU), hold
more than one foreign K/V chunk at a time, or hang when ranks disagree on shapes (a small all-gathered header is
checked first and every rank raises the same error).

How K/V move. The setup (ring_setup.py) all-gathers a header, the positions and the doc ids of all ranks (tiny next
to K/V) ONCE per batch context, and from the positions each rank derives, identically, a C×C table `needed[r][s]`:
can any query of rank r see any key of rank s (causality and sliding window; documents are checked per chunk, once,
when the chunk masks are built)? Then round h = 1 … C−1 pairs every
rank r with its h-th neighbours on the ring: r sends its own K/V to r+h and receives those of r−h (mod C), each
transfer only when the table says the receiver needs it. A round is a permutation — one send and one receive per
rank, posted together with `batch_isend_irecv` — so no ordering can deadlock. Because the table comes from
positions, a sliding-window layer fetches only the ranks that hold keys within the window: on the contiguous layout
the ⌈(window−1)/S_local⌉ ≤ ⌈window/S_local⌉ previous ranks; on the load-balanced layout, where rank r holds chunks
r and 2C−1−r, neighbours on BOTH sides (a one-way relay ring would only reach r+1 after C−1 hops).

Backward (custom autograd Function): only local Q/K/V, the merged fp32 output and the log-sum-exp are saved. Each
round re-fetches the foreign K/V, recomputes the chunk's probabilities from the GLOBAL log-sum-exp, and sends the
chunk's dK/dV (fp32, so the owner sums unrounded partials) back to the rank that owns it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .kernels import AttentionKernel, accumulation_dtype, merge_partial_attention, select_kernel
from .ring_setup import RingSetup, RingState
from .ring_stats import nbytes, record

__all__ = ["attend", "ring_attention"]

_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 11, 12, 13, 14


def _exchange(
    setup: RingSetup,
    hop: int,
    send: list[torch.Tensor] | None,
    recv_like: list[torch.Tensor] | None,
    tags: tuple[int, ...],
    *,
    reverse: bool = False,
) -> list[torch.Tensor] | None:
    """One round: send `send` to rank+hop and receive tensors shaped like `recv_like` from rank−hop.

    With `reverse`, send to rank−hop and receive from rank+hop (gradients going back to their owners). Either side
    may be None when the table says that transfer is not needed; both peers know it, so nothing waits forever.
    """
    step = -hop if reverse else hop
    dst = dist.get_global_rank(setup.group, (setup.rank + step) % setup.world)
    src = dist.get_global_rank(setup.group, (setup.rank - step) % setup.world)
    ops = []
    if send is not None:
        ops += [
            dist.P2POp(dist.isend, t.contiguous(), dst, setup.group, tag) for t, tag in zip(send, tags, strict=True)
        ]
    received = None
    if recv_like is not None:
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in recv_like]
        ops += [dist.P2POp(dist.irecv, t, src, setup.group, tag) for t, tag in zip(received, tags, strict=True)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


def _forward(setup: RingSetup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    b, hq, s, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(b, hq, s, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)

    def accumulate(owner: int, k_chunk: torch.Tensor, v_chunk: torch.Tensor) -> None:
        nonlocal out, lse
        mask = setup.masks.get(owner)
        if mask is None:  # nothing visible in this chunk (known from the setup: no host sync here)
            record(chunks_skipped=1)
            return
        chunk_out, chunk_lse = setup.kernel.forward(q, k_chunk, v_chunk, mask, scale=setup.scale)
        out, lse = merge_partial_attention(out, lse, chunk_out, chunk_lse)
        record(chunks_computed=1)

    accumulate(setup.rank, k, v)
    for hop in range(1, setup.world):
        dst, src = (setup.rank + hop) % setup.world, (setup.rank - hop) % setup.world
        send = [k, v] if setup.needed[dst][setup.rank] else None
        recv = [k, v] if setup.needed[setup.rank][src] else None
        if send is not None:
            record(forward_kv_bytes=nbytes(k, v))
        received = _exchange(setup, hop, send, recv, (_TAG_K, _TAG_V))
        if received is not None:
            accumulate(src, received[0], received[1])
    return out, lse


def _backward(
    setup: RingSetup,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q.dtype)
    dout = dout.to(acc)
    delta = (dout * out).sum(dim=-1)
    dq = torch.zeros_like(q, dtype=acc)
    dk = torch.zeros_like(k, dtype=acc)
    dv = torch.zeros_like(v, dtype=acc)

    def chunk_grads(owner: int, k_chunk: torch.Tensor, v_chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = setup.masks.get(owner)
        if mask is None:
            return torch.zeros_like(k_chunk, dtype=acc), torch.zeros_like(v_chunk, dtype=acc)
        dq_c, dk_c, dv_c = setup.kernel.backward(
            q, k_chunk, v_chunk, mask, scale=setup.scale, out=out, lse=lse, dout=dout, delta=delta
        )
        dq.add_(dq_c)
        return dk_c, dv_c

    dk_own, dv_own = chunk_grads(setup.rank, k, v)
    dk.add_(dk_own)
    dv.add_(dv_own)
    for hop in range(1, setup.world):
        dst, src = (setup.rank + hop) % setup.world, (setup.rank - hop) % setup.world
        send_kv = setup.needed[dst][setup.rank]
        recv_kv = setup.needed[setup.rank][src]
        if send_kv:
            record(backward_kv_bytes=nbytes(k, v))
        received = _exchange(setup, hop, [k, v] if send_kv else None, [k, v] if recv_kv else None, (_TAG_K, _TAG_V))
        grads_back = None
        if received is not None:
            grads_back = list(chunk_grads(src, received[0], received[1]))
            record(backward_grad_bytes=nbytes(*grads_back))
        # The gradient of the chunk fetched from `src` goes back to src; ours comes from `dst`, which fetched ours.
        returned = _exchange(setup, hop, grads_back, [dk, dv] if send_kv else None, (_TAG_DK, _TAG_DV), reverse=True)
        if returned is not None:
            dk.add_(returned[0])
            dv.add_(returned[1])
    return dq, dk, dv


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: RingSetup) -> torch.Tensor:
        out, lse = _forward(setup, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = setup
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.setup, q, k, v, out, lse, dout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def attend(
    state: RingState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sliding_window: int | None,
    scale: float | None,
    kernel: AttentionKernel,
) -> torch.Tensor:
    """One ring attention call with the cached setup of `state` (see `ring_attention` for shapes and rules)."""
    setup = state.setup(q, k, v, causal=causal, sliding_window=sliding_window, scale=scale, kernel=kernel)
    record(calls=1)
    return _RingAttentionFunction.apply(q, k, v, setup)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any,
    positions: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
    kernel: AttentionKernel | None = None,
) -> torch.Tensor:
    """Exact attention of sequence-sharded q/k/v across the CP group; the result has q's shape and dtype.

    q: `[B, Hq, S_local, d]`, k/v: `[B, Hkv, S_local, d]` (GQA when Hkv < Hq), any float dtype (fp32 accumulation).
    positions: `[S_local]` or `[B, S_local]` integer GLOBAL positions of the local tokens (the layout's
    `local_indices`); the causal and sliding-window rules compare these. doc_ids: `[B, S_local]` packed-document ids;
    a query attends only to keys of its own document, and id 0 marks padding (its output is 0).

    This standalone function sets the ring up on every call (header, positions and doc ids all-gathered, plan and
    masks built); inside a `RingAttentionContext`, `ctx.attention(...)` does that once per batch.

    Args:
        group: the CP process group; None means the default group when torch.distributed is initialized, else a
            single process (plain local attention).
        causal: key position ≤ query position.
        sliding_window: a key is visible when `q − k < window` (causal) or `|q − k| < window` (bidirectional).
        scale: softmax scale, default `1/sqrt(d)`.
        kernel: the per-chunk kernel (`AttentionKernel`), default `select_kernel(q.device)`.

    Raises:
        ValueError: on inconsistent shapes (all problems listed), when another rank of the group got invalid
            input, or when ranks of the group disagree on shapes or options (raised on every rank, never a hang).
    """
    return attend(
        RingState(group=group, positions=positions, doc_ids=doc_ids),
        q,
        k,
        v,
        causal=causal,
        sliding_window=sliding_window,
        scale=scale,
        kernel=kernel if kernel is not None else select_kernel(q.device),
    )
