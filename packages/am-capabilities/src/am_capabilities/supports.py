"""``ModelSupports``: the capability flags of one live model (optionally for a mesh), read from the per-axis
decisions of ``introspection`` so the flags and ``validate_for_mesh`` can never disagree.

What it must not do: decide anything itself (every rule lives in ``introspection``), or import a model package.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.nn as nn

from am_model_contract import contract_of

from .declarative import ModelCapabilities
from .introspection import (
    _attn_backend,
    _decide,
    _declared,
    _has_backend,
    _has_packing_attention,
    _plain_class_value,
    _supports_seq_lens,
    _uses_magi_attention,
    _uses_te_attention,
    is_hybrid_model,
    tp_split_problem,
)
from .mesh import MeshContext
from .registry import is_registered_model_class

__all__ = ["ModelSupports", "attached_view"]


def _mesh_size(axis: str) -> property:
    """The mesh's ``<axis>_size`` (1 without a mesh)."""
    return property(lambda self: 1 if self._mesh is None else getattr(self._mesh, f"{axis}_size"))


def _decided(axis: str, doc: str) -> property:
    """Whether the model may use ``axis`` (its ``introspection._decide_<axis>`` verdict), documented by ``doc``."""
    return property(lambda self: _decide[axis](self.model, _declared(self.model)).ok, doc=doc)


def _declared_flag(name: str) -> property:
    """The flag ``name`` of the class's capability declaration (False without one)."""
    return property(lambda self: getattr(_declared(self.model), name, False))


