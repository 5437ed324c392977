"""What a live model instance supports, derived by introspection: the predicates and one decision per axis.

``ModelSupports`` (``supports.py``) reports these decisions; ``validate_for_mesh`` (``validation.py``) refuses by them.

What a model offers is read from its contract (`am_model_contract.contract_of`: the model's `am_contract()`, or the
contract its transformers / NeMo AutoModel class attributes describe), plus public runtime state (`model.backend.attn`,
the config's block types and expert counts, `forward`'s signature); no model package, trainer or transformers is
imported, and no private model attribute is read here. Each parallel axis is decided by one ``_decide_<axis>``
function that returns a verdict *with its reason and fix*, so ``ModelSupports`` and ``validate_for_mesh`` can never
disagree.

Rule between declared and introspected capabilities: when the model class declares capabilities
(``ModelCapabilities`` / ``get_capabilities``, see ``declarative``), the declaration decides TP and PP
outright — it is the model author's statement, and the structural heuristics (plans, MoE marker) only stand
in for it on undeclared models. For CP and EP a declaration of ``False`` vetoes, and ``True`` still needs the
implementation on this instance: a CP-capable attention backend (a runtime choice the class cannot vouch for),
and for EP the contract's ``ep.apply`` hook (``implements_expert_parallelism``: without it nothing shards the
experts).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch.nn as nn

from am_model_contract import ModelContract, contract_of
from am_tensor_parallel import tp_problems

from .declarative import ModelCapabilities, declared_capabilities

__all__ = [
    "EXPERT_PARALLEL_HOOK",
    "expert_split_problem",
    "implements_expert_parallelism",
    "is_hybrid_model",
    "tp_split_problem",
]

# Block-type names of state-space / linear-attention layers, in both NemotronH vocabularies
# (NVIDIA checkpoints: "mamba"; transformers >= 5.13: "linear_attention") plus the pattern letter "M".
_HYBRID_BLOCK_NAMES = frozenset({"m", "mamba", "mamba2", "linear_attention"})
# Names that are layer kinds but not hybrid; a string equal to one of them is a name, not a pattern.
_PLAIN_BLOCK_NAMES = frozenset({"attention", "full_attention", "sliding_attention", "mlp", "moe", "e", "*", "-"})
_HYBRID_CONFIG_FIELDS = ("layers_block_type", "hybrid_override_pattern", "layer_types")

_TE = "te"
# The method our model classes implement expert parallelism with, and declare as their contract's `ep.apply` (see
# `implements_expert_parallelism`).
EXPERT_PARALLEL_HOOK = "apply_expert_parallel"
# Config fields holding a layer's number of routed experts (DeepSeek/Nemotron-H, Gemma 4/Qwen, Mixtral names).
_EXPERT_COUNT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")
_MAGI = "magi"


class _Verdict(NamedTuple):
    """One capability decision: whether it holds, and when it does not, why and how to fix it."""

    ok: bool
    reason: str = ""
    fix: str = ""


# --------------------------------------------------------------------------------------------------------------
# Predicates over the duck-typed protocol
# --------------------------------------------------------------------------------------------------------------


def _field(obj: Any, name: str) -> Any:
    """``obj.name`` or ``obj[name]`` for mapping-shaped configs; ``None`` when absent."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _candidate_configs(model: nn.Module) -> Iterator[Any]:
    """The model's config, its text sub-config, and the configs of an inner ``language_model``."""
    seen: set[int] = set()
    holders = [model, getattr(model, "model", None)]
    roots = [_field(model, "config")]
    roots += [_field(_field(holder, "language_model"), "config") for holder in holders]
    for root in roots:
        for config in (root, _field(root, "text_config")):
            if config is not None and id(config) not in seen:
                seen.add(id(config))
                yield config


def _has_hybrid_marker(value: Any) -> bool:
    """Whether a block-type field (pattern string, single name, or sequence of names) names Mamba/SSM layers."""
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _HYBRID_BLOCK_NAMES:
            return True
        if lowered in _PLAIN_BLOCK_NAMES:
            return False
        return "m" in lowered  # a pattern string such as "M*M-E": one character per layer
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, str) and item.strip().lower() in _HYBRID_BLOCK_NAMES for item in value)
    return False


