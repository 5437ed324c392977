"""Exact context parallelism for the Mamba2 mixer: the sequence stays sharded, states travel between ranks.

What it is for: running the Mamba2 mixer when rank r of a context-parallel (CP) group holds one contiguous block of
every row (tokens [r * S_local, (r + 1) * S_local)). Two things cross rank edges, both independent of S:
  - the causal depthwise conv reads the previous rank's last `d_conv - 1` inputs (`prepend_conv_halo`, one
    point-to-point send to the next rank; zeros on rank 0; masked at document starts through the document ids);
  - the SSM state (`ssd_chunked_scan_cp`): each rank scans its block from a zero state, which gives its final state
    and total log-decay; an exclusive prefix scan over ranks combines those of the lower ranks into the state that
    enters this block, and its contribution C_t · exp(cum_t) · h_in is added to the block's first document.

Why a log-depth point-to-point scan rather than an all-gather. The per-rank pairs combine with an associative
operator, (S_e, l_e) then (S_l, l_l) -> (S_l + exp(l_l) S_e, l_e + l_l), so a Kogge-Stone scan — shift by one rank
(exclusive), then combine with the pair of rank r - d for d = 1, 2, 4, ... < C - 1 — leaves every rank the
combination of all lower ranks after 1 + ceil(log2(C - 1)) rounds. Each rank sends at most one pair per round:
O(log C) bytes and latency, against an all-gather's C - 1 pairs (equal for C <= 4, 4 vs 7 pairs at C = 8; a pair is
B·heads·head_dim·state fp32 values, megabytes for the large models). Every transfer is one differentiable shift
(`_ShiftRanks`: forward sends to r + d, backward returns the gradient to its sender), the same primitive as the conv
halo, so autograd through the scan's ordinary tensor ops is the exact backward, with no reduce-scatter. In every
round every rank either sends or receives, and all ranks issue the same rounds in the same order (forward and, by
construction of the autograd graph, backward), so the point-to-point pattern cannot deadlock.

Packed documents (`seq_idx`, GLOBAL document ids: a document continuing from the previous rank keeps its id, a
document starting at this block's first token has a new one): a document start inside a block zeroes the block's
passage of earlier states (log-decay -inf); the entering state reaches only the tokens of the block's first document
and only if that document began on an earlier rank.

What it must not do: import mamba_ssm (the plain-PyTorch scan runs under CP on every device), round the state math
below fp32, or read the CP group or document ids from anywhere but its arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import NemotronConfig
from .ssd import _compute_dtype, ssd_chunked_scan

__all__ = [
    "Mamba2CPContext",
    "MambaCPCommStats",
    "conv_halo_width",
    "count_mamba_cp_bytes",
    "mamba_cp_bytes_per_layer",
    "prepend_conv_halo",
    "ssd_chunked_scan_cp",
]

# gloo message tags (NCCL ignores them): a transfer's i-th tensor uses base + i; gradients going back add 100.
_TAG_HALO, _TAG_STATE = 41, 45
_BACKWARD_TAG_OFFSET = 100


class Mamba2CPContext:
    """This rank's place in the CP group of the Mamba2 mixers (contiguous layout).

    Contract: rank r of `group` holds tokens [r * S_local, (r + 1) * S_local) of every row, every rank the same
    batch size; `seq_idx`, when given to the mixer, holds global document ids (see the module docstring).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("Mamba2CPContext: this process is not a member of the given CP process group.")
        self.group = group
        self.rank = rank
        self.size = dist.get_world_size(group)

    def __repr__(self) -> str:
        return f"Mamba2CPContext(rank={self.rank}, size={self.size})"


@dataclass
class MambaCPCommStats:
    """Bytes this rank handed to point-to-point sends for Mamba2 CP, while `count_mamba_cp_bytes` is open."""

    forward_halo_bytes: int = 0
    forward_state_bytes: int = 0
    backward_halo_bytes: int = 0
    backward_state_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.forward_halo_bytes + self.forward_state_bytes + self.backward_halo_bytes + self.backward_state_bytes


