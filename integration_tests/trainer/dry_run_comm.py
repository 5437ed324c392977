"""What the dry run's fake step sends and computes: bytes per mesh axis from the collectives it really issues, and
FLOPs of the kernels it really calls.

What it is for (issue 23 §3-§4): `CollectiveBytes` is a torch dispatch mode that sees every c10d / functional
collective the fake step issues (FSDP2 all-gathers and reduce-scatters, pipeline send / recv, the experts'
all-to-all, CP ring p2p, TP's DTensor collectives, the loss all-reduce) and adds up the bytes THIS rank sends on each
named mesh axis, by the textbook ring cost of each collective (all-gather of n ranks: (n - 1) x the shard;
reduce-scatter: (n - 1) x the output; all-reduce: 2 (n - 1) / n x the tensor; all-to-all: the rows addressed to the
other ranks; send: the tensor). `EXTRA_FLOPS` adds to `torch.utils.flop_counter.FlopCounterMode` the kernels it does
not count: CPU flash attention (the kernel SDPA picks on the CPU) and `torch._grouped_mm` (am-moe's experts).
What it must not do: change what a collective does (the mode hands every call on unchanged), or guess traffic from a
formula of the model: a collective the step does not issue is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


@dataclass
class AxisTraffic:
    """What one mesh axis carried in the fake step: bytes this rank sent, collective calls, and the largest single
    all-gather output (FSDP2's unsharded unit: the transient buffer a real run needs for it)."""

    sent_bytes: int = 0
    calls: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # bytes sent per collective kind
    largest_gather_bytes: int = 0

    def add(self, kind: str, nbytes: int) -> None:
        self.sent_bytes += nbytes
        self.calls += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + nbytes

    def to_json(self) -> dict[str, Any]:
        return {"sent_bytes": self.sent_bytes, "calls": self.calls, "by_kind": dict(self.kinds)}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group(value: Any) -> Any:
    """The ProcessGroup of a c10d op's argument (a boxed ScriptObject) or a functional op's group name."""
    import torch.distributed as dist

    if isinstance(value, str):
        return dist.distributed_c10d._resolve_process_group(value)  # type: ignore[arg-type]
    return dist.ProcessGroup.unbox(value)


class CollectiveBytes(TorchDispatchMode):
    """`with CollectiveBytes(axis_of_group) as traffic: step()` -> `traffic.axes`: {axis name: AxisTraffic}.

    `axis_of_group` maps a process group's `group_name` to the mesh axis it is (e.g. "pp", "dp_cp" for FSDP2, "ep",
    "expert_dp", "cp", "tp"); a group not in it is counted under "other"."""

    def __init__(self, axis_of_group: dict[str, str]) -> None:
        super().__init__()
        self.axis_of_group = axis_of_group
        self.axes: dict[str, AxisTraffic] = {}

    def _axis(self, group: Any) -> tuple[AxisTraffic, int, int]:
        name = self.axis_of_group.get(group.group_name, "other")
        return self.axes.setdefault(name, AxisTraffic()), group.size(), group.rank()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._count_c10d(func._opname, args)
        elif func.namespace == "_c10d_functional":
            self._count_functional(func._opname, args)
        return func(*args, **kwargs)

    def _count_c10d(self, op: str, args: Any) -> None:
        if op in ("send",):
            traffic, _, _ = self._axis(_group(args[1]))
            traffic.add("p2p", _nbytes(args[0]))
        elif op in ("recv_", "recv_any_source_", "barrier", "monitored_barrier_"):
            return  # received bytes are counted where they are sent; barriers carry nothing
        elif op in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            traffic, n, _ = self._axis(_group(args[2]))
            traffic.add("all_gather", _nbytes(args[1]) * (n - 1))
            traffic.largest_gather_bytes = max(traffic.largest_gather_bytes, _nbytes(args[0]))
        elif op == "allgather_":
            traffic, n, _ = self._axis(_group(args[2]))
            traffic.add("all_gather", _nbytes(args[1]) * (n - 1))
        elif op in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
            traffic, n, _ = self._axis(_group(args[2]))
            traffic.add("reduce_scatter", _nbytes(args[0]) * (n - 1))
        elif op == "reduce_scatter_":
            traffic, n, _ = self._axis(_group(args[2]))
            traffic.add("reduce_scatter", _nbytes(args[1]) * (n - 1) // max(n, 1))
        elif op == "allreduce_":
            traffic, n, _ = self._axis(_group(args[1]))
            traffic.add("all_reduce", 2 * (n - 1) * _nbytes(args[0]) // max(n, 1))
        elif op == "alltoall_base_":
            traffic, n, me = self._axis(_group(args[2]))
            traffic.add("all_to_all", _all_to_all_sent(args[1], list(args[4]), n, me))
        elif op == "broadcast_":
            traffic, n, _ = self._axis(_group(args[1]))
            traffic.add("broadcast", _nbytes(args[0]) * (n - 1) // max(n, 1))

    def _count_functional(self, op: str, args: Any) -> None:
        if op == "all_gather_into_tensor":  # (input, group_size, group_name)
            traffic, n, _ = self._axis(_group(args[2]))
            traffic.add("all_gather", _nbytes(args[0]) * (n - 1))
            traffic.largest_gather_bytes = max(traffic.largest_gather_bytes, _nbytes(args[0]) * n)
        elif op == "reduce_scatter_tensor":  # (input, reduce_op, group_size, group_name)
            traffic, n, _ = self._axis(_group(args[3]))
            traffic.add("reduce_scatter", _nbytes(args[0]) * (n - 1) // max(n, 1))
        elif op in ("all_reduce", "all_reduce_"):  # (input, reduce_op, group_name)
            traffic, n, _ = self._axis(_group(args[2]))
            traffic.add("all_reduce", 2 * (n - 1) * _nbytes(args[0]) // max(n, 1))
        elif op == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group_name)
            traffic, n, me = self._axis(_group(args[3]))
            traffic.add("all_to_all", _all_to_all_sent(args[0], list(args[2] or []), n, me))


def _all_to_all_sent(tensor: torch.Tensor, splits: list[int], n: int, me: int) -> int:
    """Bytes of `tensor`'s rows addressed to the other ranks (even split when no sizes are given)."""
    total = _nbytes(tensor)
    if not splits:
        return total * (n - 1) // max(n, 1)
    rows = sum(int(s) for s in splits)
    per_row = total // rows if rows else 0
    return (rows - int(splits[me])) * per_row


# ------------------------------------------------------------------------------------------------------------------
# FLOPs FlopCounterMode does not count
# ------------------------------------------------------------------------------------------------------------------


def _shape(x: Any) -> tuple[int, ...]:
    """A tensor's shape, or the shape FlopCounterMode already passes in its place."""
    return tuple(x.shape) if hasattr(x, "shape") else tuple(x)


def _cpu_flash_forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(_shape(grad_out), _shape(query), _shape(key), _shape(value))


def _grouped_mm(a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """2 x rows x K x N: every row of `a` meets one group's matrix (forward [M, K] x [E, K, N]; the weight gradient
    [K, M] x [M, N] -> [E, K, N] sums the same products per group; batched [E, M, K] x [E, K, N])."""
    sa, sb = _shape(a), _shape(b)
    if len(sa) == 2 and len(sb) == 3:
        return 2 * sa[0] * sa[1] * sb[2]
    if len(sa) == 2 and len(sb) == 2:
        return 2 * sa[0] * sa[1] * sb[1]
    if len(sa) == 3 and len(sb) == 3:
        return 2 * sa[0] * sa[1] * sa[2] * sb[2]
    return 2 * sa[0] * sa[-1] * sb[-1]


def extra_flop_formulas() -> dict[Any, Any]:
    """`FlopCounterMode(custom_mapping=...)` entries for the kernels it does not know (those this torch has)."""
    mapping: dict[Any, Any] = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_forward),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_backward),
        ("_grouped_mm", _grouped_mm),
    ):
        op = getattr(aten, name, None)
        if op is not None:
            mapping[op] = formula
    return mapping


__all__ = ["AxisTraffic", "CollectiveBytes", "extra_flop_formulas"]
