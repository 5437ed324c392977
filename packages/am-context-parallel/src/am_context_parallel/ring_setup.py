"""Ring setup: what every ring attention call over one sharded batch shares, computed once and cached.

What it is for: before any K/V moves, the ranks of the CP group must agree on
  1. the geometry of the batch: a small header (valid, B, S_local, the first call's heads / dtype / options) is
     all-gathered FIRST, so that ranks that disagree, or a rank whose input is invalid, make every rank raise
     instead of hanging;
  2. every rank's global positions and document ids (all-gathered once);
  3. per (causal, sliding_window) and kernel: the C×C table `needed[r][s]` (can a query of rank r see a key of
     rank s?) and this rank's per-chunk masks, chunks with nothing visible left out.
`RingState` computes 1–2 at the first attention call and 3 at the first call of each (causal, window, kernel), and
caches them: every later call of every layer, forward and backward, issues only the K/V point-to-point transfers —
no collective and no host synchronisation (`.tolist()`, `bool(tensor)`) on the attention path.
Checked once, on the gathered positions (`position_problems`): within every batch row they must be distinct and fill
one contiguous range — the global positions of some layout. Per-rank (local) positions, which would silently give
wrong attention, are refused on every rank.
What it must not do: move K/V or compute attention (ring.py does), or outlive its batch (a new
`RingAttentionContext` builds a new state). Later calls are checked LOCALLY (this rank's shapes against the cached
geometry): the layers must be called in the same order with the same options on every rank, as any SPMD model does.

Memory: the cached masks are boolean `[B or 1, 1, S_local, S_local]`, one per chunk this rank computes, per
distinct (causal, sliding_window) — kernels that define `prepare_mask` may keep a compact form instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .kernels import AttentionKernel
from .ring_stats import nbytes, record

__all__ = ["RingSetup", "RingState", "ring_plan"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_HEADER_FIELDS = "valid, B, S_local, Hq, Hkv, d, dtype, causal, sliding_window, positions rows, has doc_ids"
_HEADER_LEN = len(_HEADER_FIELDS.split(", "))


def _reachable(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, window: int | None) -> bool:
    """Whether any query position can see any key position (per batch row) under causality and the window."""
    if not causal and window is None:
        return True
    sorted_keys = torch.sort(k_pos, dim=-1).values
    far = torch.iinfo(torch.int64).max // 4
    low = q_pos - (window - 1) if window is not None else torch.full_like(q_pos, -far)
    high = q_pos if causal or window is None else q_pos + (window - 1)  # window is set when not causal (above)
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


def input_problems(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    doc_ids: torch.Tensor | None,
    sliding_window: int | None,
) -> list[str]:
    """Every problem with this rank's inputs (empty when they are valid); local, no collective."""
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
    # bool is an int subclass: True would silently mean a window of 1 (each token sees only itself).
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        problems.append(f"sliding_window must be a positive int (a window length) or None; got {sliding_window!r}")
    return problems


def position_problems(all_positions: torch.Tensor) -> list[str]:
    """Problems with the gathered positions `[C, Bp, S_local]` (empty when they are global positions of one layout).

    Within every batch row the positions of all C ranks together must be distinct and fill one contiguous range
    p0 … p0 + C·S_local − 1: every layout (load-balanced, contiguous, packed, identity at C = 1) hands each rank a
    disjoint part of the padded sequence `[0, P)`. Per-rank positions counting from 0 repeat across ranks (and
    cannot fill the range); RoPE position ids of packed documents restart at every document and repeat too.
    """
    world, rows, seq = all_positions.shape
    per_row = all_positions.permute(1, 0, 2).reshape(rows, world * seq)
    ordered = per_row.sort(dim=-1).values
    steps = ordered[:, 1:] - ordered[:, :-1]
    problems = []
    for row in (steps != 1).any(dim=-1).nonzero().flatten().tolist():
        repeats = (steps[row] == 0).nonzero().flatten()
        if repeats.numel():
            value = int(ordered[row, int(repeats[0])])
            holders = (all_positions[:, row] == value).sum(dim=-1)
            ranks = [r for r, count in enumerate(holders.tolist()) if count]
            where = f"by ranks {ranks}" if len(ranks) > 1 else f"{int(holders[ranks[0]])} times by rank {ranks[0]}"
            problems.append(f"row {row}: position {value} is held {where}")
        else:
            low, high = int(ordered[row, 0]), int(ordered[row, -1])
            problems.append(f"row {row}: {world * seq} positions span {low}..{high}, leaving gaps")
    return problems