_active_stats: list[MambaCPCommStats] = []


@contextmanager
def count_mamba_cp_bytes() -> Iterator[MambaCPCommStats]:
    """Count what the Mamba2 CP transfers send from this rank while the context is open (nesting allowed)."""
    stats = MambaCPCommStats()
    _active_stats.append(stats)
    try:
        yield stats
    finally:
        _active_stats.remove(stats)


def _record(field: str, tensors: list[torch.Tensor]) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    for stats in _active_stats:
        setattr(stats, field, getattr(stats, field) + nbytes)


def _shift(tensors: list[torch.Tensor], offset: int, cp: Mamba2CPContext, *, tag: int, field: str) -> list[Any]:
    """Send `tensors` to rank + offset and receive their like from rank - offset (zeros where that rank is missing)."""
    dst, src = cp.rank + offset, cp.rank - offset
    ops = []
    if 0 <= dst < cp.size:
        sent = [t.contiguous() for t in tensors]
        _record(field, sent)
        peer = dist.get_global_rank(cp.group, dst)
        ops += [dist.P2POp(dist.isend, t, peer, cp.group, tag + i) for i, t in enumerate(sent)]
    if 0 <= src < cp.size:
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        peer = dist.get_global_rank(cp.group, src)
        ops += [dist.P2POp(dist.irecv, t, peer, cp.group, tag + i) for i, t in enumerate(received)]
    else:
        received = [torch.zeros_like(t, memory_format=torch.contiguous_format) for t in tensors]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


class _ShiftRanks(torch.autograd.Function):
    """Rank r gets the tensors of rank r - offset (zeros on ranks r < offset); gradients go back to their sender.

    Integer tensors (document ids) travel along and are not differentiable.
    """

    @staticmethod
    def forward(ctx: Any, offset: int, cp: Mamba2CPContext, tag: int, kind: str, *tensors: torch.Tensor) -> Any:
        ctx.offset, ctx.cp, ctx.tag, ctx.kind = offset, cp, tag, kind
        ctx.floating = [t.is_floating_point() for t in tensors]
        received = _shift(list(tensors), offset, cp, tag=tag, field=f"forward_{kind}_bytes")
        ctx.mark_non_differentiable(*(t for t, f in zip(received, ctx.floating, strict=True) if not f))
        return tuple(received)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        floating = [g for g, f in zip(grads, ctx.floating, strict=True) if f]
        returned = iter(
            _shift(
                floating, -ctx.offset, ctx.cp, tag=ctx.tag + _BACKWARD_TAG_OFFSET, field=f"backward_{ctx.kind}_bytes"
            )
        )
        return (None, None, None, None, *(next(returned) if f else None for f in ctx.floating))


def conv_halo_width(conv_kernel: int) -> int:
    """Tokens of the previous rank a block needs: the conv's `conv_kernel - 1`, and at least one (its document id
    tells whether the block's first document continues from the previous rank)."""
    return max(conv_kernel - 1, 1)


