"""Validation before any collective: every reason a plan cannot shard a model at a tp size, listed at once.

`tp_problems(model, tp, plan=None)` is pure (no process group) so a launcher can refuse a bad layout before it
starts ranks; `plan_tensor_parallel` raises the same problems as one ValueError or returns the frozen
`TensorParallelPlan` that `apply_tensor_parallel` reads. KV heads are never replicated: a tp that does not divide the
KV heads is refused (sharding `k_proj` by features would cut heads in half), as transformers refuses to shard them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from torch import nn

from .plan import TensorParallelPlan, declared_plan, match_plan
from .styles import (
    COLWISE_STYLES,
    EMBEDDING_STYLES,
    LINEAR_STYLES,
    MODULE_STYLE_METHOD,
    PROBLEMS_METHOD,
    STYLES,
    UNSUPPORTED_STYLES,
    canonical_style,
)

__all__ = ["HEAD_COUNT_ATTRIBUTES", "plan_tensor_parallel", "tp_problems"]

# Instance attributes of attention modules that count heads; divided by tp when the projections are head-sharded.
HEAD_COUNT_ATTRIBUTES = (
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_heads",
    "n_kv_heads",
)
_Q = ("q_proj", "query", "wq")
_KV = ("k_proj", "v_proj", "key", "value", "wk", "wv")
_FUSED_QKV = ("qkv_proj", "query_key_value", "Wqkv", "c_attn")
_SHARDED_OUTPUT = frozenset({"colwise", "local_colwise", "packed_colwise"})  # output stays this rank's shard


def tp_problems(
    model: nn.Module,
    tp: int,
    plan: Mapping[str, str] | None = None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> list[str]:
    """Every reason `plan` (default: the model's declared plan) cannot shard `model` over `tp` ranks; [] if none.

    Checks: a plan exists; style names are known and supported; every pattern matches a module; styles fit the
    module kinds; feature, vocabulary and embedding sizes divide by tp; attention and KV heads divide by tp where
    q/k/v are sharded by heads; tied input/output embeddings get the same sharding; sequence / loss parallelism find
    what they need. Reads the model only (works on the meta device).
    """
    return _analyse(model, tp, plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)[0]


def plan_tensor_parallel(
    model: nn.Module,
    *,
    tp: int,
    plan: Mapping[str, str] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> TensorParallelPlan:
    """Validate and freeze: the `TensorParallelPlan` for `model` at `tp`.

    Raises:
        ValueError: listing every problem `tp_problems` finds.
    """
    problems, frozen = _analyse(model, tp, plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if problems:
        raise ValueError(
            f"cannot apply tensor parallelism (tp={tp}) to {type(model).__name__}:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    assert frozen is not None
    return frozen


def _analyse(
    model: nn.Module, tp: Any, plan: Mapping[str, str] | None, *, sequence_parallel: bool, loss_parallel: bool
) -> tuple[list[str], TensorParallelPlan | None]:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return [f"tp must be a positive int, got {tp!r}"], None
    raw = dict(plan) if plan is not None else declared_plan(model)
    if not raw:
        where = "the plan passed is empty"
        if plan is None:
            where = (
                f"{type(model).__name__} declares no tensor-parallel plan (no `_tp_plan` class attribute, no "
                "`config.base_model_tp_plan`)"
            )
        return [f"{where}: pass plan={{module pattern: style}} or run with tp=1"], None
    problems: list[str] = []
    for key, style in raw.items():
        if style in UNSUPPORTED_STYLES:
            problems.append(f"{key!r}: style {style!r} is not supported: {UNSUPPORTED_STYLES[style]}")
        elif style not in STYLES:
            problems.append(f"{key!r}: unknown style {style!r}; known styles: {', '.join(sorted(STYLES))}")
    styles, unmatched = match_plan(model, raw)
    problems += [f"plan pattern {k!r} ({raw[k]!r}) matches no module of {type(model).__name__}" for k in unmatched]
    modules = dict(model.named_modules())

    # module kinds and sizes
    for name, style in styles.items():
        if style not in STYLES:
            continue
        module, base = modules[name], canonical_style(style)
        if style in LINEAR_STYLES:
            if not isinstance(module, nn.Linear):
                problems.append(f"{name}: style {style!r} shards nn.Linear modules, not {type(module).__name__}")
                continue
            parts = 2 if style.startswith("packed") else 1
            size, side = (module.out_features, "output") if style in COLWISE_STYLES else (module.in_features, "input")
            if size % (tp * parts):
                extra = f" ({parts} packed parts, each split over tp)" if parts > 1 else ""
                problems.append(
                    f"{name}: {style!r} splits its {size} {side} features over tp={tp}{extra}: not divisible; choose a "
                    f"tp that divides {size // parts} or give it 'replicate'"
                )
        elif style in EMBEDDING_STYLES:
            if not isinstance(module, nn.Embedding):
                problems.append(f"{name}: style {style!r} shards nn.Embedding modules, not {type(module).__name__}")
                continue
            size, what = (
                (module.num_embeddings, "vocabulary entries")
                if base == "embedding_rowwise"
                else (module.embedding_dim, "embedding features")
            )
            if size % tp:
                problems.append(
                    f"{name}: {style!r} splits its {size} {what} over tp={tp}: not divisible; pad the vocabulary "
                    f"to a multiple of {tp} or give it 'replicate'"
                )

    # modules that shard themselves, and every module's own validation hook (the model's included)
    for name, style in styles.items():
        if style == "module" and not callable(getattr(modules[name], MODULE_STYLE_METHOD, None)):
            problems.append(
                f"{name}: style 'module' needs {type(modules[name]).__name__}.{MODULE_STYLE_METHOD}(*, "
                "sequence_parallel) (the module's own ParallelStyle); it has none"
            )
    for name, module in modules.items():
        hook = getattr(module, PROBLEMS_METHOD, None)
        if callable(hook):
            where = f"{name}: " if name else ""
            problems += [where + p for p in hook(tp, sequence_parallel=sequence_parallel)]

    # heads: q/k/v sharded by features must be sharded by whole heads
    config = _text_config(model)
    head_counts: dict[str, dict[str, int]] = {}
    for parent in sorted({n.rpartition(".")[0] for n in styles}):
        children = {n.rpartition(".")[2]: s for n, s in styles.items() if n.rpartition(".")[0] == parent}
        for fused in _FUSED_QKV:
            if children.get(fused) in _SHARDED_OUTPUT:
                problems.append(
                    f"{parent}.{fused}: a fused q/k/v projection sharded {children[fused]!r} would give each rank a "
                    "contiguous slice of [q; k; v], not its heads; use 'colwise_rep' (gathered) for it"
                )
        q_sharded = any(children.get(q) in _SHARDED_OUTPUT for q in _Q)
        kv_sharded = any(children.get(k) in _SHARDED_OUTPUT for k in _KV)
        if not (q_sharded or kv_sharded):
            continue
        attention = modules.get(parent)
        heads, kv_heads = _head_counts(attention, config)
        if q_sharded and isinstance(heads, int) and heads % tp:
            problems.append(
                f"{parent}: {heads} attention heads cannot be split over tp={tp} (q_proj is sharded by heads); "
                f"choose a tp that divides {heads}"
            )
        if kv_sharded and isinstance(kv_heads, int) and kv_heads % tp:
            problems.append(
                f"{parent}: {kv_heads} key/value heads cannot be split over tp={tp} (k_proj/v_proj are sharded by "
                f"heads; replicating KV heads is not supported); choose a tp that divides {kv_heads}"
            )
        local = {
            attr: value // tp for attr in HEAD_COUNT_ATTRIBUTES if _is_count(value := getattr(attention, attr, None))
        }
        if local:
            head_counts[parent] = local

    # input embedding / output head, tied weights
    embedding, head = _named(model, "get_input_embeddings", modules), _named(model, "get_output_embeddings", modules)
    tied = None
    if embedding and head:
        emb_w, head_w = getattr(modules[embedding], "weight", None), getattr(modules[head], "weight", None)
        if emb_w is not None and emb_w is head_w:
            tied = (embedding, head)
            emb_style = canonical_style(styles.get(embedding, "replicate"))
            head_style = canonical_style(styles.get(head, "replicate"))
            shards_vocab = (emb_style == "embedding_rowwise", head_style in {"colwise", "colwise_rep"})
            if shards_vocab[0] != shards_vocab[1] or (emb_style, head_style) == ("embedding_colwise", "replicate"):
                problems.append(
                    f"{embedding} and {head} share one weight (tied embeddings) but the plan shards it differently "
                    f"({styles.get(embedding, 'no style')!r} vs {styles.get(head, 'no style')!r}): give {embedding} "
                    f"'embedding_rowwise' and {head} 'colwise_rep' (both shard the vocabulary), or neither a style"
                )

    if loss_parallel:
        if not head or canonical_style(styles.get(head, "")) not in {"colwise", "colwise_rep"}:
            problems.append(
                "loss_parallel=True needs an output head sharded by vocabulary ('colwise' or 'colwise_gather_output' "
                f"on {head or 'get_output_embeddings()'}), found {styles.get(head, 'no style')!r}"
            )
        else:
            styles[head] = "colwise"

    # modules that open a TP region (parents of colwise projections): their input enters once for all projections
    region_inputs = sorted(
        {n.rpartition(".")[0] for n, s in styles.items() if s in COLWISE_STYLES and n != head} - {""}
    )
    norms: list[str] = []
    if not sequence_parallel:
        problems += [
            f"{name}: style 'sequence_parallel' needs sequence_parallel=True (its output is a sequence shard)"
            for name, style in styles.items()
            if style == "sequence_parallel"
        ]
    else:
        if not embedding:
            problems.append("sequence_parallel=True needs the model's input embedding (get_input_embeddings())")
        if not head or head not in styles:
            problems.append(
                "sequence_parallel=True needs an output head in the plan (get_output_embeddings() with a colwise "
                "style): its input is gathered from the sequence shards"
            )
        for name, style in styles.items():
            if canonical_style(style) in {"local_rowwise", "gather"}:
                problems.append(
                    f"{name}: {style!r} sums a replicated output, which sequence parallelism cannot shard; use "
                    "'colwise'/'rowwise' or sequence_parallel=False"
                )
        # a module's inside is its own ("module"), or runs on whole sequences ("sequence_gather"): no stream norms
        owned = region_inputs + [n for n, s in styles.items() if s in ("module", "sequence_gather")]
        for name, module in modules.items():
            inside = any(name.startswith(r + ".") for r in owned)
            if name and name not in styles and not inside and _is_norm(module):
                norms.append(name)
        norms += [n for n, s in styles.items() if s == "sequence_parallel"]

    if problems:
        return problems, None
    return [], TensorParallelPlan(
        tp=tp,
        styles=styles,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        input_embedding=embedding,
        output_head=head,
        norms=tuple(sorted(set(norms))),
        region_inputs=tuple(region_inputs),
        head_counts=head_counts,
        tied=tied,
    )


def _head_counts(attention: nn.Module | None, config: Any) -> tuple[Any, Any]:
    """(query heads, key/value heads) of one attention: the module's own counts when it keeps them (layers of one
    model may differ: Gemma 4's full layers have `num_global_key_value_heads`), else the config's."""
    own = [getattr(attention, a, None) for a in ("num_heads", "num_attention_heads", "n_heads")]
    own_kv = [getattr(attention, a, None) for a in ("num_key_value_heads", "num_kv_heads", "n_kv_heads")]
    cfg = getattr(attention, "config", None) or config
    heads = next((v for v in own if _is_count(v)), None) or getattr(cfg, "num_attention_heads", None)
    kv_heads = next((v for v in own_kv if _is_count(v)), None) or getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv_heads


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_config(model: nn.Module) -> Any:
    config: Any = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _named(model: nn.Module, getter: str, modules: dict[str, nn.Module]) -> str:
    """The name of the module `model.<getter>()` returns; without the getter, the output head is transformers'
    conventional `lm_head` (a model need not define `get_output_embeddings` to have its tied head found)."""
    fn = getattr(model, getter, None)
    target = fn() if callable(fn) else None
    if target is None:
        return "lm_head" if getter == "get_output_embeddings" and isinstance(modules.get("lm_head"), nn.Linear) else ""
    return next((name for name, module in modules.items() if module is target and name), "")


def _is_norm(module: nn.Module) -> bool:
    """A normalization layer of the residual stream: torch's LayerNorm / RMSNorm or a class named `...Norm`."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")
