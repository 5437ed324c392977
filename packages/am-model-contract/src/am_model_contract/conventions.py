"""The contract of a model that declares none: what its transformers and NeMo AutoModel class attributes say.

What it is for: an unmodified HuggingFace model (or one written against NeMo AutoModel) declares what it offers
through class attributes; `conventional_contract` translates them, once, into a `ModelContract`:

    transformers:  `_supports_sdpa` -> cp.sdpa_attention,  `_pp_plan` -> pp.plan,  `_tp_plan` -> tp.plan
    NeMo AutoModel (seed-documented opt-in flags):  `_owns_cp_attention` -> cp.owns_attention,
                   `_supports_cp_sdpa` -> cp.attention_backends=("te", "sdpa"),  `_owns_packed_attention` ->
                   cp.owns_packed_attention,  `_packed_cp_attn_backends` -> cp.packed_attention_backends,
                   `_te_attention_injected` -> cp.te_attention,  `_pp_keep_self_forward` -> pp.keeps_own_forward

What it must not do: be read by a model that declares `am_contract` (its declaration is complete), or read anything
else: this module is the one place in the am-* packages that reads these private names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract import (
    ContextParallelContract,
    ModelContract,
    PipelineContract,
    TensorParallelContract,
)

__all__ = ["conventional_contract"]


def _plan(value: Any) -> Mapping[str, Any] | None:
    # transformers >= 5 always sets an instance plan, `{}` when the model has none: an empty plan declares nothing.
    return dict(value) if isinstance(value, Mapping) and value else None


def _names(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(v) for v in value)


def conventional_contract(model: Any) -> ModelContract:
    """The contract the class attributes of `model` describe (see the module docstring); all defaults for an object
    that has none. `_pp_keep_self_forward` is read from the class, as NeMo AutoModel reads it."""
    cp = ContextParallelContract(
        owns_attention=getattr(model, "_owns_cp_attention", False) is True,
        attention_backends=("te", "sdpa") if getattr(model, "_supports_cp_sdpa", False) is True else None,
        sdpa_attention=getattr(model, "_supports_sdpa", None) is True,
        te_attention=getattr(model, "_te_attention_injected", False) is True,
        owns_packed_attention=getattr(model, "_owns_packed_attention", False) is True,
        packed_attention_backends=_names(getattr(model, "_packed_cp_attn_backends", None)),
    )
    pp = PipelineContract(
        plan=_plan(getattr(model, "_pp_plan", None)),
        keeps_own_forward=bool(getattr(type(model), "_pp_keep_self_forward", False)),
    )
    return ModelContract(cp=cp, pp=pp, tp=TensorParallelContract(plan=_plan(getattr(model, "_tp_plan", None))))
