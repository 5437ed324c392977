"""Materialize a meta-built, already-sharded model rank by rank, with values that do not depend on the layout.

What it is for: a model built on the meta device, then split into pipeline stages, sharded over `ep` and/or wrapped
by FSDP2 (its parameters are DTensors whose `.shape` is the full logical shape), gets real storage for THIS rank's
pieces only, initialized by the model's own init code. The rule that makes every layout equal the single process:

    for each init unit (a module with its own init, e.g. one decoder layer), in any order:
        a full, unsharded twin of the unit is allocated on the CPU in fp32 (from a meta template of the whole model),
        the CPU RNG is seeded with `unit_seed(seed, unit name)` and the unit's own init runs on the twin,
        a module that shards itself into plain tensors (tensor parallelism's "module" style, e.g. Nemotron-H's Mamba2
        mixer) maps the twin's full tensors to its own shard (`tensor_parallel_shard_state`, see below),
        every parameter and buffer of the unit copies the part it holds (`local_index`) out of the twin.

A tensor's values are a function of (seed, unit name) only, never of which rank holds which rows, so dp 1, dp 2,
ep 2, tp 2 and a pipeline stage all hold exactly the single-process values. Peak host memory is one unit in full (the
biggest decoder layer), never the whole model. The single process runs the same function on an unsharded model.

Tensor parallelism is applied on the meta model first, like the other layouts: a DTensor with any `Shard` /
`_StridedShard` / `Replicate` placements on any mesh dims (TP alone, FSDP2 over dp x cp on top of TP, packed
`_StridedShard` rows) copies exactly the indices it holds; a module whose plain-tensor parameters hold its own shard
implements `tensor_parallel_shard_state(full: {name relative to the module: full tensor}) -> {name: this rank's
shard}` (am_tensor_parallel.SHARD_STATE_METHOD, the inverse of its `tensor_parallel_full_state`; pure, no collective),
which this module calls by name (it depends on torch only).
What it must not do: know model names (each model package lists its units and their init), issue a collective, or
leave a tensor on the meta device silently.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "SHARD_STATE_METHOD",
    "InitUnit",
    "fill_self_sharded_",
    "local_index",
    "local_region",
    "materialize_sharded_",
    "read_local",
    "self_sharded_names",
    "unit_seed",
]

# The method of a module that shards itself into plain tensors (am_tensor_parallel.SHARD_STATE_METHOD: the protocol is
# by name, so this package needs no import of am-tensor-parallel; a test checks that both spell it the same).
SHARD_STATE_METHOD = "tensor_parallel_shard_state"


@dataclass(frozen=True)
class InitUnit:
    """A module (qualified `name` in the model; "" for the root) and its own init, run on a full fp32 CPU twin.

    `init(module)` must initialize every parameter and buffer the unit owns directly or through submodules that are
    not units of their own, using the default CPU RNG only (it is seeded per unit)."""

    name: str
    init: Callable[[nn.Module], None]


def unit_seed(seed: int, name: str) -> int:
    """The RNG seed of init unit `name`: stable across processes and Python runs (crc32, not `hash`)."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def local_index(tensor: torch.Tensor) -> tuple[slice | torch.Tensor, ...]:
    """The indices of the full logical tensor this rank holds, one entry per dim: a `slice` where they are
    contiguous, else a 1-D int64 tensor of global indices in local order (`full[index]` dim by dim is the local
    tensor).

    A plain tensor holds all of it. A DTensor holds, per its placements over its mesh dims (left to right, as torch
    computes them): `Shard(d)` a `torch.chunk` of the indices it holds so far on dim d (uneven shards: the last ranks
    may hold fewer or none), `_StridedShard(d, split_factor)` torch's strided pick (FSDP2 over a TP shard of the same
    dim, packed `[gate; up]` rows), `Replicate` all of them.

    Raises:
        ValueError: a placement that holds no block of the full tensor (`Partial`), a rank outside the mesh, or a
            local tensor whose shape is not the computed one (a layout this function does not understand; nothing is
            guessed).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, size) for size in tensor.shape)
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    partial = [p for p in tensor.placements if p.is_partial()]
    if partial:
        raise ValueError(f"a DTensor with placements {tensor.placements} holds partial sums, not a block of the tensor")
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"this rank is not in the mesh of the DTensor of shape {tuple(tensor.shape)}")
    shape = list(tensor.shape)
    held: dict[int, torch.Tensor] = {}  # tensor dim -> global indices held so far
    for mesh_dim, placement in enumerate(tensor.placements):
        if not isinstance(placement, Shard | _StridedShard):
            continue
        dim = placement.dim
        size, offsets = _get_shard_size_and_offsets(
            shape[dim], mesh.size(mesh_dim), coordinate[mesh_dim], placement, held.get(dim), tensor.shape[dim], False
        )
        assert offsets is not None  # computed: skip_offset is False
        shape[dim] = size
        held[dim] = offsets[:size]  # torch gives one placeholder index for an empty shard
    local_shape = tuple(tensor.to_local().shape)
    if tuple(shape) != local_shape:
        raise ValueError(
            f"DTensor of shape {tuple(tensor.shape)} with placements {tensor.placements}: the local tensor is "
            f"{local_shape}, not the {tuple(shape)} torch computes; this layout cannot be materialized or loaded "
            "piecewise"
        )
    index: list[slice | torch.Tensor] = []
    for dim, size in enumerate(tensor.shape):
        rows = held.get(dim)
        if rows is None:
            index.append(slice(0, size))
        elif rows.numel() == 0:
            index.append(slice(0, 0))
        elif torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + rows.numel())):
            index.append(slice(int(rows[0]), int(rows[0]) + rows.numel()))
        else:
            index.append(rows.to(torch.int64))
    return tuple(index)


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(global offset, local shape)` of the one contiguous block of the full logical tensor this rank holds.

    A plain tensor holds all of it. A DTensor (FSDP2, expert parallel, tensor parallel, FSDP2 over TP) holds one block
    when `local_index` finds contiguous indices on every dim; uneven shards follow `torch.chunk`.

    Raises:
        ValueError: what `local_index` raises, or indices that are not one block (packed `_StridedShard` rows: read
            them with `local_index`).
    """
    index = local_index(tensor)
    strided = [dim for dim, entry in enumerate(index) if not isinstance(entry, slice)]
    if strided:
        placements = getattr(tensor, "placements", ())
        raise ValueError(
            f"the tensor of shape {tuple(tensor.shape)} with placements {placements} holds non-contiguous indices on "
            f"dims {strided}, not one block: use local_index"
        )
    offset = tuple(entry.start for entry in index if isinstance(entry, slice))
    shape = tuple(entry.stop - entry.start for entry in index if isinstance(entry, slice))
    return offset, shape


