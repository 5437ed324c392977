"""The contract of a model that declares none: what its transformers and NeMo AutoModel class attributes say.

What it is for: an unmodified HuggingFace model (or one written against NeMo AutoModel) declares what it offers
through class attributes; `conventional_contract` translates them, once, into a `ModelContract`:

    transformers:  `_supports_sdpa` -> cp.sdpa_attention,  `_pp_plan` -> pp.plan,
                   `_tp_plan` of every module class + `config.base_model_tp_plan` -> tp.plan (`declared_tp_plan`)
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

from .contract import ContextParallelContract, ModelContract, PipelineContract, TensorParallelContract

__all__ = ["conventional_contract", "declared_tp_plan"]


def _plan(value: Any) -> dict[str, Any] | None:
    # transformers >= 5 always sets an instance plan, `{}` when the model has none: an empty plan declares nothing.
    return dict(value) if isinstance(value, Mapping) and value else None


def _names(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(v) for v in value)


def declared_tp_plan(model: Any) -> dict[str, str] | None:
    """The tensor-parallel plan `model`'s classes declare, with full module-name patterns; None when none does.

    transformers' merge (`init_parallel_plans`): each module's class attribute `_tp_plan` (patterns relative to that
    module; the key `""` is the module itself) under the module's name, plus, for a base model (an HF
    `PreTrainedModel` whose `base_model` is itself), `config.base_model_tp_plan`, with `embed_tokens:
    embedding_rowwise` first when the plan is not empty and `embed_tokens` is an `nn.Embedding` (as transformers adds
    it). An object whose classes declare nothing falls back to its instance `_tp_plan` (a plan set by hand). Models
    that declare `am_contract` pass this as their `tp.plan`, so every reader sees one merged plan.
    """
    # a class (its flags read before any instance exists) has no modules to walk: its own `_tp_plan` only
    walk = not isinstance(model, type) and callable(getattr(model, "named_children", None))
    plan = _declared_tp(model, "") if walk else {}
    return plan or _plan(getattr(model, "_tp_plan", None))


def _is_embedding(module: Any) -> bool:
    # isinstance(module, torch.nn.Embedding) without importing torch (this package needs the standard library only)
    return any(c.__name__ == "Embedding" and c.__module__.startswith("torch.nn.") for c in type(module).__mro__)


def _declared_tp(module: Any, prefix: str) -> dict[str, str]:
    own = dict(getattr(type(module), "_tp_plan", None) or {})
    config = getattr(module, "config", None)
    if hasattr(module, "base_model_prefix") and getattr(module, "base_model", None) is module and config is not None:
        own.update(getattr(config, "base_model_tp_plan", None) or {})
        if own and _is_embedding(getattr(module, "embed_tokens", None)) and "embed_tokens" not in own:
            own = {"embed_tokens": "embedding_rowwise", **own}
    # "" names the module itself (a module whose class declares how it shards as a whole, style "module")
    plan = {(prefix + key) if key else prefix.rstrip("."): style for key, style in own.items()}
    for name, child in module.named_children():
        plan.update(_declared_tp(child, f"{prefix}{name}."))
    return plan


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
    return ModelContract(cp=cp, pp=pp, tp=TensorParallelContract(plan=declared_tp_plan(model)))
