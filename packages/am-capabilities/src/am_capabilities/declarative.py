"""Declared capabilities: what a model class says it supports, and ``query_capabilities`` to read it.

A model class declares its capabilities in one of two duck-typed ways (neither needs am-capabilities):

- static: a nested class (or any object) named ``ModelCapabilities`` with ``supports_*`` attributes::

      class MyModel(nn.Module):
          class ModelCapabilities:
              supports_tp = True
              supports_cp = True

- dynamic, when the answer depends on the checkpoint variant: a classmethod
  ``get_capabilities(cls, config)`` returning such an object (or a mapping of ``supports_*`` → bool).

The first class in the MRO whose own ``__dict__`` holds either declaration decides, so runtime wrapper
subclasses (FSDP2's ``fully_shard``) inherit it. This module never imports transformers at
import time; ``query_capabilities`` on a HuggingFace model id imports it lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch.nn as nn

from .registry import get_model_class

__all__ = ["ModelCapabilities", "declared_capabilities", "query_capabilities"]


@dataclass(frozen=True)
class ModelCapabilities:
    """Canonical capability declaration; every flag defaults to ``False`` (not declared = not supported).

    Attributes:
        supports_tp: tensor parallelism.
        supports_cp: context parallelism (still subject to the attention backend at runtime).
        supports_pp: pipeline parallelism.
        supports_ep: expert parallelism.
        supports_thd: packed ``THD`` sequence layout.
        supports_mtp_cp: multi-token prediction under context parallelism.
        supports_mtp_cp_pp: multi-token prediction under context and pipeline parallelism together.
        supports_cp_vision_frame_sharding: vision frames sharded across the CP group.
    """

    supports_tp: bool = False
    supports_cp: bool = False
    supports_pp: bool = False
    supports_ep: bool = False
    supports_thd: bool = False
    supports_mtp_cp: bool = False
    supports_mtp_cp_pp: bool = False
    supports_cp_vision_frame_sharding: bool = False

    def __post_init__(self) -> None:
        wrong = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if type(getattr(self, f.name)) is not bool]
        if wrong:
            raise TypeError(f"ModelCapabilities flags must be bools, got {', '.join(wrong)}.")


_FLAGS: frozenset[str] = frozenset(f.name for f in fields(ModelCapabilities))
_STATIC = "ModelCapabilities"
_DYNAMIC = "get_capabilities"


def query_capabilities(target: Any, *, trust_remote_code: bool = False) -> ModelCapabilities:
    """Return the capabilities a model class declares.

    Args:
        target: one of
            - an ``nn.Module`` instance (its class, called with ``target.config`` when dynamic);
            - an ``nn.Module`` subclass (static declarations only: a dynamic one needs a config);
            - a config-like object with ``architectures`` (first entry looked up in the model registry);
            - a ``str``: a HuggingFace model id or local checkpoint folder, read with ``AutoConfig``.
        trust_remote_code: forwarded to ``AutoConfig.from_pretrained`` for ``str`` targets.

    Returns:
        The canonical ``ModelCapabilities``.

    Raises:
        AttributeError: no class in the MRO declares capabilities.
        TypeError: a class declares both forms; the target is of an unsupported kind; a class target is not
            an ``nn.Module`` subclass; a declaration holds unknown ``supports_*`` names or non-bool values.
        ValueError: a dynamic declaration needs a config and none is available; a config has no
            ``architectures``.
        KeyError: the config's architecture is not registered.
        ImportError: a ``str`` target and transformers is not installed.
    """
    if isinstance(target, str):
        return _query_config(_load_hf_config(target, trust_remote_code=trust_remote_code))
    if isinstance(target, nn.Module):
        return _require_declaration(type(target), getattr(target, "config", None))
    if isinstance(target, type):
        if not issubclass(target, nn.Module):
            raise TypeError(
                f"query_capabilities got the class {target.__qualname__}, which is not an nn.Module subclass; "
                "pass a model class, a model instance, a config or a model id."
            )
        return _require_declaration(target, None)
    if hasattr(target, "architectures") or hasattr(target, "model_type"):
        return _query_config(target)
    raise TypeError(
        f"query_capabilities cannot read capabilities from a {type(target).__name__}; pass a model class, "
        "a model instance, a config with 'architectures', or a HuggingFace model id (str)."
    )


def declared_capabilities(cls: type, config: Any) -> ModelCapabilities | None:
    """The declaration that applies to ``cls`` (with ``config`` for dynamic ones), or ``None`` if none exists.

    Raises:
        TypeError / ValueError: as in ``query_capabilities`` for malformed declarations or a missing config.
    """
    owner = _declaring_class(cls)
    if owner is None:
        return None
    if _DYNAMIC in vars(owner):
        if config is None:
            raise ValueError(
                f"{cls.__qualname__} declares capabilities dynamically ({owner.__qualname__}.get_capabilities), "
                "so a config is required: pass a model instance with .config or a config object instead of the class."
            )
        return _to_canonical(getattr(cls, _DYNAMIC)(config), source=f"{owner.__qualname__}.get_capabilities(config)")
    return _to_canonical(vars(owner)[_STATIC], source=f"{owner.__qualname__}.ModelCapabilities")


def _declaring_class(cls: type) -> type | None:
    for klass in cls.__mro__:
        own = vars(klass)
        if _STATIC in own and _DYNAMIC in own:
            raise TypeError(
                f"{klass.__qualname__} defines both a nested ModelCapabilities and get_capabilities(); "
                "a class must declare exactly one. Keep get_capabilities if the answer depends on the config."
            )
        if _STATIC in own or _DYNAMIC in own:
            return klass
    return None


def _require_declaration(cls: type, config: Any) -> ModelCapabilities:
    declared = declared_capabilities(cls, config)
    if declared is None:
        raise AttributeError(
            f"{cls.__qualname__} declares no capabilities: give it a nested 'ModelCapabilities' class with "
            "supports_* attributes, or a 'get_capabilities(cls, config)' classmethod."
        )
    return declared


def _to_canonical(obj: Any, *, source: str) -> ModelCapabilities:
    """Re-pack any declaration (``ModelCapabilities``, class, object or mapping) into the canonical form."""
    if isinstance(obj, ModelCapabilities):
        return obj
    if isinstance(obj, Mapping):
        values = dict(obj)
    else:
        values = {name: getattr(obj, name) for name in dir(obj) if name.startswith("supports_")}
    if unknown := sorted(set(values) - _FLAGS):
        raise TypeError(f"{source} declares unknown capability flags {unknown}; known flags are {sorted(_FLAGS)}.")
    try:
        return ModelCapabilities(**values)
    except TypeError as exc:
        raise TypeError(f"{source}: {exc}") from None


def _query_config(config: Any) -> ModelCapabilities:
    architectures = getattr(config, "architectures", None)
    if not architectures:
        raise ValueError(
            f"Config of type {type(config).__name__} has no 'architectures' field (got {architectures!r}), so the "
            "model class is unknown; set config.architectures = ['<ModelClassName>'] or query the model class."
        )
    return _require_declaration(get_model_class(architectures[0]), config)


def _load_hf_config(model_id: str, *, trust_remote_code: bool) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise ImportError(
            f"query_capabilities({model_id!r}) reads the model's config with transformers, which is not installed; "
            "`pip install am-capabilities[hf]`, or pass a config object or model class instead."
        ) from exc
    return AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code)
