"""Reject unsupported meshes before any collective runs: ``validate_for_mesh`` and
``attach_capabilities_and_validate``.

``validate_for_mesh`` reports *every* problem at once (bad sizes and unsupported axes), one line each naming
the axis, the size, the reason and the fix. ``attach_capabilities_and_validate`` stores one instance attribute,
``model.supports``, a ``ModelSupports`` that refers to the model weakly. It patches no class and swaps none: FSDP2's
``fully_shard`` (which swaps classes itself), ``pickle``, ``copy.deepcopy`` and ``type(model)`` stay ordinary.
This module never imports a model package, a trainer or transformers.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.nn as nn

from .declarative import ModelCapabilities
from .introspection import _decide, _declared, expert_split_problem, tp_split_problem
from .mesh import MODEL_AXES, MeshContext, read_mesh_sizes
from .supports import ModelSupports, attached_view

__all__ = ["attach_capabilities_and_validate", "validate_for_mesh"]


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
    # an axis the model supports may still not divide its sizes: (why not, fix)
    splits = {
        "tp": (tp_split_problem, "choose a tp_size that divides these sizes, or set tp_size=1"),
        "ep": (expert_split_problem, "choose an ep_size that divides the number of experts"),
    }
    for axis in used:
        size, verdict = sizes[axis], _decide[axis](model, declared)
        if verdict.ok and axis in splits and (unsplit := splits[axis][0](model, size)) is not None:
            verdict = verdict._replace(ok=False, reason=unsplit, fix=splits[axis][1])
        if not verdict.ok:
            problems.append(
                f"{axis}_size={size}: {name} cannot use {titles[axis]} parallelism: {verdict.reason}. "
                f"Fix: {verdict.fix}."
            )
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise ValueError(f"Unsupported configuration for {name} ({count}):\n  - " + "\n  - ".join(problems))


def attach_capabilities_and_validate(model: nn.Module, mesh: Any = None) -> nn.Module:
    """Validate ``model`` for ``mesh``, then give it ``model.supports`` (a ``ModelSupports`` for that mesh).

    ``model.supports`` is a plain instance attribute: no class is patched or swapped (``type(model)`` is unchanged).
    Its flags are computed on access, so they follow live changes (``backend.attn``, ``mtp_config.enabled``). It
    refers to the model weakly (as upstream's does), so the model is freed by reference counting alone; reading it
    after the model is gone raises ``ReferenceError``. Copies (``copy.deepcopy``, e.g. pipeline stages; ``pickle``)
    carry the mesh and describe themselves; so does a model that FSDP2's ``fully_shard`` re-classes before or after
    this call. Calling again only replaces the mesh. Upstream's forwarding properties (``model.supports_cp``) need a
    class swap; read ``model.supports.supports_cp``.

    Validation happens first, so a rejected model is left untouched.

    Args:
        model: the model instance (modified in place and returned).
        mesh: as in ``validate_for_mesh``; ``None`` skips validation.

    Returns:
        ``model``.

    Raises:
        ValueError: from ``validate_for_mesh``.
        TypeError: the model's class defines its own ``supports``, or the instance holds a ``supports`` attribute
            that is not one this function stored.
    """
    validate_for_mesh(model, mesh)
    cls = type(model)
    if inspect.getattr_static(cls, "supports", None) is not None:
        raise TypeError(
            f"{cls.__qualname__} already defines 'supports', so capabilities cannot be attached without shadowing "
            "it; rename the model's attribute or use ModelSupports(model, mesh) directly."
        )
    own = vars(model).get("supports")
    if own is not None and not (isinstance(own, ModelSupports) and own.describes(model)):
        raise TypeError(
            f"This {cls.__qualname__} instance holds its own 'supports' attribute, which would hide the attached "
            "capabilities; delete or rename it, or use ModelSupports(model, mesh) directly."
        )
    # Stored in the instance dict directly: nn.Module.__setattr__ would only do the same for a plain object.
    vars(model)["supports"] = attached_view(model, None if mesh is None else MeshContext.from_mesh(mesh))
    return model
