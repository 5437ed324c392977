"""Building blocks for modules that shard themselves (plan style `"module"`): packed projections split by named
segments, and the entry / exit of a TP region on plain tensors.

A packed projection concatenates parts of different sizes along one dim (Mamba2's `in_proj` writes
`[z | x | B | C | dt]`); sharding it by heads gives each rank its `1/tp` slice of EVERY part, which no single DTensor
placement describes (`Shard(0)` takes contiguous rows, `_StridedShard` equal parts). So these helpers keep the
local shard as a plain tensor and say exactly how to cut and re-assemble it: `shard_segments` (rank r's rows),
`gather_segments` (the inverse, collective), `segment_sizes_problems` (what does not divide, for validation).
`region_input` / `region_output` wrap a module's plain-tensor computation on its shard: the input is replicated
(its gradient summed over tp in the backward), the output is the sum of the ranks' partial outputs (all-reduced, or
reduce-scattered into the sequence-sharded stream under sequence parallelism). `SummedLinear` is the row-parallel
projection that ends such a region: an `nn.Linear` subclass put in place of the module's own projection (same name
and parameters), never a rebinding of an instance's `forward`.

Generic: nothing here knows a model; model packages describe their layouts with these pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .styles import _AllReduceBackward, _AllReduceForward

__all__ = [
    "SummedLinear",
    "gather_segments",
    "region_input",
    "region_output",
    "segment_sizes_problems",
    "shard_segments",
]


def segment_sizes_problems(segments: Mapping[str, int], tp: int, *, where: str) -> list[str]:
    """Every named segment whose size tp does not divide: `"<where>: segment 'x' (64) ..."`; [] if none."""
    return [
        f"{where}: segment {name!r} ({size}) cannot be split over tp={tp}; choose a tp that divides it"
        for name, size in segments.items()
        if size % tp
    ]


def shard_segments(
    tensor: torch.Tensor, segments: Mapping[str, int], *, tp: int, rank: int, dim: int = 0
) -> torch.Tensor:
    """Rank `rank`'s shard of a packed tensor: the concatenation of its `1/tp` slice of every segment.

    tensor: `[..., sum(segments), ...]` along `dim` (segments in their packed order) -> `[..., sum(segments)/tp, ...]`.

    Raises:
        ValueError: the sizes do not add up to `tensor.shape[dim]`, or tp does not divide one of them.
    """
    sizes = list(segments.values())
    if sum(sizes) != tensor.shape[dim]:
        raise ValueError(
            f"segments {dict(segments)} add up to {sum(sizes)}, but dim {dim} of the tensor has {tensor.shape[dim]}"
        )
    if problems := segment_sizes_problems(segments, tp, where="shard_segments"):
        raise ValueError("; ".join(problems))
    parts = torch.split(tensor, sizes, dim=dim)
    return torch.cat([part.chunk(tp, dim=dim)[rank] for part in parts], dim=dim).contiguous()


def gather_segments(
    local: torch.Tensor, segments: Mapping[str, int], *, group: Any = None, dim: int = 0
) -> torch.Tensor:
    """The full packed tensor from every rank's `shard_segments` shard (collective over `group`: call on every rank).

    local: `[..., sum(segments)/tp, ...]` -> `[..., sum(segments), ...]`, the inverse of `shard_segments`.
    """
    tp = dist.get_world_size(group)
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.contiguous(), group=group)
    local_sizes = [size // tp for size in segments.values()]
    pieces = [torch.split(shard, local_sizes, dim=dim) for shard in shards]
    return torch.cat([pieces[r][i] for i in range(len(local_sizes)) for r in range(tp)], dim=dim)


def region_input(hidden: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Enter a TP region: the full (replicated) input as a plain tensor, whose gradient is summed over tp.

    hidden: `[B, S, H]` plain and replicated, or a DTensor on `mesh` (`Shard(1)` under sequence parallelism is
    all-gathered; its backward reduce-scatters) -> `[B, S, H]` plain. Each rank computes only its shard's share of
    the input gradient (its heads, its features); the sum over ranks is the whole gradient.
    """
    if isinstance(hidden, DTensor):
        full = hidden.redistribute(device_mesh=hidden.device_mesh, placements=[Replicate()])
        return full.to_local(grad_placements=[Partial()])
    return cast(torch.Tensor, _AllReduceBackward.apply(hidden, mesh.get_group()))


def region_output(partial: torch.Tensor, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> torch.Tensor:
    """Leave a TP region: the sum over tp of each rank's partial output.

    partial: `[B, S, H]` this rank's partial sum -> `[B, S, H]` plain and replicated (all-reduce; identity backward),
    or under sequence parallelism a `Shard(1)` DTensor of this rank's sequence shard (reduce-scatter; all-gather
    backward).
    """
    if sequence_parallel:
        summed = DTensor.from_local(partial, mesh, [Partial()], run_check=False)
        return summed.redistribute(placements=[Shard(1)])
    return cast(torch.Tensor, _AllReduceForward.apply(partial, mesh.get_group()))


class SummedLinear(nn.Linear):
    """A row-parallel `nn.Linear` on plain tensors: its weight `[out, in/tp]` is this rank's input-feature shard, its
    output the sum over tp of the ranks' partial products (`region_output`), its bias (replicated) added once after
    the sum. x: `[B, S, in/tp]` -> `[B, S, out]` (replicated), or a `Shard(1)` DTensor under sequence parallelism.

    Build it with `SummedLinear.take(linear, mesh, sequence_parallel=...)` from the module's own (already sharded)
    Linear and assign it under the same name (`mixer.out_proj = SummedLinear.take(mixer.out_proj, mesh)`): it is that
    module, parameters, hooks and attributes included (the same objects), with this class's forward, so state-dict
    keys, optimizers and hooks see no difference.
    """

    tp_mesh: DeviceMesh
    sequence_parallel: bool

    @classmethod
    def take(cls, linear: nn.Linear, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> SummedLinear:
        """`linear` (an `nn.Linear` holding this rank's input-feature shard) as a `SummedLinear` over `mesh`.

        Raises:
            TypeError: not a torch `nn.Linear`. ValueError: a bias under sequence parallelism (not supported).
        """
        if type(linear) is not nn.Linear:
            raise TypeError(f"SummedLinear.take expects a torch nn.Linear, got {type(linear).__name__}")
        if sequence_parallel and linear.bias is not None:
            raise ValueError("SummedLinear under sequence parallelism takes a Linear without bias (bias=False)")
        summed = cls.__new__(cls)
        summed.__dict__.update(linear.__dict__)  # the same parameters, buffers, hooks and sizes: it is that module
        summed.tp_mesh, summed.sequence_parallel = mesh, sequence_parallel
        return summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        summed = region_output(F.linear(x, self.weight), self.tp_mesh, sequence_parallel=self.sequence_parallel)
        return summed if self.bias is None else summed + self.bias
