"""Sequence layouts for context parallelism: which global tokens each CP rank keeps, and how to undo it.

What it is for: four index maps — identity, load-balanced head-tail, contiguous, packed (THD, head-tail per packed
sequence) — each giving the padded length, the global position of every local token (`local_indices`), an
out-of-place differentiable `shard`, a pure `assemble` (the inverse of sharding every rank) and a collective
`unshard` (all-gather + `assemble`). The ring attention needs nothing else from a layout than `local_indices`.
What it must not do: modify a tensor in place (tensors that need grad — embeddings — must keep their autograd
history), or communicate anywhere except `unshard`.

Head-tail ("load-balanced") for C = 2, padded length 8 (chunks of 2 tokens): rank 0 keeps chunks 0 and 3
(tokens 0 1 6 7), rank 1 keeps chunks 1 and 2 (tokens 2 3 4 5), so both ranks get the same causal work.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = [
    "ContiguousLayout",
    "IdentityLayout",
    "Layout",
    "LoadBalancedLayout",
    "PackedLayout",
    "pad_sequence_dim",
]


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pad_sequence_dim(
    tensor: torch.Tensor, *, seq_dim: int, length: int, pad_value: float | int | bool | Literal["continue"] = 0
) -> torch.Tensor:
    """Right-pad `tensor` along `seq_dim` to `length`, out of place (autograd flows through the kept part).

    `pad_value="continue"` extends integer positions as `last + 1, last + 2, ...` (position ids of padding).
    """
    seq_dim = seq_dim % tensor.dim()
    missing = length - tensor.shape[seq_dim]
    if missing < 0:
        raise ValueError(f"cannot pad a sequence of length {tensor.shape[seq_dim]} down to {length}")
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[seq_dim] = missing
    if pad_value == "continue":
        last = tensor.narrow(seq_dim, tensor.shape[seq_dim] - 1, 1)
        steps_shape = [1] * tensor.dim()
        steps_shape[seq_dim] = missing
        steps = torch.arange(1, missing + 1, device=tensor.device, dtype=tensor.dtype).reshape(steps_shape)
        pad = last + steps
    else:
        pad = torch.full(shape, pad_value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad], dim=seq_dim)


def _head_tail(start: int, end: int, rank: int, cp_size: int) -> torch.Tensor:
    """Positions of `[start, end)` (a multiple of 2C long) that rank `rank` keeps: chunks r and 2C−1−r of 2C."""
    chunk = (end - start) // (2 * cp_size)
    tail = 2 * cp_size - 1 - rank
    return torch.cat(
        [
            torch.arange(start + rank * chunk, start + (rank + 1) * chunk),
            torch.arange(start + tail * chunk, start + (tail + 1) * chunk),
        ]
    )


class _GatherSequence(torch.autograd.Function):
    """All-gather along a new leading dim; backward returns this rank's slice (or the group sum of it)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, world: int, rank: int, sum_grads: bool) -> torch.Tensor:
        parts = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.sum_grads = group, rank, sum_grads
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.sum_grads:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None, None