def is_hybrid_model(model: nn.Module) -> bool:
    """Whether the model mixes attention with Mamba / SSM / linear-attention layers.

    Reads ``layers_block_type``, ``hybrid_override_pattern`` and ``layer_types`` on the model config, its
    ``text_config`` and an inner ``language_model.config``; also ``is_hybrid_model is True``. Both NemotronH
    vocabularies count: names ``"mamba"`` / ``"linear_attention"`` in a list, and ``"M"`` (any case) in a
    pattern string. (Upstream matched only single-letter ``"M"`` entries, so a list of names was missed.)
    """
    for config in _candidate_configs(model):
        if _field(config, "is_hybrid_model") is True:
            return True
        if any(_has_hybrid_marker(_field(config, name)) for name in _HYBRID_CONFIG_FIELDS):
            return True
    return False


def _attn_backend(model: nn.Module) -> str | None:
    """``model.backend.attn`` for custom models; ``None`` for models without a backend (HuggingFace)."""
    attn = getattr(getattr(model, "backend", None), "attn", None)
    return None if attn is None else str(attn)


def _has_backend(model: nn.Module) -> bool:
    return hasattr(getattr(model, "backend", None), "attn")


def _uses_te_attention(model: nn.Module, contract: ModelContract) -> bool:
    return _attn_backend(model) == _TE or contract.cp.te_attention


def _uses_magi_attention(model: nn.Module) -> bool:
    return _attn_backend(model) == _MAGI


def implements_expert_parallelism(model: nn.Module) -> bool:
    """Whether the model implements expert parallelism: its contract has an ``ep.apply(ep_mesh)`` hook (what a
    trainer calls to shard the experts over the ep ranks). The one rule every EP decision uses; being a
    mixture-of-experts model (``ep.is_moe``) or declaring ``supports_ep=True`` is not enough — without the hook
    nothing would shard the experts, and ``ep_size > 1`` would silently run replicated experts."""
    return contract_of(model).ep.apply is not None


def _supports_seq_lens(model: nn.Module) -> bool:
    """Whether ``forward`` accepts ``seq_lens`` (explicitly or through ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "seq_lens" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _plain_class_value(cls: type, name: str) -> Any:
    """The first plain (non-descriptor) value of ``name`` in the MRO's own dicts; properties etc. are skipped."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            if not hasattr(type(value), "__get__"):
                return value
    return None


# --------------------------------------------------------------------------------------------------------------
# Axis decisions
# --------------------------------------------------------------------------------------------------------------


def _declared(model: nn.Module) -> ModelCapabilities | None:
    return declared_capabilities(type(model), getattr(model, "config", None))


def _veto(declared: ModelCapabilities | None, flag: str, axis: str) -> _Verdict | None:
    if declared is not None and not getattr(declared, flag):
        return _Verdict(False, f"its capability declaration says {flag}=False", f"set {axis}_size=1")
    return None


def _decide_tp(model: nn.Module, declared: ModelCapabilities | None) -> _Verdict:
    if declared is not None:
        return _veto(declared, "supports_tp", "tp") or _Verdict(True)
    if contract_of(model).tp.plan:  # an empty plan (`{}`) declares nothing
        return _Verdict(True)
    return _Verdict(
        False,
        "it has no TP plan (`_tp_plan` / its contract's tp.plan is missing or empty) and declares no capabilities",
        "set tp_size=1, or give the model a non-empty `_tp_plan`",
    )


def tp_split_problem(model: nn.Module, tp_size: int) -> str | None:
    """Why the model's tensor-parallel plan cannot shard it over ``tp_size`` ranks (``None`` when it can, or for
    ``tp_size`` 1).

    The rule is am-tensor-parallel's ``tp_problems`` (the one that ``plan_tensor_parallel`` enforces before any
    collective): the plan the model declares (its contract's ``tp.plan``: ``_tp_plan`` class attributes and
    ``config.base_model_tp_plan`` merged as transformers does; else an instance ``_tp_plan``) must exist, name
    supported styles and existing modules, and every sharded size must divide (features, vocabulary, attention and
    KV heads, the model's own checks such as Mamba2 groups). Reads the model only (works on the meta device).
    """
    if tp_size <= 1 or not (problems := tp_problems(model, tp_size)):  # the plan the model declares
        return None
    return f"its tensor-parallel plan cannot shard it over tp_size={tp_size} ({'; '.join(problems)})"


