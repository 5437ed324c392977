"""What one training step holds in memory on this rank, measured the same way by a real run and by the dry run.

What it is for (issue 23 §3): the real trainer records these numbers of its first step into summary.json, and the
dry run (trainer/dry_run.py) records them of its fake step, so the estimate is checked against the measurement by
the very same code:
    - `state_bytes(parts, optimizers)`: the bytes of this rank's parameters, gradients and optimizer state, each
      tensor counted by its LOCAL shard (a DTensor's `to_local()`: FSDP2 / EP / TP shards, not the logical shape) and
      each storage once (tied weights);
    - `SavedActivations`: the peak of the bytes autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`:
      every tensor a forward keeps alive until its backward, counted once per storage while it is alive, parameters
      left out since they are counted above). A pipeline schedule keeps several microbatches' activations alive at
      once: the peak sees them all.
What it leaves out (the dry run's README says so too): the transient buffers of a kernel (matmul workspaces, the
allocator's fragmentation and caching, the CUDA context), and any tensor a forward keeps without autograd.
What it must not do: change what the step computes (the hooks hand every saved tensor back unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors`' local shards: numel x element size, each distinct tensor once (a tied weight is one)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if id(tensor) in seen:  # the tensor itself, alive while iterated (a temporary's id could be reused)
            continue
        seen.add(id(tensor))
        local = _local(tensor)
        total += local.numel() * local.element_size()
    return total


def _optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value


def state_bytes(parts: list[nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """{"parameter_bytes", "gradient_bytes", "optimizer_bytes"} of this rank: its parts' parameters, their `.grad`
    (call after backward, before `zero_grad`) and the optimizers' state tensors (after their first `step`)."""
    params = [p for part in parts for p in part.parameters()]
    return {
        "parameter_bytes": tensor_bytes(params),
        "gradient_bytes": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_bytes": tensor_bytes(_optimizer_tensors(optimizers)),
    }


class _Saved:
    """One tensor autograd saved; releases its bytes from the count when autograd drops it (after its backward)."""

    __slots__ = ("key", "owner", "tensor")

    def __init__(self, owner: SavedActivations, tensor: torch.Tensor, key: Any) -> None:
        self.owner, self.tensor, self.key = owner, tensor, key

    def __del__(self) -> None:
        if self.key is not None:
            self.owner._release(self.key)


class SavedActivations:
    """`with SavedActivations() as saved: step()` -> `saved.peak_bytes`: the most bytes autograd held for backward at
    any moment of the step (each storage once, parameters excluded). Works on real and on fake tensors alike."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[Any, list[int]] = {}  # storage key -> [references, bytes]
        self._hooks: Any = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else tensor  # a view of a weight (a transpose) is the weight
        if isinstance(base, nn.Parameter) or (base.requires_grad and base.grad_fn is None and base.is_leaf):
            return _Saved(self, tensor, None)  # a weight (or an unsharded FSDP2 weight): counted as a parameter
        local = _local(tensor)
        storage = local.untyped_storage()
        key = (storage._cdata, local.device.type)  # one entry per storage, however many views autograd saved
        entry = self._refs.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            self._refs[key] = [1, nbytes]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        return _Saved(self, tensor, key)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: Any) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


@contextmanager
def measured_step(record: dict[str, int] | None) -> Iterator[SavedActivations | None]:
    """Around one step's forward and backward: counts the saved activations into `record["activation_peak_bytes"]`
    when `record` is a dict (None: nothing is measured, the step runs as always)."""
    if record is None:
        yield None
        return
    with SavedActivations() as saved:
        yield saved
    record["activation_peak_bytes"] = saved.peak_bytes


__all__ = ["SavedActivations", "measured_step", "state_bytes", "tensor_bytes"]
