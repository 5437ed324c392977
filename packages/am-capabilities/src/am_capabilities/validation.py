"""Reject unsupported meshes before any collective runs: ``validate_for_mesh`` and
``attach_capabilities_and_validate``.

``validate_for_mesh`` reports *every* problem at once (bad sizes and unsupported axes), one line each naming
the axis, the size, the reason and the fix. ``attach_capabilities_and_validate`` records the mesh on the model
instance (one plain ``MeshContext`` attribute) and answers ``model.supports`` / ``model.supports_*`` through
read-only non-data descriptors on the model's class: the instance keeps its own class, so FSDP2's
``fully_shard`` (which swaps classes itself), ``pickle``, ``copy.deepcopy`` and ``type(model)`` stay ordinary.
This module never imports a model package, a trainer or transformers.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch.nn as nn

from .declarative import ModelCapabilities
from .introspection import _decide, _declared, expert_split_problem, tp_split_problem
from .mesh import MODEL_AXES, MeshContext, read_mesh_sizes
from .supports import FORWARDED_FLAGS, ModelSupports

__all__ = ["attach_capabilities_and_validate", "validate_for_mesh"]

# The one instance attribute an attached model carries (a MeshContext, or None for no mesh); prefixed so it cannot
# collide with a model's own names. Plain data: it pickles, deep-copies and survives FSDP2's class swap as is.
_MESH_ATTR = "_am_capabilities_mesh"


def validate_for_mesh(model: nn.Module, mesh: Any) -> None:
    """Raise if ``model`` cannot run on ``mesh``; do nothing when ``mesh`` is ``None`` or everything holds.

    Axes of size 1 never fail. ``ep_size > 1`` also needs every expert count of the model's configs to be
    divisible by it (see ``expert_split_problem``), and ``tp_size > 1`` a tensor-parallel plan that shards the model
    over it (see ``tp_split_problem``). An invalid size (``< 1``, non-integer, bool) is itself
    reported, next to the capability problems of the other axes.

    Args:
        model: the model instance.
        mesh: ``MeshContext``, ``DeviceMesh`` with named dims, or any object with ``<axis>_size`` attributes.

    Raises:
        ValueError: ``"Unsupported configuration for <Class> (<n> problems):"`` (upstream's opening) followed by
            one ``"  - "`` line per problem, e.g. ``"  - pp_size=2: <Class> cannot use pipeline parallelism:
            <reason>. Fix: set pp_size=1, or ..."``.
    """
    if mesh is None:
        return
    sizes, problems = read_mesh_sizes(mesh)
    name = type(model).__name__
    titles = {"tp": "tensor", "pp": "pipeline", "cp": "context", "ep": "expert"}
    used = [axis for axis in MODEL_AXES if sizes[axis] > 1]
    # Read the declaration only when an axis is used: a mesh of size-1 axes never errors, not even for a model
    # whose dynamic declaration cannot be evaluated (e.g. no config).
    declared: ModelCapabilities | None = _declared(model) if used else None
    for axis in used:
        size = sizes[axis]
        verdict = _decide[axis](model, declared)
        if not verdict.ok:
            problems.append(
                f"{axis}_size={size}: {name} cannot use {titles[axis]} parallelism: {verdict.reason}. "
                f"Fix: {verdict.fix}."
            )
        elif axis == "tp" and (unsplit := tp_split_problem(model, size)) is not None:
            problems.append(
                f"tp_size={size}: {name} cannot use tensor parallelism: {unsplit}. Fix: choose a tp_size that "
                "divides these sizes, or set tp_size=1."
            )
        elif axis == "ep" and (uneven := expert_split_problem(model, size)) is not None:
            problems.append(
                f"ep_size={size}: {name} cannot use expert parallelism: {uneven}. Fix: choose an ep_size that "
                "divides the number of experts."
            )
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise ValueError(f"Unsupported configuration for {name} ({count}):\n  - " + "\n  - ".join(problems))


def attach_capabilities_and_validate(model: nn.Module, mesh: Any = None) -> nn.Module:
    """Validate ``model`` for ``mesh``, then give it ``model.supports`` (a ``ModelSupports`` for that mesh).

    The model keeps its class. The instance gets one attribute (the mesh as a ``MeshContext``); its class gets,
    once, read-only *non-data* descriptors for ``supports`` and for each ``ModelSupports`` flag (``supports_*``,
    ``is_custom_model``) that the class does not already define. They answer only on attached instances (other
    instances see the usual ``AttributeError``), never shadow a model's own class or instance attributes (e.g.
    HuggingFace's ``supports_gradient_checkpointing``: ``model.supports.<flag>`` is always ours), and compute on
    access, so they follow live changes (``backend.attn``, ``mtp_config.enabled``). Copies (``copy.deepcopy``,
    e.g. pipeline stages; ``pickle``) carry the mesh and describe themselves; so does a model that FSDP2's
    ``fully_shard`` re-classes before or after this call. Calling again only replaces the mesh.

    Validation happens first, so a rejected model is left untouched.

    Args:
        model: the model instance (modified in place and returned).
        mesh: as in ``validate_for_mesh``; ``None`` skips validation.

    Returns:
        ``model``.

    Raises:
        ValueError: from ``validate_for_mesh``.
        TypeError: the model's class defines its own ``supports``, or the instance holds a ``supports`` attribute.
    """
    validate_for_mesh(model, mesh)
    cls = type(model)
    own = inspect.getattr_static(cls, "supports", None)
    if own is not None and not isinstance(own, _Forward):
        raise TypeError(
            f"{cls.__qualname__} already defines 'supports', so capabilities cannot be attached without shadowing "
            "it; rename the model's attribute or use ModelSupports(model, mesh) directly."
        )
    if "supports" in vars(model):
        raise TypeError(
            f"This {cls.__qualname__} instance holds its own 'supports' attribute, which would hide the attached "
            "capabilities; delete or rename it, or use ModelSupports(model, mesh) directly."
        )
    _install_descriptors(cls)
    vars(model)[_MESH_ATTR] = None if mesh is None else MeshContext.from_mesh(mesh)
    return model


class _Forward:
    """Non-data descriptor: ``model.supports`` (``flag=None``) or ``model.supports.<flag>`` on attached instances.

    An instance that was never attached raises ``AttributeError`` here, and Python then falls back to
    ``nn.Module.__getattr__``, whose error is the usual "object has no attribute". Having no ``__set__``, it never
    hides an instance attribute of the same name nor blocks assigning one.
    """

    __slots__ = ("flag",)

    def __init__(self, flag: str | None) -> None:
        self.flag = flag

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        attributes = vars(instance)
        if _MESH_ATTR not in attributes:
            raise AttributeError(self.flag or "supports")
        # Built per access (the model and the mesh): nothing that refers back to the model is stored on it, so
        # copies never describe their original and the model is freed by reference counting alone.
        supports = ModelSupports(instance, attributes[_MESH_ATTR])
        return supports if self.flag is None else getattr(supports, self.flag)


_install_lock = threading.Lock()


def _install_descriptors(cls: type) -> None:
    """Give ``cls`` the ``supports`` and flag descriptors it lacks (own or inherited); idempotent."""
    with _install_lock:
        for name in ("supports", *FORWARDED_FLAGS):
            if inspect.getattr_static(cls, name, None) is None:
                setattr(cls, name, _Forward(None if name == "supports" else name))