def _decide_pp(model: nn.Module, declared: ModelCapabilities | None) -> _Verdict:
    if declared is not None:
        return _veto(declared, "supports_pp", "pp") or _Verdict(True)
    contract = contract_of(model)
    if contract.pp.plan or contract.ep.is_moe:
        return _Verdict(True)
    return _Verdict(
        False,
        "pipeline parallelism requires a _pp_plan attribute, but `_pp_plan` is missing or empty and it declares no "
        "capabilities",
        "set pp_size=1, or give the model a non-empty `_pp_plan`",
    )


def _decide_ep(model: nn.Module, declared: ModelCapabilities | None) -> _Verdict:
    if (vetoed := _veto(declared, "supports_ep", "ep")) is not None:
        return vetoed
    if implements_expert_parallelism(model):
        return _Verdict(True)
    said = "its capability declaration says supports_ep=True, but " if declared is not None else ""
    return _Verdict(
        False,
        f"{said}it has no `{EXPERT_PARALLEL_HOOK}(ep_mesh)` method, so nothing would shard its experts over the ep "
        "ranks and send tokens to them (its contract's ep.apply is None)",
        f"set ep_size=1 (every data-parallel rank then holds all experts), or use a model class whose contract "
        f"declares `ep.apply={EXPERT_PARALLEL_HOOK}` (e.g. am_models_nemotron.NemotronHForCausalLM or "
        "am_models_gemma4's MoE models)",
    )


def expert_split_problem(model: nn.Module, ep_size: int) -> str | None:
    """Why the model's experts cannot be split over ``ep_size`` ranks (``None`` when they can or are unknown).

    Reads the expert count of every config the model carries (``n_routed_experts``, ``num_experts``,
    ``num_local_experts``; see ``_candidate_configs``); each must be divisible by ``ep_size``.
    """
    first_name: dict[int, str] = {}  # one field per distinct count (configs often alias the same number)
    for name, count in _expert_counts(model):
        first_name.setdefault(count, name)
    uneven = [f"{name}={count}" for count, name in sorted(first_name.items()) if count % ep_size]
    if not uneven:
        return None
    return (
        f"its experts cannot be split evenly over ep_size={ep_size} ranks ({', '.join(uneven)} "
        f"not divisible by {ep_size})"
    )


def _expert_counts(model: nn.Module) -> Iterator[tuple[str, int]]:
    for config in _candidate_configs(model):
        for name in _EXPERT_COUNT_FIELDS:
            count = _field(config, name)
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                yield name, count


def _decide_cp(model: nn.Module, declared: ModelCapabilities | None) -> _Verdict:
    if (vetoed := _veto(declared, "supports_cp", "cp")) is not None:
        return vetoed
    cp = (contract := contract_of(model)).cp
    if cp.owns_attention:
        return _Verdict(True)
    attn = _attn_backend(model)
    hybrid = is_hybrid_model(model)
    if _has_backend(model):
        own_backends = cp.attention_backends
        allowed = own_backends if own_backends is not None else (_TE, "sdpa") if hybrid else (_TE, _MAGI)
        if attn in allowed or (_TE in allowed and _uses_te_attention(model, contract)):
            return _Verdict(True)
        kind = "hybrid model" if hybrid and own_backends is None else "model"
        return _Verdict(
            False,
            f"this {kind} runs context-parallel attention only with backend.attn in {list(allowed)}, got {attn!r}",
            f"set cp_size=1, or set backend.attn to one of {list(allowed)}",
        )
    if hybrid:
        return _Verdict(
            False,
            "it is a hybrid model with Mamba/SSM layers, and its implementation has no context-parallel path "
            "for them (no `backend`, and its contract does not say it owns its CP attention)",
            "set cp_size=1, or use an implementation that owns its CP (e.g. am-models-nemotron)",
        )
    if cp.sdpa_attention:
        return _Verdict(True)
    return _Verdict(
        False,
        "it declares neither `_supports_sdpa = True` (ring attention over SDPA) nor that it owns its CP attention "
        "(contract cp.owns_attention)",
        "set cp_size=1, or use a model with SDPA attention",
    )


def _has_packing_attention(model: nn.Module) -> bool:
    attn = _attn_backend(model)
    cp = (contract := contract_of(model)).cp
    return (
        cp.sdpa_attention
        or _uses_te_attention(model, contract)
        or _uses_magi_attention(model)
        or (attn is not None and attn in (cp.packed_attention_backends or ()))
        or cp.owns_packed_attention
    )


_decide: dict[str, Callable[[nn.Module, ModelCapabilities | None], _Verdict]] = {
    "tp": _decide_tp,
    "pp": _decide_pp,
    "cp": _decide_cp,
    "ep": _decide_ep,
}
