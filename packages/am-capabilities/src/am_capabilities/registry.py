"""Registry of custom model classes by architecture name, filled by entry points or ``register_model``.

Model packages register without depending on am-capabilities: they declare an entry point in the group
``am_capabilities.models`` whose *name* is the architecture name (as in ``config.architectures``) and whose
*value* is the model class::

    [project.entry-points."am_capabilities.models"]
    NemotronHForCausalLM = "am_models_nemotron:NemotronHForCausalLM"

Entry points are discovered on first use and only *loaded* (imported) when their architecture is looked up,
so a broken entry point fails only the lookups that name it, with an error naming the entry point; every
other query keeps working. Code that does not ship entry points calls ``register_model(cls)``; explicit
registrations win over entry points of the same name. This module never imports a model package itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch.nn as nn

__all__ = [
    "ENTRY_POINT_GROUP",
    "ModelRegistryError",
    "clear_registry_cache",
    "find_model_class",
    "get_model_class",
    "is_registered_model_class",
    "register_model",
    "registered_architectures",
    "unregister_model",
]

ENTRY_POINT_GROUP = "am_capabilities.models"


class ModelRegistryError(RuntimeError):
    """An entry point of the ``am_capabilities.models`` group cannot be loaded or is not a model class."""


@dataclass(frozen=True)
class _EntryPointRecord:
    name: str
    module: str
    attr: str
    distribution: str | None
    entry_point: importlib.metadata.EntryPoint

    def describe(self) -> str:
        where = f" (distribution {self.distribution!r})" if self.distribution else ""
        return f"entry point '{self.name} = {self.module}:{self.attr}' in group '{ENTRY_POINT_GROUP}'{where}"


_lock = threading.RLock()
_explicit: dict[str, type[nn.Module]] = {}
_entry_points: dict[str, _EntryPointRecord] | None = None  # None until first scan
_loaded: dict[str, type[nn.Module]] = {}


def register_model(cls: type[nn.Module], *, architecture: str | None = None, replace: bool = False) -> None:
    """Register a custom model class under an architecture name (default: ``cls.__name__``).

    Args:
        cls: an ``nn.Module`` subclass.
        architecture: the name found in ``config.architectures``.
        replace: allow replacing a different class already registered under that name.

    Raises:
        TypeError: ``cls`` is not an ``nn.Module`` subclass.
        ValueError: another class is registered under the name and ``replace`` is False.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_model expects an nn.Module subclass, got {cls!r}.")
    name = architecture or cls.__name__
    with _lock:
        current = _explicit.get(name)
        if current is not None and current is not cls and not replace:
            raise ValueError(
                f"Architecture {name!r} is already registered to {_qualified(current)}; "
                f"pass replace=True to register {_qualified(cls)} instead, or unregister_model({name!r}) first."
            )
        _explicit[name] = cls


def unregister_model(architecture: str) -> None:
    """Remove an explicit registration (entry points are unaffected). Unknown names are ignored."""
    with _lock:
        _explicit.pop(architecture, None)


def clear_registry_cache() -> None:
    """Forget discovered and loaded entry points so the next lookup rescans ``sys.path``.

    Explicit ``register_model`` registrations are kept.
    """
    global _entry_points
    with _lock:
        _entry_points = None
        _loaded.clear()
    importlib.invalidate_caches()


def registered_architectures() -> list[str]:
    """Sorted architecture names known from explicit registrations and entry points (none is imported)."""
    with _lock:
        return sorted(set(_explicit) | set(_scan_entry_points()))


def get_model_class(architecture: str) -> type[nn.Module]:
    """Return the model class registered for ``architecture``, importing its entry point if needed.

    Raises:
        KeyError: no registration and no entry point has that name.
        ModelRegistryError: the entry point fails to import, or does not name an ``nn.Module`` subclass.
    """
    with _lock:
        if (found := _explicit.get(architecture) or _loaded.get(architecture)) is not None:
            return found
        record = _scan_entry_points().get(architecture)
        if record is None:
            known = registered_architectures()
            raise KeyError(
                f"Architecture {architecture!r} is not registered (known: {known}). A model package registers it "
                f"with an entry point in group '{ENTRY_POINT_GROUP}' named {architecture!r}, "
                "or call am_capabilities.register_model(<class>)."
            )
        cls = _load(record)
        _loaded[architecture] = cls
        return cls