def prepend_conv_halo(
    xbc: torch.Tensor, *, width: int, cp: Mamba2CPContext, seq_idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prepend the previous rank's last `width` conv inputs (and their document ids) to this rank's block.

    xbc: [B, S_local, C] (any float dtype); seq_idx: [B, S_local] global document ids, or None.
    Returns ([B, width + S_local, C], [B, width + S_local] int64 or None). Rank 0 gets zero inputs whose id differs
    from its first token's (a document start), so the conv and the scan need no rank-specific branch. The gradient
    of the prepended rows is sent back to the previous rank and added to its block's last rows.
    """
    batch, seqlen, _ = xbc.shape
    if seqlen < width:
        raise ValueError(
            f"Mamba2 context parallelism needs at least {width} tokens per rank (the conv halo), got S_local={seqlen}; "
            "use a longer sequence or a smaller CP size."
        )
    tensors = [xbc[:, seqlen - width :]]
    if seq_idx is not None:
        tensors.append(seq_idx[:, seqlen - width :].to(torch.int64))
    received = _ShiftRanks.apply(1, cp, _TAG_HALO, "halo", *tensors)
    extended = torch.cat([received[0], xbc], dim=1)
    if seq_idx is None:
        return extended, None
    halo_ids = received[1]
    if cp.rank == 0:
        halo_ids = (seq_idx[:, :1].to(torch.int64) - 1).expand(batch, width)
    return extended, torch.cat([halo_ids, seq_idx.to(torch.int64)], dim=1)


def _combine(earlier: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """(S_e, l_e) followed by (S_l, l_l) -> (S_l + exp(l_l) S_e, l_e + l_l); pairs are [..., state | log-decay].

    A log-decay of -inf (a document start) stops earlier states: exp(-inf) = 0, and -inf + x = -inf never forms
    -inf - (-inf), so neither values nor gradients become NaN.
    """
    state = torch.addcmul(later[..., :-1], torch.exp(later[..., -1:]), earlier[..., :-1])
    return torch.cat([state, earlier[..., -1:] + later[..., -1:]], dim=-1)


def _state_rounds(cp_size: int) -> list[int]:
    """Offsets of the scan's shifts: 1 (exclusive: rank r now holds the pair of r - 1, rank 0 the identity), then
    1, 2, 4, ... below C - 1 (a Kogge-Stone scan of the C - 1 real pairs on ranks 1..C-1)."""
    offsets, offset = [1], 1
    while offset < cp_size - 1:
        offsets.append(offset)
        offset *= 2
    return offsets


def _exclusive_scan_across_ranks(pair: torch.Tensor, cp: Mamba2CPContext) -> torch.Tensor:
    """The combination of the pairs of ranks 0..r-1 on rank r (the identity (0, 0) on rank 0). pair: [..., k]."""
    first, *rest = _state_rounds(cp.size)
    (acc,) = _ShiftRanks.apply(first, cp, _TAG_STATE, "state", pair)
    for offset in rest:
        (earlier,) = _ShiftRanks.apply(offset, cp, _TAG_STATE, "state", acc)  # identity (0, 0) where r < offset
        acc = _combine(earlier, acc)
    return acc


@dataclass
class _Block:
    """One block's scan from a zero state and what the cross-rank step needs from it (all in the compute dtype)."""

    y: torch.Tensor  # [b, S, h, p] the block's outputs from a zero entering state
    pair: torch.Tensor  # [b, h, p*n + 1] final state | log of its passage through the block (-inf: a reset)
    continues: torch.Tensor  # [b] bool: the block's first document began on an earlier rank
    cum: torch.Tensor  # [b, S, h] cumulative log-decay from the block start, inclusive
    first_doc: torch.Tensor | None  # [b, S] bool: token belongs to the block's first document (None: all do)
    C: torch.Tensor  # [b, S, g, n]


def _scan_block(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    previous_seq_idx: torch.Tensor | None,
    is_first_block: bool,
) -> _Block:
    batch, _, heads, _ = x.shape
    dtype = _compute_dtype(x)
    y, state = ssd_chunked_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, seq_idx=seq_idx, return_final_state=True)
    cum = (dt.to(dtype) * A.to(dtype)).cumsum(dim=1)
    continues = torch.full((batch,), not is_first_block, dtype=torch.bool, device=x.device)
    first_doc = None
    passes = continues
    if seq_idx is not None:
        if previous_seq_idx is None and not is_first_block:
            raise ValueError("previous_seq_idx is required with seq_idx on every rank but the first.")
        if previous_seq_idx is not None:
            continues = continues & (previous_seq_idx.to(torch.int64) == seq_idx[:, 0].to(torch.int64))
        starts = (seq_idx[:, 1:] != seq_idx[:, :-1]).cumsum(dim=1)
        first_doc = torch.cat([torch.ones_like(seq_idx[:, :1], dtype=torch.bool), starts == 0], dim=1)
        passes = continues & first_doc[:, -1]
    log_passage = cum[:, -1].masked_fill(~passes[:, None], -torch.inf)
    pair = torch.cat([state.reshape(batch, heads, -1), log_passage[..., None]], dim=-1)
    return _Block(y=y, pair=pair, continues=continues, cum=cum, first_doc=first_doc, C=C.to(dtype))