def read_local(
    target: torch.Tensor, read_block: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]
) -> torch.Tensor:
    """This rank's part of `target`'s full value (the local tensor's shape and order), read block by block:
    `read_block(offset, shape)` reads one contiguous block of the full tensor (e.g. a checkpoint's
    `LazyCheckpoint.read_source_block(key, offset, shape)`), once per run of contiguous indices (once for a block;
    twice per packed `_StridedShard` row set: one run per packed part). Nothing outside this rank's indices is read.
    """
    runs: list[list[tuple[int, int]]] = []
    for entry in local_index(target):
        if isinstance(entry, slice):
            runs.append([(entry.start, entry.stop - entry.start)])
            continue
        values = entry.tolist()
        dim_runs: list[tuple[int, int]] = []
        for value in values:
            if dim_runs and dim_runs[-1][0] + dim_runs[-1][1] == value:
                dim_runs[-1] = (dim_runs[-1][0], dim_runs[-1][1] + 1)
            else:
                dim_runs.append((value, 1))
        runs.append(dim_runs)

    def assemble(dim: int, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if dim == len(runs):
            return read_block(offset, shape)
        pieces = [assemble(dim + 1, (*offset, start), (*shape, size)) for start, size in runs[dim]]
        return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]

    return assemble(0, (), ())


