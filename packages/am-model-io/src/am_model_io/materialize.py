"""Materialize a meta-built, already-sharded model rank by rank, with values that do not depend on the layout.

What it is for: a model built on the meta device, then split into pipeline stages, sharded over `ep` and/or wrapped
by FSDP2 (its parameters are DTensors whose `.shape` is the full logical shape), gets real storage for THIS rank's
pieces only, initialized by the model's own init code. The rule that makes every layout equal the single process:

    for each init unit (a module with its own init, e.g. one decoder layer), in any order:
        a full, unsharded twin of the unit is allocated on the CPU in fp32 (from a meta template of the whole model),
        the CPU RNG is seeded with `unit_seed(seed, unit name)` and the unit's own init runs on the twin,
        every parameter and buffer of the unit copies the region it holds (`local_region`) out of the twin.

A tensor's values are a function of (seed, unit name) only, never of which rank holds which rows, so dp 1, dp 2,
ep 2 and a pipeline stage all hold exactly the single-process values. Peak host memory is one unit in full (the
biggest decoder layer), never the whole model. The single process runs the same function on an unsharded model.
What it must not do: know model names (each model package lists its units and their init), issue a collective, or
leave a tensor on the meta device silently.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["InitUnit", "local_region", "materialize_sharded_", "unit_seed"]


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


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(global offset, local shape)` of the block of the full logical tensor this rank holds.

    A plain tensor holds all of it. A DTensor (FSDP2, expert parallel, tensor parallel) holds one contiguous block
    per its `Shard` / `Replicate` placements (FSDP2's strided shards on top of ep included); uneven shards follow
    `torch.chunk` (the last ranks may hold fewer or no rows).

    Raises:
        ValueError: a placement that holds no block of the full tensor (`Partial`), or a local tensor whose shape is
            not the computed block (a layout this function does not understand; nothing is guessed).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    partial = [p for p in tensor.placements if p.is_partial()]
    if partial:
        raise ValueError(f"a DTensor with placements {tensor.placements} holds partial sums, not a block of the tensor")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local_shape = tuple(tensor.to_local().shape)
    if tuple(shape) != local_shape:
        raise ValueError(
            f"DTensor of shape {tuple(tensor.shape)} with placements {tensor.placements}: the local tensor is "
            f"{local_shape}, not the block {tuple(shape)} at {tuple(offset)} torch computes; this layout cannot be "
            "materialized or loaded piecewise"
        )
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _block(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    offset, shape = local_region(target)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return full[index] if index else full


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
        drop modules; EP and FSDP2 turn parameters into DTensors with the full logical shape). Every tensor must
        still be on the meta device (`model.to_empty` allocates them all, as FSDP2 expects).
    template: the whole unsharded model on the meta device (same constructor options); each unit's twin is
        `template.get_submodule(unit.name)` allocated on the CPU in fp32.
    units: the model's init units (see `InitUnit`); every meta tensor of `model` must belong to one of them.
        Units absent from `model` (another pipeline stage's layers) are skipped.
    seed: the run's seed; unit u is initialized under `unit_seed(seed, u.name)`.

    Returns `model`. The global RNG state is restored afterwards. A tied tensor is initialized once, by the first unit
    that owns it; `to_empty` unties parameters, so re-tie them afterwards (the model packages' wrappers do). Local
    values keep the model's dtypes (sampled in fp32, then cast once, as `yield_fp32_model` does).

    Raises:
        ValueError: tensors not on the meta device, meta tensors no unit covers, or a unit twin lacking a tensor the
            model has (all listed).
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
            full = _tensors(twin)
            prefix = f"{unit.name}." if unit.name else ""
            targets = _tensors(model)
            for name in sorted(names):
                source = full.get(name.removeprefix(prefix))
                if source is None:
                    problems.append(f"{name}: the template's unit {unit.name!r} has no such tensor")
                    continue
                _local(targets[name]).copy_(_block(source, targets[name]))
            twin.to_empty(device="meta")  # free the twin before the next unit: one unit in memory at a time
    if problems:
        raise ValueError(f"materialize_sharded_({type(model).__name__}):\n  - " + "\n  - ".join(problems))
    return model