def _add_entering_state(block: _Block, entering: torch.Tensor) -> torch.Tensor:
    """y + mask * exp(cum_t) * C_t · h_in, with h_in = continues * entering state. entering: [b, h, p*n + 1]."""
    batch, seqlen, heads, head_dim = block.y.shape
    groups, state = block.C.shape[-2:]
    per_group = heads // groups
    h_in = entering[..., :-1] * block.continues[:, None, None]  # [b, h, p*n]
    h_in = h_in.view(batch, groups, per_group, head_dim, state).permute(0, 1, 4, 2, 3)  # [b, g, n, r, p]
    from_state = block.C.transpose(1, 2) @ h_in.reshape(batch, groups, state, per_group * head_dim)  # [b,g,S,(r p)]
    from_state = from_state.view(batch, groups, seqlen, per_group, head_dim).transpose(1, 2)  # [b, S, g, r, p]
    scale = torch.exp(block.cum)
    if block.first_doc is not None:
        scale = scale * block.first_doc[..., None]
    return torch.addcmul(block.y, from_state.reshape(batch, seqlen, heads, head_dim), scale[..., None])


def ssd_chunked_scan_cp(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    cp: Mamba2CPContext,
    D: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    previous_seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ssd_chunked_scan` of this rank's contiguous block of a sequence sharded over `cp`, exactly.

    Shapes as in `ssd_chunked_scan` with S = S_local; seq_idx: [B, S_local] global document ids; previous_seq_idx:
    [B] the id of the previous rank's last token (required with seq_idx on ranks > 0; `prepend_conv_halo` returns
    it as column `width - 1`). Returns y [B, S_local, h, p] in fp32 (fp64 for fp64 inputs), equal to the rows of the
    single-process scan of the whole sequence; differentiable (the gradients of other ranks' states come back).
    Collective: every rank of `cp` must call it with the same B and dtypes.
    """
    block = _scan_block(
        x,
        dt,
        A,
        B,
        C,
        chunk_size=chunk_size,
        D=D,
        seq_idx=seq_idx,
        previous_seq_idx=previous_seq_idx,
        is_first_block=cp.rank == 0,
    )
    return _add_entering_state(block, _exclusive_scan_across_ranks(block.pair, cp))


def mamba_cp_bytes_per_layer(
    config: NemotronConfig | Any,
    *,
    batch_size: int,
    cp_rank: int,
    cp_size: int,
    conv_dtype: torch.dtype,
    packed: bool,
    state_dtype: torch.dtype = torch.float32,
) -> MambaCPCommStats:
    """What one Mamba2 layer sends from rank `cp_rank` in one forward and one backward — independent of S.

    Halo: `conv_halo_width` rows of the conv input (conv_dtype; + int64 document ids when packed) to the next rank,
    and their gradient back. States: one [B, heads, head_dim * state + 1] pair (state_dtype: fp32, fp64 for fp64
    models) per scan round in which this rank has a receiver, and its gradient back per round it received in.
    """
    config = NemotronConfig.from_any(config)
    width = conv_halo_width(config.conv_kernel)
    conv_dim = config.mamba_intermediate_size + 2 * config.n_groups * config.ssm_state_size
    halo = batch_size * width * conv_dim * torch.empty((), dtype=conv_dtype).element_size()
    ids = batch_size * width * 8 if packed else 0
    pair = (
        batch_size
        * config.mamba_num_heads
        * (config.mamba_head_dim * config.ssm_state_size + 1)
        * torch.empty((), dtype=state_dtype).element_size()
    )
    rounds = _state_rounds(cp_size)
    has_next = cp_rank + 1 < cp_size
    return MambaCPCommStats(
        forward_halo_bytes=(halo + ids) if has_next else 0,
        forward_state_bytes=pair * sum(cp_rank + offset < cp_size for offset in rounds),
        backward_halo_bytes=halo if cp_rank > 0 else 0,
        backward_state_bytes=pair * sum(cp_rank - offset >= 0 for offset in rounds),
    )
