"""Mesh sizes for capability checks: read ``tp/pp/cp/ep/dp`` sizes from any mesh-like object.

A mesh is either any object with ``tp_size`` / ``pp_size`` / ``cp_size`` / ``ep_size`` (and optionally
``dp_size``) attributes — a missing or ``None`` attribute means 1 — or a ``torch.distributed`` ``DeviceMesh``
whose dimensions carry names. This module never issues a collective and never assumes a 1-D mesh: a
``DeviceMesh`` is read by dimension *name*, and unnamed or unknown dimensions are an error rather than a guess.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["MODEL_AXES", "MeshContext", "read_mesh_sizes"]

# The axes a model must explicitly support; data parallelism needs nothing from the model.
MODEL_AXES: tuple[str, ...] = ("tp", "pp", "cp", "ep")
_ALL_AXES: tuple[str, ...] = (*MODEL_AXES, "dp")

# DeviceMesh dimension names understood without aliases. HSDP meshes split dp into replicate/shard dims;
# their product is the data-parallel size.
_DEFAULT_DIM_AXES: dict[str, str] = {**{axis: axis for axis in _ALL_AXES}, "dp_replicate": "dp", "dp_shard": "dp"}


@dataclass(frozen=True)
class MeshContext:
    """Parallel sizes of a training mesh, one positive ``int`` per axis (1 = axis unused).

    Args:
        tp_size: tensor-parallel degree.
        pp_size: pipeline-parallel degree.
        cp_size: context-parallel degree.
        ep_size: expert-parallel degree.
        dp_size: data-parallel degree (replicate × shard); never restricted by a model.

    Raises:
        ValueError: listing every field that is not an integer >= 1.
    """

    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        problems = []
        for field in fields(self):
            value = getattr(self, field.name)
            size, problem = _check_size(field.name, value)
            if problem is not None:
                problems.append(problem)
            elif size is not None and type(value) is not int:
                # Normalise numpy / torch integer scalars to plain ints so the context hashes and pickles simply.
                object.__setattr__(self, field.name, size)
        if problems:
            raise ValueError("Invalid MeshContext:\n  - " + "\n  - ".join(problems))

    @property
    def world_size(self) -> int:
        """Number of ranks the mesh spans: the product of all axis sizes."""
        return self.tp_size * self.pp_size * self.cp_size * self.ep_size * self.dp_size

    @classmethod
    def from_device_mesh(cls, mesh: Any, *, aliases: Mapping[str, str] | None = None) -> MeshContext:
        """Read axis sizes from a ``DeviceMesh`` by dimension name.

        Dimension names ``tp``, ``pp``, ``cp``, ``ep``, ``dp``, ``dp_replicate`` and ``dp_shard`` are understood;
        several dims mapping to the same axis multiply. Axes absent from the mesh have size 1.

        Args:
            mesh: a ``torch.distributed.device_mesh.DeviceMesh`` (any number of dimensions) with
                ``mesh_dim_names`` set.
            aliases: extra dimension-name → axis mappings, e.g. ``{"fsdp": "dp", "tensor": "tp"}``.

        Raises:
            ValueError: the mesh has no dimension names, or some names are neither known nor aliased
                (all of them are listed).
        """
        sizes, problems = _read_device_mesh(mesh, aliases=aliases)
        if problems:
            raise ValueError("Cannot read a MeshContext from this DeviceMesh:\n  - " + "\n  - ".join(problems))
        return cls(**{f"{axis}_size": size for axis, size in sizes.items()})

    @classmethod
    def from_mesh(cls, mesh: Any) -> MeshContext:
        """Build from any supported mesh form: a ``MeshContext``, a ``DeviceMesh``, or an object with
        ``<axis>_size`` attributes.

        Raises:
            ValueError: listing every invalid size (or unreadable ``DeviceMesh`` dimension).
        """
        if isinstance(mesh, MeshContext):
            return mesh
        sizes, problems = read_mesh_sizes(mesh)
        if problems:
            raise ValueError("Invalid mesh:\n  - " + "\n  - ".join(problems))
        return cls(**{f"{axis}_size": size for axis, size in sizes.items()})


def read_mesh_sizes(mesh: Any) -> tuple[dict[str, int], list[str]]:
    """Read every axis size of ``mesh`` leniently, collecting problems instead of raising.

    Returns:
        ``(sizes, problems)``: ``sizes`` maps each axis in ``("tp", "pp", "cp", "ep", "dp")`` to a valid int
        (an invalid value is replaced by 1 so the remaining checks can still run); ``problems`` holds one
        message per invalid value, naming the axis, the value, why it is wrong and the fix.
    """
    if _is_device_mesh(mesh):
        return _read_device_mesh(mesh, aliases=None)
    sizes: dict[str, int] = {}
    problems: list[str] = []
    for axis in _ALL_AXES:
        name = f"{axis}_size"
        size, problem = _check_size(name, getattr(mesh, name, None))
        if problem is not None:
            problems.append(problem)
        sizes[axis] = 1 if size is None else size
    return sizes, problems


def _check_size(name: str, value: Any) -> tuple[int | None, str | None]:
    """Return ``(size, None)`` for a valid size (``None`` counts as 1) or ``(None, problem)``."""
    if value is None:
        return 1, None
    fix = f"Fix: set {name}=1 to leave the axis unused, or to the intended positive integer"
    # bool is an int subclass, but tp_size=True is almost certainly a config mistake.
    if isinstance(value, bool):
        return None, f"{name}={value!r}: a bool is not a size. {fix}."
    try:
        size = operator.index(value)
    except TypeError:
        if isinstance(value, float) and value.is_integer():
            fix = f"Fix: write {name}={int(value)} as an int"
        return None, f"{name}={value!r}: a {type(value).__name__} is not a size, sizes must be integers. {fix}."
    if size < 1:
        return None, f"{name}={size}: sizes must be >= 1. {fix}."
    return size, None


def _is_device_mesh(mesh: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch built without distributed support
        return False
    return isinstance(mesh, DeviceMesh)


def _read_device_mesh(mesh: Any, *, aliases: Mapping[str, str] | None) -> tuple[dict[str, int], list[str]]:
    dim_axes = dict(_DEFAULT_DIM_AXES)
    problems: list[str] = []
    for dim_name, axis in (aliases or {}).items():
        if axis not in _ALL_AXES:
            problems.append(f"alias {dim_name!r} -> {axis!r}: unknown axis; use one of {list(_ALL_AXES)}.")
        else:
            dim_axes[dim_name] = axis

    names = mesh.mesh_dim_names
    factors: dict[str, list[int]] = {axis: [] for axis in _ALL_AXES}
    if not names:
        problems.append(
            f"DeviceMesh of shape {tuple(mesh.shape)} has no dimension names, so its axes cannot be identified; "
            "create it with init_device_mesh(..., mesh_dim_names=('pp', 'dp', ...))."
        )
    else:
        unknown = [name for name in names if name not in dim_axes]
        if unknown:
            problems.append(
                f"DeviceMesh dimension names {unknown} are not axes this package knows ({sorted(dim_axes)}); "
                "rename them or pass aliases={'<name>': '<axis>'} to MeshContext.from_device_mesh."
            )
        for index, name in enumerate(names):
            if name in dim_axes:
                factors[dim_axes[name]].append(int(mesh.size(index)))
    sizes = {axis: math.prod(values) for axis, values in factors.items()}
    return sizes, problems