def _position_error(problems: list[str], world: int, seq: int) -> ValueError:
    return ValueError(
        "ring_attention: the positions are not the GLOBAL positions of one sharded sequence. Within every batch "
        f"row, the positions of the {world} rank(s) together must be distinct and fill one range "
        f"p0 … p0+{world * seq - 1} ({world} ranks x S_local={seq} tokens); per-rank positions counting from 0, or "
        "RoPE position ids that restart at every packed document, break this. Pass the layout's "
        "`local_indices(padded_len)` (what make_cp_batch_and_ctx puts in its context) and give documents as "
        "doc_ids:\n  - " + "\n  - ".join(problems)
    )


def invalid_input_error(problems: list[str]) -> ValueError:
    return ValueError("ring_attention got invalid input:\n  - " + "\n  - ".join(problems))


def _all_gather(tensor: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """`[world, *tensor.shape]`: every rank's tensor, in group-rank order (list form: gloo supports it everywhere)."""
    parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


@dataclass(frozen=True)
class _Geometry:
    """The batch as the whole group sees it; identical on every rank except `rank`."""

    group: Any
    world: int
    rank: int
    batch: int  # B
    seq: int  # S_local
    positions: torch.Tensor  # [C, Bp, S_local] int64, every rank's global positions
    doc_ids: torch.Tensor | None  # [C, B, S_local] int64, every rank's doc ids


@dataclass(frozen=True)
class _Plan:
    """Per (causal, window, kernel): who fetches whom, and this rank's masks of the chunks it computes."""

    kernel: AttentionKernel  # the masks below are in this kernel's prepared form
    needed: list[list[bool]]  # needed[r][s]: a query of rank r can see a key of rank s
    masks: dict[int, Any]  # owner rank -> mask (or the kernel's prepared form); absent: nothing visible, skipped


@dataclass(frozen=True)
class RingSetup:
    """Everything one ring call's forward and backward need (its autograd node keeps it for the backward).

    masks: owner rank -> the mask of this rank's queries against that rank's keys (in the kernel's prepared form);
    an owner is absent when nothing in its chunk is visible (skipped).
    """

    group: Any
    world: int
    rank: int
    needed: list[list[bool]]  # needed[r][s]: a query of rank r can see a key of rank s
    masks: dict[int, Any]
    scale: float
    kernel: AttentionKernel


@dataclass
class RingState:
    """The cached setup of the ring calls over one sharded batch (one per `RingAttentionContext`).

    positions: `[S_local]` or `[B, S_local]` global positions of the local tokens; doc_ids: `[B, S_local]` or None.
    group: the CP process group; None means the default group when torch.distributed is initialized, else one process.
    """

    group: Any
    positions: torch.Tensor
    doc_ids: torch.Tensor | None
    _geometry: _Geometry | None = field(default=None, init=False, repr=False)
    _plans: dict[tuple[bool, int | None, int], _Plan] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.group is None and dist.is_available() and dist.is_initialized():
            self.group = dist.group.WORLD

    def setup(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        sliding_window: int | None,
        scale: float | None,
        kernel: AttentionKernel,
    ) -> RingSetup:
        """The setup of one call: gathers at the first call of this state, plans at the first call of each key.

        Raises:
            ValueError: on invalid input (every rank raises at the first call; later calls raise on this rank),
                when ranks disagree at the first call, or when a later call's B / S_local differ from the first.
        """
        problems = input_problems(q, k, v, self.positions, self.doc_ids, sliding_window)
        geometry = self._geometry
        if geometry is None:
            geometry = self._geometry = self._gather(
                q, k, causal=causal, sliding_window=sliding_window, problems=problems
            )
        else:
            if not problems and (q.shape[0], q.shape[2]) != (geometry.batch, geometry.seq):
                problems.append(
                    f"q has B={q.shape[0]}, S_local={q.shape[2]} but this batch's ring was set up for "
                    f"B={geometry.batch}, S_local={geometry.seq}; use one RingAttentionContext per batch"
                )
            if problems:
                raise invalid_input_error(problems)
        key = (causal, sliding_window, id(kernel))
        plan = self._plans.get(key)
        if plan is None or plan.kernel is not kernel:
            plan = self._plans[key] = self._plan(causal=causal, window=sliding_window, kernel=kernel)
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return RingSetup(geometry.group, geometry.world, geometry.rank, plan.needed, plan.masks, scale, kernel)

    def _gather(
        self, q: torch.Tensor, k: torch.Tensor, *, causal: bool, sliding_window: int | None, problems: list[str]
    ) -> _Geometry:
        """Header first (so every rank fails alike), then every rank's positions and doc ids."""
        group = self.group
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if problems and world <= 1:
            raise invalid_input_error(problems)
        if problems:
            # Join the header exchange marked invalid (header[0] = 0): every rank raises instead of hanging.
            self._exchange_header(torch.zeros(_HEADER_LEN, dtype=torch.int64, device=q.device), world, problems)
        pos = self.positions.to(device=q.device, dtype=torch.int64)
        pos = pos.unsqueeze(0) if pos.dim() == 1 else pos
        docs = self.doc_ids.to(device=q.device, dtype=torch.int64) if self.doc_ids is not None else None
        if world <= 1:
            all_pos, all_docs = pos.unsqueeze(0), None if docs is None else docs.unsqueeze(0)
        else:
            b, hq, s, d = q.shape
            fields = [1, b, s, hq, k.shape[1], d, _DTYPE_CODES[q.dtype], int(causal), sliding_window or -1]
            fields += [pos.shape[0], int(docs is not None)]
            header = torch.tensor(fields, dtype=torch.int64, device=q.device)
            self._exchange_header(header, world, [])
            all_pos = _all_gather(pos, group, world)
            record(metadata_bytes=nbytes(pos), setup_gathers=1)
            all_docs = None
            if docs is not None:
                all_docs = _all_gather(docs, group, world)
                record(metadata_bytes=nbytes(docs))
        problems = position_problems(all_pos)
        if problems:  # every rank computes the same from the same gathered positions: all raise together
            raise _position_error(problems, world, pos.shape[-1])
        return _Geometry(
            group=group,
            world=world,
            rank=rank,
            batch=q.shape[0],
            seq=q.shape[2],
            positions=all_pos,
            doc_ids=all_docs,
        )

    def _exchange_header(self, header: torch.Tensor, world: int, problems: list[str]) -> None:
        """All-gather the header; raise on every rank when any rank's input is invalid or the ranks disagree.

        header[0] is 1 when this rank's inputs are valid: a rank with invalid input still takes part in this first
        collective, so that the others raise with it instead of waiting for it forever.
        """
        headers = _all_gather(header, self.group, world)
        record(metadata_bytes=nbytes(header))
        invalid = [i for i, h in enumerate(headers.tolist()) if h[0] != 1]
        if problems or invalid:
            if problems:
                raise invalid_input_error([*problems, f"(ranks of the CP group with invalid input: {invalid})"])
            raise ValueError(
                f"ring_attention: rank(s) {invalid} of the CP group got invalid input (their error lists the "
                "problems); every rank stops here so that none waits for them"
            )
        if not bool((headers == headers[0]).all()):
            rows = "\n".join(f"  rank {i}: {h.tolist()}" for i, h in enumerate(headers))
            raise ValueError(
                f"ring_attention: ranks of the CP group disagree on ({_HEADER_FIELDS}); every rank must call it with "
                f"the same shapes and options (shard the batch with one layout for the whole group):\n{rows}"
            )

    def _plan(self, *, causal: bool, window: int | None, kernel: AttentionKernel) -> _Plan:
        """The needed table and this rank's chunk masks (empty chunks left out) for one (causal, window, kernel)."""
        geometry = self._geometry
        assert geometry is not None
        needed = ring_plan(geometry.positions, causal=causal, sliding_window=window)
        rank = geometry.rank
        docs = geometry.doc_ids
        prepare = getattr(kernel, "prepare_mask", None)
        masks: dict[int, Any] = {}
        for owner in range(geometry.world):
            if not needed[rank][owner]:
                continue
            mask = _chunk_mask(
                geometry.positions[rank],
                geometry.positions[owner],
                None if docs is None else docs[rank],
                None if docs is None else docs[owner],
                causal=causal,
                window=window,
            )
            if bool(mask.any()):
                masks[owner] = prepare(mask) if callable(prepare) else mask
        return _Plan(kernel=kernel, needed=needed, masks=masks)