class Layout(ABC):
    """Which global tokens rank `cp_rank` of `cp_size` keeps. Subclasses define `padded_length` and `indices_for_rank`.

    Every rank keeps the same number of tokens, `padded_length(S) // cp_size`.
    """

    name: str = "layout"

    def __init__(self, *, cp_size: int, cp_rank: int) -> None:
        if cp_size < 1 or not 0 <= cp_rank < cp_size:
            raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size; got cp_size={cp_size}, cp_rank={cp_rank}")
        self.cp_size = cp_size
        self.cp_rank = cp_rank

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp_size={self.cp_size}, cp_rank={self.cp_rank})"

    @abstractmethod
    def padded_length(self, seq_len: int) -> int:
        """The length a sequence of `seq_len` tokens is padded to before sharding."""

    @abstractmethod
    def indices_for_rank(self, rank: int, padded_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions `[padded_len // cp_size]` (int64) of the tokens rank `rank` keeps, in local order."""

    def local_indices(self, padded_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's local tokens (what `ring_attention(positions=...)` takes)."""
        return self.indices_for_rank(self.cp_rank, padded_len, device=device)

    def shard(
        self,
        tensor: torch.Tensor,
        *,
        seq_dim: int,
        pad_value: float | int | bool | Literal["continue"] = 0,
    ) -> torch.Tensor:
        """This rank's tokens of `tensor` (padded to `padded_length` first), out of place and differentiable.

        tensor: any shape with the sequence on `seq_dim`; result: same shape with `padded_len // cp_size` there.
        """
        seq_dim = seq_dim % tensor.dim()
        padded_len = self.padded_length(tensor.shape[seq_dim])
        padded = pad_sequence_dim(tensor, seq_dim=seq_dim, length=padded_len, pad_value=pad_value)
        return padded.index_select(seq_dim, self.local_indices(padded_len, device=tensor.device))

    def assemble(self, parts: Sequence[torch.Tensor], *, seq_dim: int, seq_len: int | None = None) -> torch.Tensor:
        """Inverse of sharding on every rank: the local tensors of ranks 0..C−1 back in global order.

        seq_len trims the padding (default: keep the padded length).
        """
        if len(parts) != self.cp_size:
            raise ValueError(f"{self!r}.assemble needs one part per rank ({self.cp_size}); got {len(parts)}")
        seq_dim = seq_dim % parts[0].dim()
        padded_len = parts[0].shape[seq_dim] * self.cp_size
        order = torch.cat([self.indices_for_rank(r, padded_len, device=parts[0].device) for r in range(self.cp_size)])
        full = torch.cat(list(parts), dim=seq_dim).index_select(seq_dim, torch.argsort(order))
        return full if seq_len is None else full.narrow(seq_dim, 0, seq_len)

    def unshard(
        self,
        local: torch.Tensor,
        *,
        seq_dim: int,
        group: Any,
        seq_len: int | None = None,
        grad: Literal["slice", "sum"] = "slice",
    ) -> torch.Tensor:
        """Gather this rank's `local` tensor from the whole CP group back into global order (differentiable).

        grad: "slice" (default) — the computation after unshard is replicated on every rank (each rank computes the
        same function of the full tensor), so this rank's gradient is its slice of the full gradient; "sum" — ranks
        use the full tensor differently, so the slices are summed over the group.

        Raises:
            ValueError: when the group's size is not this layout's `cp_size`.
        """
        return self.assemble(self._gather(local, group=group, grad=grad), seq_dim=seq_dim, seq_len=seq_len)

    def _gather(self, local: torch.Tensor, *, group: Any, grad: Literal["slice", "sum"]) -> list[torch.Tensor]:
        """Every rank's `local`, in rank order (`unshard`'s all-gather over `group`)."""
        world = dist.get_world_size(group)
        if world != self.cp_size:
            raise ValueError(
                f"{self!r}.unshard got a CP group of {world} ranks, but the layout shards over {self.cp_size}; pass "
                "the CP group the batch was sharded for (device_mesh['cp'].get_group())"
            )
        return list(_GatherSequence.apply(local, group, world, dist.get_rank(group), grad == "sum").unbind(0))


class IdentityLayout(Layout):
    """No sharding: every rank keeps every token (C ≤ 1, or replicated sequences)."""

    name = "identity"

    def __init__(self, *, cp_size: int = 1, cp_rank: int = 0) -> None:
        super().__init__(cp_size=cp_size, cp_rank=cp_rank)

    def padded_length(self, seq_len: int) -> int:
        return seq_len

    def indices_for_rank(self, rank: int, padded_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.arange(padded_len, device=device)

    def shard(
        self, tensor: torch.Tensor, *, seq_dim: int, pad_value: float | int | bool | Literal["continue"] = 0
    ) -> torch.Tensor:
        return tensor

    def assemble(self, parts: Sequence[torch.Tensor], *, seq_dim: int, seq_len: int | None = None) -> torch.Tensor:
        full = parts[0]
        return full if seq_len is None else full.narrow(seq_dim % full.dim(), 0, seq_len)

    def _gather(self, local: torch.Tensor, *, group: Any, grad: Literal["slice", "sum"]) -> list[torch.Tensor]:
        return [local]  # every rank already holds every token: nothing to gather, whatever the group


class LoadBalancedLayout(Layout):
    """Head-tail: pad to a multiple of 2C, cut into 2C chunks; rank r keeps chunks r and 2C−1−r (balanced work)."""

    name = "load_balanced"

    def padded_length(self, seq_len: int) -> int:
        return _ceil_to(seq_len, 2 * self.cp_size)

    def indices_for_rank(self, rank: int, padded_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        return _head_tail(0, padded_len, rank, self.cp_size).to(device=device)


class ContiguousLayout(Layout):
    """Rank r keeps the slice `[r·P/C, (r+1)·P/C)` of the padded length P (a multiple of `pad_multiple`·C).

    The default `pad_multiple=2` pads like the load-balanced layout (a multiple of 2C), as upstream does.
    """

    name = "contiguous"

    def __init__(self, *, cp_size: int, cp_rank: int, pad_multiple: int = 2) -> None:
        super().__init__(cp_size=cp_size, cp_rank=cp_rank)
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1; got {pad_multiple}")
        self.pad_multiple = pad_multiple

    def padded_length(self, seq_len: int) -> int:
        return _ceil_to(seq_len, self.cp_size * self.pad_multiple)

    def indices_for_rank(self, rank: int, padded_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        size = padded_len // self.cp_size
        return torch.arange(rank * size, (rank + 1) * size, device=device)


class PackedLayout(Layout):
    """Packed (THD) sequences: head-tail within each packed sequence's padded extent.

    Sequence i spans `[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`, a length divisible by 2C; it is cut into 2C
    chunks and rank r keeps chunks r and 2C−1−r of it — the partition of Transformer Engine's
    `thd_get_partitioned_indices`, computed in torch. Local tokens are ordered sequence by sequence.
    """

    name = "packed"

    def __init__(self, *, cp_size: int, cp_rank: int, cu_seqlens_padded: torch.Tensor | Sequence[int]) -> None:
        super().__init__(cp_size=cp_size, cp_rank=cp_rank)
        cu = torch.as_tensor(cu_seqlens_padded, dtype=torch.int64).flatten().cpu()
        lengths = cu[1:] - cu[:-1]
        problems = []
        if cu.numel() < 2 or int(cu[0]) != 0:
            problems.append(f"cu_seqlens_padded must start at 0 and hold at least 2 entries; got {cu.tolist()}")
        bad = [(i, int(n)) for i, n in enumerate(lengths) if n < 0 or n % (2 * cp_size) != 0]
        if bad:
            problems.append(
                f"padded sequence lengths must be non-negative multiples of 2·cp_size={2 * cp_size}; "
                f"(index, length) = {bad} — pad each packed sequence to a multiple of 2·cp_size"
            )
        if problems:
            raise ValueError("PackedLayout: " + "; ".join(problems))
        self.cu_seqlens_padded = cu

    def padded_length(self, seq_len: int) -> int:
        total = int(self.cu_seqlens_padded[-1])
        if seq_len != total:
            raise ValueError(
                f"PackedLayout: the packed tensor has {seq_len} tokens but cu_seqlens_padded ends at {total}; "
                "the padded cumulative lengths must cover the whole token dimension"
            )
        return total

    def indices_for_rank(self, rank: int, padded_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        self.padded_length(padded_len)
        bounds = self.cu_seqlens_padded.tolist()
        pieces = [_head_tail(start, end, rank, self.cp_size) for start, end in itertools.pairwise(bounds)]
        return torch.cat(pieces).to(device=device)
