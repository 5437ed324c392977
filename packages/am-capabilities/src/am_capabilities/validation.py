"""Reject unsupported meshes before any collective runs: ``validate_for_mesh`` and
``attach_capabilities_and_validate``.

``validate_for_mesh`` reports *every* problem at once (bad sizes and unsupported axes), one line each naming
the axis, the size, the reason and the fix. ``attach_capabilities_and_validate`` gives a model a ``supports``
attribute by swapping its class for a cached dynamic subclass with the same ``__name__``, ``__qualname__`` and
``__module__``; the subclass pickles and deep-copies as the original class and re-attaches on the copy, so PP
stages (deep copies) keep working. This module never imports a model package, a trainer or transformers.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.nn as nn

from am_capabilities.declarative import ModelCapabilities
from am_capabilities.introspection import FORWARDED_FLAGS, ModelSupports, _decide, _declared
from am_capabilities.mesh import MODEL_AXES, MeshContext, read_mesh_sizes

__all__ = ["attach_capabilities_and_validate", "validate_for_mesh"]

# Instance attributes used by attached models; prefixed so they cannot collide with a model's own names.
_MESH_ATTR = "_am_capabilities_mesh"
_SUPPORTS_ATTR = "_am_capabilities_supports"
# Class attribute marking the dynamic subclass; its value is the original class.
_ORIGINAL_ATTR = "_am_capabilities_original_class"


def validate_for_mesh(model: nn.Module, mesh: Any) -> None:
    """Raise if ``model`` cannot run on ``mesh``; do nothing when ``mesh`` is ``None`` or everything holds.

    Axes of size 1 never fail. An invalid size (``< 1``, non-integer, bool) is itself reported, next to the
    capability problems of the other axes.

    Args:
        model: the model instance.
        mesh: ``MeshContext``, ``DeviceMesh`` with named dims, or any object with ``<axis>_size`` attributes.

    Raises:
        ValueError: ``"Unsupported mesh for <Class> (<n> problems):"`` followed by one ``"  - "`` line per
            problem, e.g. ``"  - pp_size=2: <Class> cannot use pipeline parallelism: <reason>. Fix: set
            pp_size=1, or ..."``.
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
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise ValueError(f"Unsupported mesh for {name} ({count}):\n  - " + "\n  - ".join(problems))


def attach_capabilities_and_validate(model: nn.Module, mesh: Any = None) -> nn.Module:
    """Give ``model`` a ``supports`` attribute (a ``ModelSupports``) and validate it for ``mesh``.

    The model's class is swapped (once; repeated calls only update the mesh) for a subclass with the same
    ``__name__``, ``__qualname__`` and ``__module__`` that adds:

    - ``supports``: the model's ``ModelSupports``, rebuilt lazily when missing or when it describes another
      object (a deep copy carries its original's weak reference);
    - one forwarding property per ``ModelSupports`` flag (``supports_*``, ``is_custom_model``) that the original
      class does not already define — a model's own attributes (e.g. HuggingFace's
      ``supports_gradient_checkpointing``) are never shadowed; ``model.supports.<flag>`` is always ours.

    Validation happens first, so a rejected model is left untouched.

    Args:
        model: the model instance (modified in place and returned).
        mesh: as in ``validate_for_mesh``; ``None`` skips validation.

    Returns:
        ``model``.

    Raises:
        ValueError: from ``validate_for_mesh``.
        TypeError: the model class already defines its own ``supports`` attribute.
    """
    validate_for_mesh(model, mesh)
    mesh_context = None if mesh is None else MeshContext.from_mesh(mesh)
    if _original_class(type(model)) is None:
        if "supports" in dir(type(model)):
            raise TypeError(
                f"{type(model).__qualname__} already defines 'supports', so capabilities cannot be attached "
                "without shadowing it; rename the model's attribute or use ModelSupports(model, mesh) directly."
            )
        model.__class__ = _attached_subclass(type(model))
    model.__dict__[_MESH_ATTR] = mesh_context
    model.__dict__.pop(_SUPPORTS_ATTR, None)  # rebuilt lazily for the new mesh
    return model


def _original_class(cls: type) -> type | None:
    """The un-attached class if ``cls`` is (or derives from, e.g. via FSDP) an attached subclass."""
    return getattr(cls, _ORIGINAL_ATTR, None)


_subclass_cache: dict[type, type] = {}
_subclass_lock = threading.Lock()


def _attached_subclass(cls: type[nn.Module]) -> type[nn.Module]:
    """The cached dynamic subclass of ``cls`` that carries ``supports`` (one per original class)."""
    with _subclass_lock:
        subclass = _subclass_cache.get(cls)
        if subclass is None:
            namespace = _class_namespace(cls)
            namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__)
            subclass = type(cls.__name__, (cls,), namespace)
            _subclass_cache[cls] = subclass
        return subclass


def _class_namespace(cls: type) -> dict[str, Any]:
    namespace: dict[str, Any] = {
        _ORIGINAL_ATTR: cls,
        "supports": property(_get_supports, doc="This model's ModelSupports (rebuilt for copies)."),
        "__reduce_ex__": _reduce_ex,
    }
    existing = set(dir(cls))
    for flag in FORWARDED_FLAGS:
        if flag not in existing:
            namespace[flag] = _forwarding_property(flag)
    return namespace


def _get_supports(self: nn.Module) -> ModelSupports:
    supports = self.__dict__.get(_SUPPORTS_ATTR)
    if supports is None or not supports.describes(self):
        supports = ModelSupports(self, self.__dict__.get(_MESH_ATTR))
        self.__dict__[_SUPPORTS_ATTR] = supports
    return supports


def _forwarding_property(flag: str) -> property:
    def forward(self: nn.Module) -> Any:
        return getattr(_get_supports(self), flag)

    forward.__name__ = flag
    return property(forward, doc=f"Forwards to ``self.supports.{flag}``.")


def _reduce_ex(self: nn.Module, protocol: Any) -> str | tuple[Any, ...]:
    """Pickle / deep-copy as the original class (the dynamic subclass is not importable by name), minus the
    weakly-referencing ``ModelSupports``; the copy is re-attached by ``_new_attached``.

    The object is created before its state is copied (like the default reduction), so reference cycles
    inside the model survive ``copy.deepcopy``.
    """
    original = _original_class(type(self))
    if original is None or _subclass_cache.get(original) is not type(self):
        # A further wrapper (e.g. FSDP's dynamic class) sits on top: keep the default reduction; a deep copy
        # then carries a stale ModelSupports, which ``supports`` notices and rebuilds.
        return object.__reduce_ex__(self, protocol)
    # Start from the class's own __getstate__ (nn.Module's drops `_compiled_call_impl`, whose closure is bound to
    # *this* instance: a copy carrying it would run the original model's forward).
    state = {key: value for key, value in self.__getstate__().items() if key != _SUPPORTS_ATTR}
    return (_new_attached, (original,), state)


def _new_attached(original: type[nn.Module]) -> nn.Module:
    """Unpickling / copy hook: a blank instance of ``original``'s attached subclass (state is set after)."""
    subclass = _attached_subclass(original)
    return subclass.__new__(subclass)