class ModelSupports:
    """Capability flags of one live model, optionally for a given mesh.

    ``ModelSupports(model, mesh)`` holds an ordinary (strong) reference to the model, so ``ModelSupports(make())``
    works when the caller keeps no other reference. The object that ``attach_capabilities_and_validate`` stores on
    the model (``model.supports``, built by ``attached_view``) holds it weakly, as upstream's does: a strong one
    would make a model -> supports -> model cycle that only the cycle collector frees. Every flag is recomputed on
    access, so it follows live changes such as ``backend.attn`` or ``mtp_config.enabled``.

    Args:
        model: the model instance.
        mesh: ``None``, a ``MeshContext``, a ``DeviceMesh`` with named dims, or any object with
            ``<axis>_size`` attributes. Only needed for the mesh-dependent flags.

    Raises:
        ValueError: the mesh has invalid sizes.
    """

    __slots__ = ("__weakref__", "_mesh", "_model_cls", "_strong", "_weak")

    _FLAGS: tuple[str, ...] = (
        "supports_tp",
        "supports_pp",
        "supports_cp",
        "supports_ep",
        "supports_sequence_packing",
        "supports_cp_with_sequence_packing",
        "supports_thd",
        "supports_mtp_cp",
        "supports_mtp_cp_pp",
        "supports_cp_vision_frame_sharding",
        "supports_gradient_checkpointing",
        "supports_generate",
        "mtp_enabled",
        "is_custom_model",
    )

    def __init__(self, model: nn.Module, mesh: Any = None) -> None:
        self._strong: nn.Module | None = model
        self._weak: weakref.ref[nn.Module] | None = None
        self._model_cls: type = type(model)
        self._mesh: MeshContext | None = None if mesh is None else MeshContext.from_mesh(mesh)

    # ---- plumbing --------------------------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The model these flags describe.

        Raises:
            ReferenceError: this is a model's ``model.supports`` and the model has been freed.
        """
        if self._weak is None:
            assert self._strong is not None
            return self._strong
        model = self._weak()
        if model is None:
            raise ReferenceError(
                f"ModelSupports: underlying model has been garbage-collected (this was the `supports` of a "
                f"{self._model_cls.__name__}, which refers to its model weakly). Fix: keep a reference to the model "
                "while reading its flags, or use ModelSupports(model, mesh), which keeps the model alive."
            )
        return model

    def describes(self, model: nn.Module) -> bool:
        """Whether this object describes exactly ``model`` (not a copy of it)."""
        target = self._strong if self._weak is None else self._weak()
        return target is model

    @property
    def mesh(self) -> MeshContext | None:
        return self._mesh

    tp_size = _mesh_size("tp")
    pp_size = _mesh_size("pp")
    cp_size = _mesh_size("cp")
    ep_size = _mesh_size("ep")

    @property
    def declared_capabilities(self) -> ModelCapabilities | None:
        """The class's capability declaration for this model's config, or ``None`` if it declares none."""
        return _declared(self.model)

    # ---- parallel axes ---------------------------------------------------------------------------------------

    @property
    def supports_tp(self) -> bool:
        """Declared, or a non-empty TP plan (contract ``tp.plan``: transformers' ``_tp_plan``); with a mesh whose
        ``tp_size > 1``, also a plan whose sizes divide by it (``tp_split_problem``)."""
        model = self.model
        return _decide["tp"](model, _declared(model)).ok and tp_split_problem(model, self.tp_size) is None

    supports_pp = _decided(
        "pp",
        """Declared, or a non-empty PP plan (contract ``pp.plan``), or an MoE model (``ep.is_moe``) that pipelines
        itself.""",
    )
    supports_cp = _decided("cp", "Not vetoed by a declaration, and a CP-capable attention path (see ``_decide_cp``).")
    supports_ep = _decided(
        "ep", "The model implements expert parallelism (contract ``ep.apply``) and no declaration says otherwise."
    )

    # The seed documents these two aliases on ModelSupports itself, so they stay on the class, not in an upstream
    # module; they are not package-root names.
    supports_tp_plan = supports_tp
    supports_pp_plan = supports_pp

    # ---- declared-only flags ---------------------------------------------------------------------------------

    supports_thd = _declared_flag("supports_thd")
    supports_mtp_cp = _declared_flag("supports_mtp_cp")
    supports_mtp_cp_pp = _declared_flag("supports_mtp_cp_pp")
    supports_cp_vision_frame_sharding = _declared_flag("supports_cp_vision_frame_sharding")

    # ---- sequence packing ------------------------------------------------------------------------------------

    @property
    def supports_sequence_packing(self) -> bool:
        """``forward`` takes ``seq_lens`` (or ``**kwargs``) and the attention path handles packed sequences.

        A hybrid model without a ``backend`` (the HuggingFace implementation) is excluded: its Mamba scan does
        not reset state at document boundaries, so packed documents would leak into each other.
        """
        model = self.model
        if not _supports_seq_lens(model) or not _has_packing_attention(model):
            return False
        return _has_backend(model) or contract_of(model).cp.owns_packed_attention or not is_hybrid_model(model)

    @property
    def supports_cp_with_sequence_packing(self) -> bool:
        """Packing under this mesh's CP size: trivially when ``cp_size <= 1``, else a packed-CP attention path."""
        if not self.supports_sequence_packing:
            return False
        if self.cp_size <= 1:
            return True
        model = self.model
        cp = (contract := contract_of(model)).cp
        if cp.packed_attention_backends is not None:
            return _supports_seq_lens(model) and _attn_backend(model) in cp.packed_attention_backends
        return cp.owns_attention or _uses_te_attention(model, contract) or _uses_magi_attention(model)

    # ---- training / inference features -----------------------------------------------------------------------

    @property
    def supports_gradient_checkpointing(self) -> bool:
        """The first plain class-level ``supports_gradient_checkpointing`` value in the MRO decides (properties and
        methods skipped), on every mesh.

        A class that declares True states that a recomputed decoder layer equals its first pass on every mesh it
        accepts. Under expert parallelism that holds for am-moe's layers: a non-reentrant recompute re-issues the
        all-to-all in the same order on every rank, and the load counts, bias-update counts and aux-loss sums skip
        the recomputed forward (tested in the trainer's parity runs at dp 2 x ep 2). Upstream's veto at
        ``ep_size > 1`` is ``am_capabilities.upstream.ModelSupports``."""
        return _plain_class_value(type(self.model), "supports_gradient_checkpointing") is True

    @property
    def supports_generate(self) -> bool:
        return callable(getattr(self.model, "generate", None))

    @property
    def mtp_enabled(self) -> bool:
        """Live value of ``model.mtp_config.enabled`` (False without an MTP config)."""
        return getattr(getattr(self.model, "mtp_config", None), "enabled", False) is True

    @property
    def is_custom_model(self) -> bool:
        """Whether the model class (or a base) is registered as a custom model (entry point or register_model)."""
        return is_registered_model_class(self._model_cls)

    # ---- copying / printing ----------------------------------------------------------------------------------

    def __repr__(self) -> str:
        flags = ", ".join(f"{_short(name)}={getattr(self, name)}" for name in self._FLAGS)
        mesh = "" if self._mesh is None else f", mesh={self._mesh}"
        return f"ModelSupports({self._model_cls.__name__}: {flags}{mesh})"

    def __copy__(self) -> ModelSupports:
        return self if self._weak is not None else type(self)(self.model, self._mesh)

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelSupports:
        # Copying the model is the model's business: a plain ModelSupports copy still describes the same model. A
        # model's own `supports` travels inside a deep copy of the model (e.g. a pipeline stage): `copy` has put
        # the model's copy in `memo` before copying its attributes, so the copy's `supports` describes the copy.
        if self._weak is None:
            return type(self)(self.model, self._mesh)
        model = self.model
        return attached_view(memo.get(id(model), model), self._mesh)

    def __reduce__(self) -> Any:
        # A weak reference cannot be pickled: a model's own `supports` is rebuilt around the unpickled model, so
        # the bytes hold the mesh only.
        return (type(self) if self._weak is None else attached_view, (self.model, self._mesh))


def attached_view(model: nn.Module, mesh: MeshContext | None) -> ModelSupports:
    """The ``ModelSupports`` that ``attach_capabilities_and_validate`` stores on ``model``: it refers to the model
    weakly, so the model is still freed by reference counting alone."""
    view = ModelSupports(model)
    view._strong, view._weak, view._mesh = None, weakref.ref(model), mesh
    return view


def _short(name: str) -> str:
    return name.removeprefix("supports_")