def self_sharded_names(model: nn.Module, *, template: nn.Module) -> dict[str, str]:
    """The plain tensors of `model` that hold a shard their own module cut (a module implementing
    `SHARD_STATE_METHOD` whose tensor's shape differs from the unsharded `template`'s), each mapped to that module's
    qualified name. Such a tensor cannot be read as a block of the file's tensor: `fill_self_sharded_` fills it."""
    full = {name: tuple(t.shape) for name, t in _tensors(template).items()}
    found: dict[str, str] = {}
    for prefix, module in model.named_modules():
        if not callable(getattr(module, SHARD_STATE_METHOD, None)):
            continue
        lead = f"{prefix}." if prefix else ""
        for name, tensor in _tensors(module).items():
            qualified = f"{lead}{name}"
            if qualified in full and tuple(tensor.shape) != full[qualified] and qualified not in found:
                found[qualified] = prefix
    return found


@torch.no_grad()
def fill_self_sharded_(model: nn.Module, *, template: nn.Module, read: Callable[[str], torch.Tensor]) -> list[str]:
    """Fill the tensors `self_sharded_names` finds from their unsharded values: module by module, `read(name)`
    gives the model's tensor `name` whole (e.g. from a checkpoint file), the module's `SHARD_STATE_METHOD` cuts this
    rank's shard out of it, which is copied in (cast to the target's dtype; a DTensor over dp x cp on top of the shard
    takes its own block). Peak memory: one module's unsharded tensors (the size of one init unit's). The module's
    shard is generally not one block of the file's tensor (Mamba2: a slice of every packed segment), so its tensors
    are read whole. Returns the names filled. No collective."""
    by_module: dict[str, list[str]] = {}
    for name, prefix in self_sharded_names(model, template=template).items():
        by_module.setdefault(prefix, []).append(name)
    targets = _tensors(model)
    filled = []
    for prefix, names in by_module.items():
        module = model.get_submodule(prefix)
        lead = f"{prefix}." if prefix else ""
        full = {name[len(lead) :]: read(name) for name in names}
        local = getattr(module, SHARD_STATE_METHOD)(full)
        for name in names:
            value = local[name[len(lead) :]]
            if tuple(value.shape) != tuple(targets[name].shape):
                raise ValueError(
                    f"{name}: {type(module).__name__}.{SHARD_STATE_METHOD} gave shape {tuple(value.shape)}, the model "
                    f"holds {tuple(targets[name].shape)}"
                )
            _local(targets[name]).copy_(_block(value, targets[name]))
            filled.append(name)
        del full, local  # one module's full tensors at a time
    return filled


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _block(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The part of `full` (the target's full logical value) that `target` holds on this rank."""
    block = full
    for dim, entry in enumerate(local_index(target)):
        if isinstance(entry, slice):
            block = block.narrow(dim, entry.start, entry.stop - entry.start)
        else:
            block = block.index_select(dim, entry)
    return block


def _self_sharded(module: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full` (a unit's full tensors, names relative to `module`, the unit as the model holds it) with the tensors of
    every submodule that shards itself into plain tensors replaced by that module's shard (its
    `tensor_parallel_shard_state`; a module it does not shard returns them unchanged)."""
    out = dict(full)
    for prefix, sub in module.named_modules():
        hook = getattr(sub, SHARD_STATE_METHOD, None)
        if not callable(hook):
            continue
        lead = f"{prefix}." if prefix else ""
        mine = {name[len(lead) :]: tensor for name, tensor in out.items() if name.startswith(lead)}
        out.update({f"{lead}{name}": tensor for name, tensor in hook(mine).items()})
    return out


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **{n: p for n, p in module.named_parameters(remove_duplicate=False)},
        **{n: b for n, b in module.named_buffers(remove_duplicate=False)},
    }


@torch.no_grad()
def materialize_sharded_(
    model: nn.Module,
    *,
    template: nn.Module,
    units: Sequence[InitUnit],
    seed: int,
    device: torch.device | str,
) -> nn.Module:
    """Give every meta tensor of `model` storage on `device` (this rank's block only) and its seeded initial value.

    model: built on the meta device, then split / sharded in any way that keeps qualified names (pipeline stages
        drop modules; EP, TP and FSDP2 turn parameters into DTensors with the full logical shape; a module that
        shards itself holds plain tensors of its shard's shape and implements `SHARD_STATE_METHOD`). Every tensor
        must still be on the meta device (`model.to_empty` allocates them all, as FSDP2 expects): no rank ever
        allocates more than its own blocks and one unit's twin.
    template: the whole unsharded model on the meta device (same constructor options); each unit's twin is
        `template.get_submodule(unit.name)` allocated on the CPU in fp32.
    units: the model's init units (see `InitUnit`); every meta tensor of `model` must belong to one of them.
        Units absent from `model` (another pipeline stage's layers) are skipped.
    seed: the run's seed; unit u is initialized under `unit_seed(seed, u.name)`.

    Returns `model`. The global RNG state is restored afterwards. A tied tensor is initialized once, by the first unit
    that owns it; `to_empty` unties parameters, so re-tie them afterwards (the model packages' wrappers do). Local
    values keep the model's dtypes (sampled in fp32, then cast once, as `yield_fp32_model` does).

    Raises:
        ValueError: tensors not on the meta device, meta tensors no unit covers, a unit twin lacking a tensor the
            model has, or a tensor whose full value has another shape than the model's (a module that shards itself
            without `SHARD_STATE_METHOD`) (all listed).
    """
    present = {name for name, _ in model.named_modules()}
    covered: set[int] = set()  # by identity: a tied tensor (one object, two names) is initialized once
    problems: list[str] = []
    todo = []
    for unit in units:
        if unit.name not in present:
            continue
        owned = {f"{unit.name}.{n}" if unit.name else n: t for n, t in _tensors(model.get_submodule(unit.name)).items()}
        fresh = {n for n, t in owned.items() if id(t) not in covered}
        covered |= {id(owned[n]) for n in fresh}
        if fresh:
            todo.append((unit, fresh))
    real = sorted(n for n, t in _tensors(model).items() if not t.is_meta)
    if real:
        problems.append(f"tensors already materialized (build the whole model on the meta device): {real[:8]}")
    left = sorted(n for n, t in _tensors(model).items() if t.is_meta and id(t) not in covered)
    if left:
        problems.append(f"meta tensors no init unit covers: {left}")
    if problems:
        raise ValueError(f"materialize_sharded_({type(model).__name__}):\n  - " + "\n  - ".join(problems))
    model.to_empty(device=device)  # every rank allocates its own blocks only (DTensor locals), values follow
    with torch.random.fork_rng(devices=[]):
        for unit, names in todo:
            twin = template.get_submodule(unit.name)
            twin.to_empty(device="cpu")
            twin.float()
            torch.manual_seed(unit_seed(seed, unit.name))
            unit.init(twin)
            full = _self_sharded(model.get_submodule(unit.name), _tensors(twin))
            prefix = f"{unit.name}." if unit.name else ""
            targets = _tensors(model)
            for name in sorted(names):
                source = full.get(name.removeprefix(prefix))
                if source is None:
                    problems.append(f"{name}: the template's unit {unit.name!r} has no such tensor")
                    continue
                if tuple(source.shape) != tuple(targets[name].shape):
                    problems.append(
                        f"{name}: the unit's value has shape {tuple(source.shape)}, the model's tensor "
                        f"{tuple(targets[name].shape)} (a module that shards itself into plain tensors must implement "
                        f"`{SHARD_STATE_METHOD}`)"
                    )
                    continue
                _local(targets[name]).copy_(_block(source, targets[name]))
            twin.to_empty(device="meta")  # free the twin before the next unit: one unit in memory at a time
    if problems:
        raise ValueError(f"materialize_sharded_({type(model).__name__}):\n  - " + "\n  - ".join(problems))
    return model
