"""Ring attention over a context-parallel process group, in plain PyTorch point-to-point sends.

What it is for: exact attention of sequence-sharded Q/K/V (`[B, heads, S_local, d]` on each of C ranks), with masks
stated in GLOBAL token positions, so one implementation serves every layout (load-balanced head-tail, contiguous,
packed) — the positions carry the layout. Supports causal and bidirectional attention, sliding windows, packed
documents (`doc_ids`, 0 = padding), GQA, a given softmax scale, and bf16/fp16 inputs with fp32 accumulation.
What it must not do: use torch's experimental `context_parallel` or FlexAttention (neither trains on the CPU), hold
more than one foreign K/V chunk at a time, or hang when ranks disagree on shapes (a small all-gathered header is
checked first and every rank raises the same error).

How K/V move. Every call all-gathers a header, the positions and the doc ids of all ranks (tiny next to K/V). From
the positions each rank derives, identically, a C×C table `needed[r][s]`: can any query of rank r see any key of
rank s (causality and sliding window; documents are checked later, per chunk)? Then round h = 1 … C−1 pairs every
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

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from am_context_parallel.kernels import AttentionKernel, accumulation_dtype, merge_partial_attention, select_kernel

__all__ = ["RingCommStats", "count_ring_bytes", "ring_attention", "ring_plan"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 11, 12, 13, 14
_HEADER_LEN = 11  # valid, B, S_local, Hq, Hkv, d, dtype, causal, sliding_window, positions rows, has doc_ids


@dataclass
class RingCommStats:
    """Bytes this rank sent and chunks it computed, summed over the ring attention calls inside `count_ring_bytes`."""

    forward_kv_bytes: int = 0
    backward_kv_bytes: int = 0
    backward_grad_bytes: int = 0
    metadata_bytes: int = 0
    chunks_computed: int = 0
    chunks_skipped: int = 0
    calls: int = 0

    @property
    def total_bytes(self) -> int:
        return self.forward_kv_bytes + self.backward_kv_bytes + self.backward_grad_bytes + self.metadata_bytes


_active_stats: list[RingCommStats] = []


@contextmanager
def count_ring_bytes() -> Iterator[RingCommStats]:
    """Count what `ring_attention` sends from this rank while the context is open (nesting allowed)."""
    stats = RingCommStats()
    _active_stats.append(stats)
    try:
        yield stats
    finally:
        _active_stats.remove(stats)


def _record(**increments: int) -> None:
    for stats in _active_stats:
        for name, value in increments.items():
            setattr(stats, name, getattr(stats, name) + value)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class _RingSetup:
    """Everything both passes need, identical on all ranks except `rank`."""

    group: Any
    world: int
    rank: int
    causal: bool
    window: int | None
    scale: float
    positions: torch.Tensor  # [C, Bp, S] int64, every rank's global positions
    doc_ids: torch.Tensor | None  # [C, B, S] int64, every rank's doc ids
    needed: list[list[bool]]  # needed[r][s]: a query of rank r can see a key of rank s
    kernel: AttentionKernel


def _reachable(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, window: int | None) -> bool:
    """Whether any query position can see any key position (per batch row) under causality and the window."""
    if not causal and window is None:
        return True
    sorted_keys = torch.sort(k_pos, dim=-1).values
    far = torch.iinfo(torch.int64).max // 4
    low = q_pos - (window - 1) if window is not None else torch.full_like(q_pos, -far)
    if causal:
        high = q_pos
    elif window is not None:
        high = q_pos + (window - 1)
    else:
        high = torch.full_like(q_pos, far)
    count = torch.searchsorted(sorted_keys, high, right=True) - torch.searchsorted(sorted_keys, low, right=False)
    return bool((count > 0).any())


def ring_plan(positions: torch.Tensor, *, causal: bool = True, sliding_window: int | None = None) -> list[list[bool]]:
    """The C×C table `needed[r][s]` from every rank's positions `[C, S_local]` or `[C, Bp, S_local]`.

    `needed[r][s]` is True when some query of rank r may attend to some key of rank s. The benchmark and the
    tests use it to predict the bytes a call sends: rank s sends its K/V once to every r ≠ s with `needed[r][s]`.
    """
    all_pos = positions if positions.dim() == 3 else positions.unsqueeze(1)
    world = all_pos.shape[0]
    return [
        [r == s or _reachable(all_pos[r], all_pos[s], causal=causal, window=sliding_window) for s in range(world)]
        for r in range(world)
    ]


def _chunk_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    *,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """Boolean mask `[B or 1, 1, Sq, Sk]` (True = may attend) from global positions `[Bp, S]` and doc ids `[B, S]`."""
    # Bool comparisons of broadcast [.., Sq, 1] vs [.., 1, Sk] positions: never an int64 [Sq, Sk] difference matrix.
    q_col, k_row = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    allowed = torch.ones(q_col.shape[:-1] + k_row.shape[-1:], dtype=torch.bool, device=q_pos.device)
    if causal:
        allowed &= k_row <= q_col
    if window is not None:
        allowed &= k_row > q_col - window  # q - k < window
        if not causal:
            allowed &= k_row < q_col + window  # k - q < window
    if q_doc is not None and k_doc is not None:
        allowed = allowed & (q_doc.unsqueeze(-1) == k_doc.unsqueeze(-2)) & (q_doc > 0).unsqueeze(-1)
    return allowed.unsqueeze(1)


def _exchange(
    setup: _RingSetup,
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


def _rank_doc(setup: _RingSetup, rank: int) -> torch.Tensor | None:
    return None if setup.doc_ids is None else setup.doc_ids[rank]


def _mask_for(setup: _RingSetup, owner: int) -> torch.Tensor:
    return _chunk_mask(
        setup.positions[setup.rank],
        setup.positions[owner],
        _rank_doc(setup, setup.rank),
        _rank_doc(setup, owner),
        causal=setup.causal,
        window=setup.window,
    )


def _forward(setup: _RingSetup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    b, hq, s, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(b, hq, s, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)

    def accumulate(owner: int, k_chunk: torch.Tensor, v_chunk: torch.Tensor) -> None:
        nonlocal out, lse
        mask = _mask_for(setup, owner)
        if not bool(mask.any()):
            _record(chunks_skipped=1)
            return
        chunk_out, chunk_lse = setup.kernel.forward(q, k_chunk, v_chunk, mask, scale=setup.scale)
        out, lse = merge_partial_attention(out, lse, chunk_out, chunk_lse)
        _record(chunks_computed=1)

    accumulate(setup.rank, k, v)
    for hop in range(1, setup.world):
        dst, src = (setup.rank + hop) % setup.world, (setup.rank - hop) % setup.world
        send = [k, v] if setup.needed[dst][setup.rank] else None
        recv = [k, v] if setup.needed[setup.rank][src] else None
        if send is not None:
            _record(forward_kv_bytes=_nbytes(k, v))
        received = _exchange(setup, hop, send, recv, (_TAG_K, _TAG_V))
        if received is not None:
            accumulate(src, received[0], received[1])
    return out, lse


def _backward(
    setup: _RingSetup,
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
        mask = _mask_for(setup, owner)
        if not bool(mask.any()):
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
            _record(backward_kv_bytes=_nbytes(k, v))
        received = _exchange(setup, hop, [k, v] if send_kv else None, [k, v] if recv_kv else None, (_TAG_K, _TAG_V))
        grads_back = None
        if received is not None:
            grads_back = list(chunk_grads(src, received[0], received[1]))
            _record(backward_grad_bytes=_nbytes(*grads_back))
        # The gradient of the chunk fetched from `src` goes back to src; ours comes from `dst`, which fetched ours.
        returned = _exchange(setup, hop, grads_back, [dk, dv] if send_kv else None, (_TAG_DK, _TAG_DV), reverse=True)
        if returned is not None:
            dk.add_(returned[0])
            dv.add_(returned[1])
    return dq, dk, dv


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: _RingSetup) -> torch.Tensor:
        out, lse = _forward(setup, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = setup
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.setup, q, k, v, out, lse, dout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _input_problems(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    doc_ids: torch.Tensor | None,
    sliding_window: int | None,
) -> list[str]:
    """Every problem with this rank's inputs (empty when they are valid)."""
    problems = []
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        problems.append(
            f"q, k, v must be 4-D [B, heads, S_local, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    else:
        b, hq, s, d = q.shape
        if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
            problems.append(
                f"k {tuple(k.shape)} must be [B={b}, Hkv, S_local={s}, d={d}] and v {tuple(v.shape)} "
                "[B, Hkv, S_local, d_v] like k"
            )
        elif hq % k.shape[1] != 0:
            problems.append(f"query heads {hq} must be a multiple of key/value heads {k.shape[1]} (GQA)")
        if q.dtype not in _DTYPE_CODES or k.dtype != q.dtype or v.dtype != q.dtype:
            problems.append(f"q, k, v must share one float dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        if positions.dtype.is_floating_point or positions.dim() not in (1, 2) or positions.shape[-1] != s:
            problems.append(
                f"positions must be integer [S_local={s}] or [B, S_local]; got {positions.dtype} "
                f"{tuple(positions.shape)}"
            )
        elif positions.dim() == 2 and positions.shape[0] not in (1, b):
            problems.append(f"positions batch dim {positions.shape[0]} must be 1 or B={b}")
        if doc_ids is not None and (doc_ids.dtype.is_floating_point or tuple(doc_ids.shape) != (b, s)):
            problems.append(f"doc_ids must be integer [B={b}, S_local={s}]; got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        problems.append(f"sliding_window must be a positive int or None; got {sliding_window!r}")
    return problems


def _invalid_input_error(problems: list[str]) -> ValueError:
    return ValueError("ring_attention got invalid input:\n  - " + "\n  - ".join(problems))


def _all_gather(tensor: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """`[world, *tensor.shape]`: every rank's tensor, in group-rank order (list form: gloo supports it everywhere)."""
    parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def _gather_metadata(
    group: Any,
    world: int,
    header: torch.Tensor,
    positions: torch.Tensor | None,
    doc_ids: torch.Tensor | None,
    problems: list[str],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All-gather the header (checked first, so every rank fails alike), then every rank's positions and doc ids.

    header[0] is 1 when this rank's inputs are valid: a rank with invalid input still takes part in this first
    collective, so that the others raise with it instead of waiting for it forever.
    """
    headers = _all_gather(header, group, world)
    _record(metadata_bytes=_nbytes(header))
    invalid = [i for i, h in enumerate(headers.tolist()) if h[0] != 1]
    if problems or invalid:
        if problems:
            raise _invalid_input_error([*problems, f"(ranks of the CP group with invalid input: {invalid})"])
        raise ValueError(
            f"ring_attention: rank(s) {invalid} of the CP group got invalid input (their error lists the problems); "
            "every rank stops here so that none waits for them"
        )
    if not bool((headers == headers[0]).all()):
        fields = "valid, B, S_local, Hq, Hkv, d, dtype, causal, sliding_window, positions rows, has doc_ids"
        rows = "\n".join(f"  rank {i}: {h.tolist()}" for i, h in enumerate(headers))
        raise ValueError(
            f"ring_attention: ranks of the CP group disagree on ({fields}); every rank must call it with the same "
            f"shapes and options (shard the batch with one layout for the whole group):\n{rows}"
        )
    assert positions is not None  # valid input on every rank
    all_pos = _all_gather(positions, group, world)
    _record(metadata_bytes=_nbytes(positions))
    all_docs = None
    if doc_ids is not None:
        all_docs = _all_gather(doc_ids, group, world)
        _record(metadata_bytes=_nbytes(doc_ids))
    return all_pos, all_docs


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
    problems = _input_problems(q, k, v, positions, doc_ids, sliding_window)
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    distributed = group is not None
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    if problems:
        if distributed and world > 1:
            # Join the header exchange marked invalid (header[0] = 0): every rank raises instead of hanging.
            invalid = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=q.device)
            _gather_metadata(group, world, invalid, None, None, problems)
        raise _invalid_input_error(problems)

    b, hq, s, d = q.shape
    pos = positions.to(device=q.device, dtype=torch.int64)
    pos = pos.unsqueeze(0) if pos.dim() == 1 else pos
    docs = doc_ids.to(device=q.device, dtype=torch.int64) if doc_ids is not None else None
    if distributed and world > 1:
        header = torch.tensor(
            [
                1,  # valid
                b,
                s,
                hq,
                k.shape[1],
                d,
                _DTYPE_CODES[q.dtype],
                int(causal),
                sliding_window or -1,
                pos.shape[0],
                int(docs is not None),
            ],
            dtype=torch.int64,
            device=q.device,
        )
        all_pos, all_docs = _gather_metadata(group, world, header, pos, docs, [])
    else:
        all_pos, all_docs = pos.unsqueeze(0), None if docs is None else docs.unsqueeze(0)
    setup = _RingSetup(
        group=group,
        world=world,
        rank=rank,
        causal=causal,
        window=sliding_window,
        scale=scale if scale is not None else 1.0 / math.sqrt(d),
        positions=all_pos,
        doc_ids=all_docs,
        needed=ring_plan(all_pos, causal=causal, sliding_window=sliding_window),
        kernel=kernel if kernel is not None else select_kernel(q.device),
    )
    _record(calls=1)
    return _RingAttentionFunction.apply(q, k, v, setup)
