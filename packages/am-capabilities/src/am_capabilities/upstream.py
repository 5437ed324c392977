"""Upstream NeMo AutoModel's spellings of attaching capabilities and of its gradient-checkpointing rule, built on the
core.

The core `attach_capabilities_and_validate` stores one instance attribute, `model.supports`, and patches no class.
Code written against upstream also reads the flags straight off the model (`model.supports_cp`), which upstream
provides by swapping the instance to a dynamic subclass of the same name carrying one forwarding property per flag.
This module does that swap for such code; nothing in am-* imports it.

Upstream's `ModelSupports.supports_gradient_checkpointing` is False for an expert-parallel model at `ep_size > 1`
(its MoE layers were not known to recompute exactly under the exchange); the core's flag follows the class's
declaration on every mesh (am-moe's layers recompute exactly). `ModelSupports` here keeps upstream's answer.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .supports import ModelSupports as _CoreModelSupports
from .validation import attach_capabilities_and_validate as _attach

__all__ = ["FORWARDED_FLAGS", "ModelSupports", "attach_capabilities_and_validate"]


class ModelSupports(_CoreModelSupports):
    """The core `ModelSupports` with upstream's gradient-checkpointing rule: False for a model that implements
    expert parallelism when ``ep_size > 1``; otherwise the core's answer (the class's plain declaration)."""

    __slots__ = ()

    @property
    def supports_gradient_checkpointing(self) -> bool:
        return not (self.ep_size > 1 and self.supports_ep) and super().supports_gradient_checkpointing


# Upstream forwards every `supports_*` flag and `is_custom_model`.
FORWARDED_FLAGS: tuple[str, ...] = tuple(
    sorted(
        name
        for name, value in vars(_CoreModelSupports).items()
        if (name.startswith("supports_") or name == "is_custom_model") and isinstance(value, property)
    )
)
_MARKER = "_am_upstream_capabilities_class"


def _forward(name: str) -> property:
    def read(self: nn.Module) -> Any:
        return getattr(self.supports, name)

    read.__name__ = name
    read.__doc__ = f"``self.supports.{name}`` (upstream's forwarding property)."
    return property(read)


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}  # one swapped class per model class, as upstream caches it


def _forwarding_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls in _CLASSES:
        return _CLASSES[cls]
    # Unlike upstream, a name the class defines itself is not shadowed (HF's `supports_gradient_checkpointing` is a
    # class attribute transformers reads with its own meaning; ours stays `model.supports.supports_...`).
    body: dict[str, Any] = {
        name: _forward(name) for name in FORWARDED_FLAGS if inspect.getattr_static(cls, name, None) is None
    }
    body.update({"__module__": cls.__module__, "__qualname__": cls.__qualname__, _MARKER: True})
    _CLASSES[cls] = type(cls.__name__, (cls,), body)
    return _CLASSES[cls]


def attach_capabilities_and_validate(model: nn.Module, mesh: Any = None) -> nn.Module:
    """Upstream's attach: the core `attach_capabilities_and_validate`, then the instance's class swapped (once) for a
    subclass of the same ``__name__`` / ``__qualname__`` / ``__module__`` whose properties forward ``model.supports_*``
    and ``model.is_custom_model`` to ``model.supports``.

    Prefer the core function (`am_capabilities.attach_capabilities_and_validate`): the swapped class is not the one
    ``pickle`` finds by name, so a swapped model does not pickle (upstream's models do not either); ``copy.deepcopy``
    and FSDP2's ``fully_shard`` work. Idempotent: a second call only replaces the mesh.

    Raises:
        ValueError / TypeError: as the core function (validation first; a rejected model is left untouched).
    """
    _attach(model, mesh)
    cls = type(model)
    if not vars(cls).get(_MARKER, False):
        model.__class__ = _forwarding_class(cls)
    return model
