"""Token dispatch and combine for dropless experts: local, or expert parallel over `all_to_all_single`.

What it is for: turning router outputs `(top_k_index [T, K], top_k_weights [T, K])` into rows grouped by (local)
expert, and the experts' rows back into `[T, H]`:
  1. every (token, k) pair gets a key — its expert, or E for a padding token, or E + 1 for an index out of range —
     and the pairs are sorted by key (stable), so padding never reaches an expert;
  2. local: the sorted rows are the groups. Expert parallel (`AllToAllDispatcher`): every rank all-gathers a header
     (its pair count per expert, its out-of-range count and a "my input is malformed" flag), so all ranks raise
     together on bad input before any token moves; each rank then sends the rows of each peer's experts with one
     differentiable `all_to_all_single` (uneven splits, nothing dropped: no capacity factor) and reorders what it
     received from (source rank, expert) to (expert, source rank);
  3. combine undoes 2 and 1 and sums `weight[t, k] * expert_out[t, k]` over k, in fp32 by default.
What it must not do: store per-call state on the module (PP runs several micro-batches through a layer before their
backwards; the state travels in the returned `DispatchState`), drop a token, or let one rank hang on another's bad
input.

`count_all_to_all_bytes()` counts what this rank sends to OTHER ranks (its own rows never leave it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .grouped_mm import GroupLayout
from .routing import RoutingError, out_of_range_message

__all__ = ["AllToAllDispatcher", "AllToAllStats", "DispatchState", "LocalDispatcher", "count_all_to_all_bytes"]


@dataclass
class AllToAllStats:
    """Bytes this rank sent to other ranks, summed over the expert-parallel layers run inside the context."""

    dispatch_bytes: int = 0  # forward: token rows to the experts' owners
    combine_bytes: int = 0  # forward: expert outputs back to the tokens' owners
    backward_bytes: int = 0  # backward of both all-to-alls (gradients of the same rows)
    metadata_bytes: int = 0  # the header all-gather (counts per expert, flags)
    calls: int = 0
    # The largest dispatch receive buffer allocated on this rank (rows routed to its experts by its whole ep group,
    # its own included): rows <= ep x tokens x min(top_k, E / ep), bytes = rows x hidden x element size (README).
    peak_receive_rows: int = 0
    peak_receive_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes + self.backward_bytes + self.metadata_bytes


_active_stats: list[AllToAllStats] = []


@contextmanager
def count_all_to_all_bytes() -> Iterator[AllToAllStats]:
    """Count what the expert-parallel dispatch sends from this rank while the context is open (nesting allowed)."""
    stats = AllToAllStats()
    _active_stats.append(stats)
    try:
        yield stats
    finally:
        _active_stats.remove(stats)


def _record(**increments: int) -> None:
    for stats in _active_stats:
        for name, value in increments.items():
            setattr(stats, name, getattr(stats, name) + value)


def _record_receive(buffer: torch.Tensor) -> None:
    for stats in _active_stats:
        stats.peak_receive_rows = max(stats.peak_receive_rows, buffer.shape[0])
        stats.peak_receive_bytes = max(stats.peak_receive_bytes, buffer.numel() * buffer.element_size())


@dataclass
class DispatchState:
    """What combine needs from dispatch (one per call, never stored on a module).

    counts: `[E]` int64, this rank's (token, k) pairs per GLOBAL expert, padding excluded (load statistics).
    """

    counts: torch.Tensor
    num_tokens: int
    top_k: int
    inverse_order: torch.Tensor  # [T*K]: sorted position of pair t*K + k
    num_sent: int | None  # pairs that went to experts (host), None when not synced (local, device path)
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    inverse_regroup: torch.Tensor | None = None
    group: dist.ProcessGroup | None = None


class Dispatcher(Protocol):
    """What `GroupedExperts` calls: rows grouped by (local) expert out, `[T, H]` back. The state is the
    dispatcher's own per-call object (`DispatchState`, `token_dispatch.TokenState`, ...)."""

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        token_mask: torch.Tensor | None,
        *,
        num_experts: int,
        problems: list[str],
        host_sizes: bool,
        top_k_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, GroupLayout, Any]: ...

    def combine(
        self,
        expert_out: torch.Tensor,
        state: Any,
        top_k_weights: torch.Tensor,
        *,
        out_dtype: torch.dtype,
        combine_dtype: torch.dtype | None,
    ) -> torch.Tensor: ...


