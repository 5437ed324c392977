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
      once: the peak sees them all. Under activation checkpointing (`recomputation=True`) it also counts what a
      checkpointed layer holds while its backward runs: the checkpoint keeps each layer's inputs through these same
      hooks (torch's `save_inputs`), but the tensors the layer's recomputation saves for its backward go through
      torch's innermost `_recomputation_hook`, which no outer hook sees. A dispatch mode counts them instead: the
      storages a recomputation creates that are still alive when it ends (what the checkpoint keeps for the layer's
      backward; its temporaries are gone by then), until they are freed.
What it leaves out (the dry run's README says so too): the transient buffers of a kernel (matmul workspaces, the
allocator's fragmentation and caching, the CUDA context), and any tensor a forward keeps without autograd.
What it must not do: change what the step computes (the hooks hand every saved tensor back unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_numel(tensor: torch.Tensor, coords: dict[str, int] | None = None) -> int:
    """Elements of `tensor`'s shard on the rank at mesh `coords` (None: this rank's own local tensor; the dry run
    asks for every rank of a stage: each Shard placement's block, uneven FSDP2 shards included)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor.numel()
    if coords is None:
        return tensor.to_local().numel()
    shape = list(tensor.shape)
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or ()
    own = mesh.get_coordinate() or [0] * mesh.ndim
    for i, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            n = mesh.size(i)
            c = coords.get(names[i], own[i]) if i < len(names) else own[i]
            length = shape[placement.dim]
            full = (length + n - 1) // n
            start = full * c
            shape[placement.dim] = max(0, min(length, start + full) - start)
    return math.prod(shape)


def state_bytes(
    parts: list[nn.Module], optimizers: Iterable[torch.optim.Optimizer], coords: dict[str, int] | None = None
) -> dict[str, int]:
    """{"parameter_bytes", "gradient_bytes", "optimizer_bytes"} of this rank: its parts' parameters (each once: a
    tied weight is one), their `.grad` (call after backward, before `zero_grad`) and the optimizers' state tensors
    (after their first `step`), each tensor by its local shard. `coords` (the dry run): of the rank at these mesh
    coordinates holding the same blocks as this rank, each tensor's shard under its placements (`local_numel`; a
    state tensor shaped like its parameter is sharded like it, others, e.g. AdamW's step count, are whole)."""
    totals = {"parameter_bytes": 0, "gradient_bytes": 0, "optimizer_bytes": 0}
    states = {id(param): state for optimizer in optimizers for param, state in optimizer.state.items()}
    seen: set[int] = set()
    for part in parts:
        for param in part.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            totals["parameter_bytes"] += local_numel(param, coords) * param.element_size()
            if param.grad is not None:
                totals["gradient_bytes"] += local_numel(param.grad, coords) * param.grad.element_size()
            for value in states.get(id(param), {}).values():
                if isinstance(value, torch.Tensor):
                    numel = local_numel(value, coords) if value.shape == param.shape else value.numel()
                    totals["optimizer_bytes"] += numel * value.element_size()
    return totals


def _is_weight_view(tensor: torch.Tensor, storage_key: int, *, depth: int = 8) -> bool:
    """Whether `tensor` is a view of a DTensor weight's local shard: `to_local()` of an expert-parallel weight (then
    unbound per expert and transposed for `F.linear`) is a view of the shard's storage whose `_base` is that plain
    local tensor, not the Parameter, so the `_base` test misses it; its autograd history leads back (through the
    views) to the weight's AccumulateGrad, whose variable holds the same storage. Counted as a parameter, as the
    weight it is (at Nemotron 3 Nano's size, dp 8 x ep 8: 6.8 GiB of expert weights otherwise taken for
    activations)."""
    node = tensor.grad_fn
    for _ in range(depth):
        if node is None:
            return False
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf the chain started from
        if variable is not None:
            return bool(_local(variable).untyped_storage()._cdata == storage_key)
        inputs = [fn for fn, _ in node.next_functions if fn is not None]
        if len(inputs) != 1:  # a view has one tensor input; anything else computed new values
            return False
        node = inputs[0]
    return False


class _Saved:
    """One tensor autograd saved; releases its bytes from the count when autograd drops it (after its backward)."""

    __slots__ = ("key", "owner", "tensor")

    def __init__(self, owner: SavedActivations, tensor: torch.Tensor, key: Any) -> None:
        self.owner, self.tensor, self.key = owner, tensor, key

    def __del__(self) -> None:
        if self.key is not None:
            self.owner._release(self.key)


def _in_recomputation() -> bool:
    """Whether the op running now belongs to an activation checkpoint's recomputation: a backward is running and the
    innermost saved-tensor hook is torch.utils.checkpoint's own (in backward only its recomputation hook is pushed;
    the forward's checkpoint hook is popped when the layer's forward ends)."""
    if torch._C._current_graph_task_id() == -1:
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and bool(getattr(hooks[0], "_checkpoint_internal", False))


class _Recomputed(TorchDispatchMode):
    """The storages activation checkpointing's recomputations create, while they are alive: `held_bytes()` after a
    recomputation has ended is what the checkpoint keeps for that layer's backward (the recomputed saved tensors)."""

    def __init__(self, owner: SavedActivations) -> None:
        super().__init__()
        self.owner = owner
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}  # storage key -> (weak reference, bytes)
        self._recomputing = False

    def held_bytes(self) -> int:
        """Bytes of the storages the latest recomputation created that are still alive."""
        return sum(nbytes for ref, nbytes in self._storages.values() if not ref.expired())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _in_recomputation():
            if not self._recomputing:
                # a new recomputation: the previous one's layer has finished its backward (a layer's tensors are
                # first unpacked after the later layer's backward is done), so what that recomputation kept is
                # freed. Forgotten here rather than by liveness: under FakeTensorMode the storages of freed fake
                # tensors outlive them (the dry run would count every layer's recomputation at once).
                self._storages.clear()
                self._recomputing = True
            # only storages the op created: a view (of a weight, of the layer's input the hooks count, of an earlier
            # recomputed tensor) is not new memory
            leaves = tree_leaves((args, kwargs))
            inputs = {_local(t).untyped_storage()._cdata for t in leaves if isinstance(t, torch.Tensor)}
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    storage = _local(tensor).untyped_storage()
                    key = storage._cdata
                    known = self._storages.get(key)
                    # a freed storage's address may be reused by a new one (the real allocator): a new entry then
                    if key not in inputs and (known is None or known[0].expired()):
                        self._storages[key] = (StorageWeakRef(storage), storage.nbytes())
        elif self._recomputing:  # the first op after a recomputation (its layer's backward): what it left is held
            self._recomputing = False
            self.owner._recomputation_ended(self.held_bytes())
        return out


class SavedActivations:
    """`with SavedActivations() as saved: step()` -> `saved.peak_bytes`: the most bytes autograd held for backward at
    any moment of the step (each storage once, parameters excluded). Works on real and on fake tensors alike.

    `recomputation=True` (a model with activation-checkpointed layers): also the tensors a layer's recomputation
    keeps for its backward, added to what the hooks count at the moment the recomputation ends and the layer's
    backward starts (a dispatch mode over the step; off by default since it sees every op)."""

    def __init__(self, *, recomputation: bool = False) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[Any, list[int]] = {}  # storage key -> [references, bytes]
        self._hooks: Any = None
        self._recomputed = _Recomputed(self) if recomputation else None
        self._weights: set[Any] = set()  # storage keys found to be a weight's (`_is_weight_view`)

    def _recomputation_ended(self, recomputed_bytes: int) -> None:
        """A layer's recomputation has ended, its backward starts: the saved tensors alive now plus those it keeps."""
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + recomputed_bytes)

    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else tensor  # a view of a weight (a transpose) is the weight
        if isinstance(base, nn.Parameter) or (base.requires_grad and base.grad_fn is None and base.is_leaf):
            return _Saved(self, tensor, None)  # a weight (or an unsharded FSDP2 weight): counted as a parameter
        local = _local(tensor)
        storage = local.untyped_storage()
        key = (storage._cdata, local.device.type)  # one entry per storage, however many views autograd saved
        if key in self._weights or _is_weight_view(tensor, storage._cdata):
            self._weights.add(key)
            return _Saved(self, tensor, None)
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
        if self._recomputed is not None:
            self._recomputed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._recomputed is not None:
            self._recomputed.__exit__(*exc)
        self._hooks.__exit__(*exc)


@contextmanager
def measured_step(record: dict[str, int] | None, *, recomputation: bool = False) -> Iterator[SavedActivations | None]:
    """Around one step's forward and backward: counts the saved activations into `record["activation_peak_bytes"]`
    when `record` is a dict (None: nothing is measured, the step runs as always); `recomputation`: the model's layers
    are activation-checkpointed (`SavedActivations`)."""
    if record is None:
        yield None
        return
    with SavedActivations(recomputation=recomputation) as saved:
        yield saved
    record["activation_peak_bytes"] = saved.peak_bytes


__all__ = ["SavedActivations", "local_numel", "measured_step", "state_bytes"]