def find_model_class(architectures: Iterable[str] | None, model_type: str | None = None) -> type[nn.Module] | None:
    """The registered class for a checkpoint's ``config.json``, or ``None`` when none is registered for it.

    The first entry of ``architectures`` that is registered wins (only its entry point is imported). A config
    without architectures is resolved by ``model_type``: transformers' causal-LM auto mapping names its
    architecture (e.g. ``"llama"`` -> ``"LlamaForCausalLM"``), which is then looked up here; without transformers
    installed a bare ``model_type`` resolves to ``None``. When architectures are given, ``model_type`` is not
    consulted: they name the exact head (a classification checkpoint never resolves to a causal LM).

    ``None`` means "not ours": fall back to transformers (e.g. ``AutoModelForCausalLM.from_pretrained``).

    Raises:
        ModelRegistryError: the matching entry point fails to import or does not name a model class.
    """
    names = [str(name) for name in architectures or ()]
    if not names and model_type:
        names = _causal_lm_architectures(model_type)
    known = set(registered_architectures())
    for name in names:
        if name in known:
            return get_model_class(name)
    return None


def _causal_lm_architectures(model_type: str) -> list[str]:
    """Architecture names transformers maps ``model_type`` to for causal LMs ([] without transformers)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return []
    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ())
    return [names] if isinstance(names, str) else list(names)


def is_registered_model_class(cls: type) -> bool:
    """Whether ``cls`` or one of its bases is a registered custom model class.

    Entry points are matched on ``module:qualname`` without importing them, so this never imports a model
    package and never fails because some unrelated entry point is broken. A class that merely shares an
    architecture name with a registered one (e.g. HuggingFace's ``NemotronHForCausalLM`` next to ours) does
    not match. An entry point may name the defining module (``pkg.model:Cls``) or the package that re-exports
    the class (``pkg:Cls``, matched when the class is defined in a submodule of ``pkg``).
    """
    with _lock:
        explicit = set(_explicit.values())
        entry_targets = {(record.module, record.attr) for record in _scan_entry_points().values()}
    return any(klass in explicit or _names_entry_target(klass, entry_targets) for klass in cls.__mro__)


def _names_entry_target(klass: type, targets: set[tuple[str, str]]) -> bool:
    module, qualname = klass.__module__, klass.__qualname__
    parts = module.split(".")
    # The defining module itself, or any package above it that may re-export the class under the same name.
    return any((".".join(parts[:depth]), qualname) in targets for depth in range(len(parts), 0, -1))


def _scan_entry_points() -> dict[str, _EntryPointRecord]:
    """Discover (not load) the group's entry points once; duplicates keep the first and warn."""
    global _entry_points
    with _lock:
        if _entry_points is not None:
            return _entry_points
        records: dict[str, _EntryPointRecord] = {}
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            module, _, attr = entry_point.value.partition(":")
            dist = getattr(entry_point, "dist", None)
            record = _EntryPointRecord(
                name=entry_point.name,
                module=module.strip(),
                attr=attr.strip(),
                distribution=dist.metadata["Name"] if dist is not None else None,
                entry_point=entry_point,
            )
            if entry_point.name in records:
                kept = records[entry_point.name]
                if (kept.module, kept.attr) != (record.module, record.attr):
                    warnings.warn(
                        f"Architecture {entry_point.name!r} is declared by two entry points; keeping "
                        f"{kept.describe()} and ignoring {record.describe()}.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                continue
            records[entry_point.name] = record
        _entry_points = records
        return records


def _load(record: _EntryPointRecord) -> type[nn.Module]:
    if not record.attr:
        raise ModelRegistryError(f"{record.describe()} must have the form 'module:Class', got no ':Class' part.")
    try:
        obj = record.entry_point.load()
    # Loading imports a third-party module, whose import-time code can raise anything; nothing is swallowed: every
    # such error is re-raised as ModelRegistryError naming the entry point, with the original chained.
    except Exception as exc:
        raise ModelRegistryError(
            f"Cannot load {record.describe()}: {type(exc).__name__}: {exc}. "
            "Fix or reinstall that package, or uninstall it if it is stale."
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ModelRegistryError(
            f"{record.describe()} resolves to {obj!r}, which is not an nn.Module subclass; "
            "the entry point value must name the model class."
        )
    return obj


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