def _sort_pairs(
    top_k_index: torch.Tensor, token_mask: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [T*K], inverse_order [T*K], counts [E + 2]) of the pairs sorted by key (expert / E pad / E+1 bad)."""
    flat = top_k_index.reshape(-1).long()
    key = torch.where((flat < 0) | (flat >= num_experts), num_experts + 1, flat)
    if token_mask is not None:
        padding = ~token_mask.repeat_interleave(top_k_index.shape[1])
        key = torch.where(padding, num_experts, key)
    order = torch.argsort(key, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    if _is_fake(key):  # a dry run: no routing values exist
        return order, inverse, balanced_counts(key.numel(), num_experts)
    counts = torch.bincount(key, minlength=num_experts + 2)
    return order, inverse, counts


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(tensor))


def _host_list(counts: torch.Tensor) -> list[int]:
    """`counts.tolist()`; also for the real host tensor of `balanced_counts` inside a dry run's fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if _is_fake(counts):
        return counts.tolist()
    with unset_fake_temporarily():
        return counts.tolist()


def balanced_counts(pairs: int, num_experts: int) -> torch.Tensor:
    """`[E + 2]` int64 pair counts of perfectly balanced routing (the first `pairs % E` experts one more; no padding,
    nothing out of range): what a dry run under fake tensors (no values) assumes, as a real host tensor so that
    split sizes exist. The load a balanced run approaches; a skewed one sends more rows to some ranks."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    base, extra = divmod(pairs, num_experts)
    values = [base + (1 if e < extra else 0) for e in range(num_experts)] + [0, 0]
    with unset_fake_temporarily():
        return torch.tensor(values, dtype=torch.long)


def combine_pairs(
    sorted_out: torch.Tensor,
    state: DispatchState,
    top_k_weights: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    combine_dtype: torch.dtype | None,
) -> torch.Tensor:
    """`[T*K, H]` expert outputs in sorted pair order (padding rows 0) -> `[T, H]`: sum_k weight[t, k] * out[t, k].

    combine_dtype: the dtype of the weighted sum (fp32 keeps bf16 expert outputs from rounding the routing weights);
    None multiplies and sums in the expert outputs' dtype. The result is cast to `out_dtype`.
    """
    pairs = sorted_out[state.inverse_order].view(state.num_tokens, state.top_k, sorted_out.shape[-1])
    dtype = combine_dtype if combine_dtype is not None else pairs.dtype
    weighted = pairs.to(dtype) * top_k_weights.to(dtype).unsqueeze(-1)
    return weighted.sum(dim=1).to(out_dtype)


def _with_padding_rows(sorted_out: torch.Tensor, state: DispatchState) -> torch.Tensor:
    """`[N, H]` rows of the pairs that reached an expert (sorted order) -> `[T*K, H]`, the padding pairs' rows 0."""
    missing = state.num_tokens * state.top_k - sorted_out.shape[0]
    if missing:
        sorted_out = torch.cat([sorted_out, sorted_out.new_zeros(missing, sorted_out.shape[1])])
    return sorted_out


class _PairCombine:
    """The combine of both pair dispatchers: their `undispatch`, then the weighted sum on the tokens' rank."""

    def undispatch(self, expert_out: torch.Tensor, state: DispatchState) -> torch.Tensor:
        raise NotImplementedError

    def combine(
        self,
        expert_out: torch.Tensor,
        state: DispatchState,
        top_k_weights: torch.Tensor,
        *,
        out_dtype: torch.dtype,
        combine_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        """Expert rows `[N, H]` -> `[T, H]`: sum_k weight[t, k] * expert output of pair (t, k) (`combine_pairs`),
        weighted on the tokens' rank."""
        sorted_out = self.undispatch(expert_out, state)
        return combine_pairs(sorted_out, state, top_k_weights, out_dtype=out_dtype, combine_dtype=combine_dtype)


class LocalDispatcher(_PairCombine):
    """All experts live on this rank: the sorted pairs are the groups.

    With host sizes (CPU, or the loop backend, which needs them anyway) the padding rows are cut off exactly and index
    values are checked on the host. Without them (CUDA grouped_mm) nothing syncs: padding rows stay behind the last
    group (zeroed by `GroupLayout.valid_rows`) and out-of-range indices trip an asynchronous device assert.
    """

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        token_mask: torch.Tensor | None,
        *,
        num_experts: int,
        problems: list[str],
        host_sizes: bool,
        top_k_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, GroupLayout, DispatchState]:
        del top_k_weights  # pairs come back unweighted; `combine` weights them on this rank
        if problems:
            raise RoutingError("invalid router outputs for the experts:\n  - " + "\n  - ".join(problems))
        top_k = top_k_index.shape[1]
        order, inverse, counts = _sort_pairs(top_k_index, token_mask, num_experts)
        ends = counts[:num_experts].cumsum(0).to(torch.int32)
        state = DispatchState(counts[:num_experts], hidden_states.shape[0], top_k, inverse, None)
        if host_sizes:
            host = _host_list(counts)
            if host[num_experts + 1]:
                raise RoutingError(out_of_range_message(host[num_experts + 1], num_experts))
            sizes = host[:num_experts]
            state.num_sent = sum(sizes)
            rows = hidden_states[order[: state.num_sent] // top_k]
            return rows, GroupLayout(ends, sizes=sizes), state
        torch._assert_async(counts[num_experts + 1] == 0, "am_moe: routing indices out of range [0, num_experts)")
        rows = hidden_states[order // top_k]
        valid = None
        if token_mask is not None:
            valid = torch.arange(rows.shape[0], device=rows.device) < ends[-1]
        return rows, GroupLayout(ends, valid_rows=valid), state

    def undispatch(self, expert_out: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Expert rows -> `[T*K, H]` in sorted pair order, padding rows 0."""
        return _with_padding_rows(expert_out, state)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        kind: str,
    ) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group  # type: ignore[attr-defined]
        _record(**{kind: _remote_bytes(x, input_splits, group)})
        out = _all_to_all(x, output_splits, input_splits, group)
        if kind == "dispatch_bytes":
            _record_receive(out)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits, group = ctx.input_splits, ctx.output_splits, ctx.group  # type: ignore[attr-defined]
        _record(backward_bytes=_remote_bytes(grad, in_splits, group))
        return _all_to_all(grad, out_splits, in_splits, group), None, None, None, None


def _all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _remote_bytes(x: torch.Tensor, splits: list[int], group: dist.ProcessGroup) -> int:
    me = dist.get_rank(group)
    row = x.element_size()
    for size in x.shape[1:]:
        row *= size
    return sum(n for rank, n in enumerate(splits) if rank != me) * row


def agree_on_input(
    counts: torch.Tensor, problems: list[str], group: dist.ProcessGroup, *, num_experts: int
) -> list[list[int]]:
    """All-gather every rank's header (pairs per expert, out-of-range count, "my input is malformed" flag) over
    `group` and raise `RoutingError` on EVERY rank when any rank's input is bad, before any token moves.

    counts: `[E + 2]` int64 from the pair sort (experts, padding, out of range). Returns the host table
    `[ep][E + 2]` (per rank: its pairs per expert, its out-of-range count, its flag).
    """
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    flag = torch.tensor([1 if problems else 0], dtype=torch.long, device=counts.device)
    header = torch.cat([counts[:num_experts], counts[num_experts + 1 :], flag])  # [E + 2]
    gathered = torch.empty(ep * header.numel(), dtype=header.dtype, device=counts.device)
    dist.all_gather_into_tensor(gathered, header, group=group)
    _record(metadata_bytes=header.numel() * header.element_size() * (ep - 1), calls=1)
    if _is_fake(gathered) and not _is_fake(counts):  # a dry run: every rank routes like this one (balanced_counts)
        host = _host_list(counts)
        table = [[*host[:num_experts], 0, 1 if problems else 0]] * ep
    else:
        table = gathered.view(ep, -1).tolist()
    bad_ranks = [rank for rank, row in enumerate(table) if row[-1] or row[-2]]
    if bad_ranks:
        mine = list(problems)
        if table[me][-2]:
            mine.append(out_of_range_message(table[me][-2], num_experts))
        where = f"expert-parallel rank(s) {bad_ranks} of {ep} got invalid router outputs"
        detail = "; this rank's problems:\n  - " + "\n  - ".join(mine) if mine else " (see their errors)"
        raise RoutingError(where + detail)
    return table


class AllToAllDispatcher(_PairCombine):
    """Experts sharded over the ranks of `group`: rank r owns experts `[r * E / ep, (r + 1) * E / ep)`.

    One all-gather of a small header (counts, flags), then one all-to-all of token rows each way, forward and
    backward. The header's host copy is the only device-to-host sync (all-to-all split sizes must be host ints).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        token_mask: torch.Tensor | None,
        *,
        num_experts: int,
        problems: list[str],
        host_sizes: bool,
        top_k_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, GroupLayout, DispatchState]:
        # host sizes are always known here (the split sizes come to the host anyway); the pairs come back
        # unweighted and `combine` weights them on the tokens' rank
        del host_sizes, top_k_weights
        ep, me = self.ep_size, self.ep_rank
        local = num_experts // ep
        device = hidden_states.device
        if problems:  # malformed shapes: no sort possible; still join the header exchange so peers raise too
            counts = torch.zeros(num_experts + 2, dtype=torch.long, device=device)
            order = inverse = torch.zeros(0, dtype=torch.long, device=device)
        else:
            order, inverse, counts = _sort_pairs(top_k_index, token_mask, num_experts)
        table = agree_on_input(counts, problems, self.group, num_experts=num_experts)

        top_k = top_k_index.shape[1]
        mine_counts = table[me][:num_experts]
        send_splits = [sum(mine_counts[r * local : (r + 1) * local]) for r in range(ep)]
        received = [row[me * local : (me + 1) * local] for row in table]  # [source][local expert]
        recv_splits = [sum(row) for row in received]
        num_sent = sum(send_splits)
        rows = hidden_states[order[:num_sent] // top_k]
        rows = _AllToAll.apply(rows, recv_splits, send_splits, self.group, "dispatch_bytes")
        # Received rows are ordered (source rank, expert); the grouped GEMM needs (expert, source rank).
        sizes = [sum(received[s][e] for s in range(ep)) for e in range(local)]
        inverse_regroup = None
        if ep > 1 and local > 1:
            flat_sizes = torch.tensor([n for row in received for n in row], device=device)
            # block s * local + e (source-major) moves to position e * ep + s (expert-major)
            block_rank = torch.arange(ep * local, device=device).view(ep, local).t().reshape(-1).argsort()
            row_key = torch.repeat_interleave(block_rank, flat_sizes, output_size=sum(recv_splits))
            regroup = torch.argsort(row_key, stable=True)
            inverse_regroup = torch.empty_like(regroup).scatter_(
                0, regroup, torch.arange(regroup.numel(), device=device)
            )
            rows = rows[regroup]
        state = DispatchState(
            counts[:num_experts],
            hidden_states.shape[0],
            top_k,
            inverse,
            num_sent,
            send_splits=send_splits,
            recv_splits=recv_splits,
            inverse_regroup=inverse_regroup,
            group=self.group,
        )
        return rows, GroupLayout.from_sizes(sizes, device=device), state

    def undispatch(self, expert_out: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Expert rows (grouped by local expert) -> `[T*K, H]` on the tokens' rank, in sorted pair order."""
        if state.inverse_regroup is not None:
            expert_out = expert_out[state.inverse_regroup]
        back = _AllToAll.apply(expert_out, state.send_splits, state.recv_splits, self.group, "combine_bytes")
        return _with_padding_rows(back, state)
