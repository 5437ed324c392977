"""What an HF causal LM's own forward does around its layers, so the pipeline forwards reproduce it or refuse it.

HF decoders apply a few transforms outside their decoder layers: an embedding multiplier (Granite), an embedding
dropout (StarCoder2), a logit scaling (Granite divides, Cohere multiplies), a final logit soft-capping (Gemma 2/3/4).
Transforms inside the layers (Granite's residual/attention multipliers, Gemma's attention soft-capping) or inside
the embedding module (Gemma's `sqrt(hidden)` normaliser, a `*ScaledWordEmbedding`) travel with the modules and need
nothing here. The pipeline forwards apply every active entry of `FORWARD_TRANSFORMS` (read from the text config),
in table order, at the place the model does.

`pipeline_forward_problems(model)` is the one rule deciding whether the generic forwards can reproduce a model:
config keys of forward-level features they cannot reproduce (`UNSUPPORTED_FORWARD_FEATURES`), unknown config keys
whose names say "embedding/logit scaling" (unless declared in `LAYER_LEVEL_CONFIG_KEYS`), and child modules of the
decoder or of the causal-LM wrapper that the generic forwards would not run (`final_layernorm`, `embed_dropout`,
an `embedding_norm`, ...). Architectures with their own registered forwards answer for their text module themselves.

Never imports a model package of this repository or transformers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ForwardTransform",
    "FORWARD_TRANSFORMS",
    "LAYER_LEVEL_CONFIG_KEYS",
    "UNSUPPORTED_FORWARD_FEATURES",
    "GENERIC_TEXT_MODULES",
    "GENERIC_CAUSAL_LM_MODULES",
    "active_forward_transforms",
    "apply_embedding_transforms",
    "apply_logit_transforms",
    "pipeline_forward_problems",
]


def _multiply(x: torch.Tensor, value: Any, training: bool) -> torch.Tensor:
    return x * value


def _divide(x: torch.Tensor, value: Any, training: bool) -> torch.Tensor:
    return x / value


def _softcap(x: torch.Tensor, value: Any, training: bool) -> torch.Tensor:
    # Same two steps (and rounding) as transformers: divide, tanh, multiply.
    return torch.tanh(x / value) * value


def _dropout(x: torch.Tensor, value: Any, training: bool) -> torch.Tensor:
    return nn.functional.dropout(x, p=float(value), training=training)


@dataclass(frozen=True)
class ForwardTransform:
    """One forward-level transform an HF model applies outside its layers, keyed by the config attribute it reads.

    Attributes:
        config_key: attribute of the (text) config holding the value.
        where: "embeddings" (first stage, right after the token embedding) or "logits" (last stage, after the head).
        apply: `(tensor, value, training) -> tensor`.
        inactive: values meaning "not applied" (e.g. 1.0 for a multiplier, None/0 for a cap).
        feature: human name, for messages and docs.
    """

    config_key: str
    where: str
    apply: Callable[[torch.Tensor, Any, bool], torch.Tensor]
    inactive: tuple[Any, ...]
    feature: str


FORWARD_TRANSFORMS: list[ForwardTransform] = [
    ForwardTransform("embedding_multiplier", "embeddings", _multiply, (None, 1, 1.0), "embedding multiplier (Granite)"),
    ForwardTransform("embedding_dropout", "embeddings", _dropout, (None, 0, 0.0), "embedding dropout (StarCoder2)"),
    ForwardTransform("logits_scaling", "logits", _divide, (None, 1, 1.0), "logits divided by logits_scaling (Granite)"),
    ForwardTransform("logit_scale", "logits", _multiply, (None, 1, 1.0), "logits multiplied by logit_scale (Cohere)"),
    ForwardTransform(
        "final_logit_softcapping", "logits", _softcap, (None, 0, 0.0), "final logit soft-capping (Gemma 2/3/4)"
    ),
]
"""Forward-level transforms the pipeline forwards reproduce, applied in this order. Append an entry to support a
new config key applied the same way (no code branch)."""

UNSUPPORTED_FORWARD_FEATURES: dict[str, str] = {
    "use_bidirectional_attention": "bidirectional attention (the stages build causal masks)",
    "scale_emb": "MiniCPM embedding scaling (scale_emb)",
    "dim_model_base": "MiniCPM logit scaling (hidden_size / dim_model_base)",
    "embedding_scale": "embedding scaling (embedding_scale)",
    "lm_head_multiplier": "LM-head multiplier (Falcon-H1)",
    "logits_mup_width_multiplier": "muP logit width multiplier",
}
"""Config keys of forward-level features the generic forwards cannot reproduce: a model whose value is active
(not None/False/0/1) is refused, naming the feature."""

LAYER_LEVEL_CONFIG_KEYS: set[str] = {
    "attention_multiplier",
    "residual_multiplier",
    "attn_logit_softcapping",
    "query_pre_attn_scalar",
    "moe_router_logit_softcapping",
    "final_w_init_variance_scale",
    "w_init_variance_scale",
    "router_logit_softcapping",
}
"""Config keys whose names look forward-level but that the decoder layers (or the weight init) apply themselves;
the generic forwards need nothing for them. Add a key here after checking that the model applies it in a layer."""

_SUSPICIOUS_KEY = re.compile(
    r"(emb|embed|embedding|logit|logits|lm_head|output|final)\w*(scal|multiplier|softcap|normaliz)"
    r"|(scal|multiplier|normaliz)\w*(emb|embed|embedding|logit|logits|lm_head)"
)
"""Names of config keys that suggest a transform of the embeddings or logits (checked when not in a table above)."""

GENERIC_TEXT_MODULES: frozenset[str] = frozenset({"embed_tokens", "layers", "norm", "rotary_emb"})
"""Children of a decoder the generic text forward runs; any other child with parameters or a forward is refused."""

GENERIC_CAUSAL_LM_MODULES: frozenset[str] = frozenset({"model", "lm_head"})
"""Children of a causal LM the generic causal-LM forward runs."""


def _is_inactive(value: Any, inactive: tuple[Any, ...]) -> bool:
    if isinstance(value, bool):
        return value is False
    if isinstance(value, (int, float)):  # bools are answered above
        return any(isinstance(i, (int, float)) and math.isclose(value, i) for i in inactive if i is not None)
    return value is None or any(value is i for i in inactive)


def _text_config(config: Any) -> Any:
    text_config = getattr(config, "text_config", None)
    return text_config if text_config is not None else config


def _config_items(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    to_dict = getattr(config, "to_dict", None)
    raw = to_dict() if callable(to_dict) else dict(getattr(config, "__dict__", {}))
    return {key: value for key, value in raw.items() if not key.startswith("_")}


def active_forward_transforms(config: Any, where: str) -> list[tuple[ForwardTransform, Any]]:
    """The `FORWARD_TRANSFORMS` entries of `where` ("embeddings" / "logits") active in `config`, with their values."""
    text_config = _text_config(config)  # None (no config): every value reads as None, inactive
    values = [(t, getattr(text_config, t.config_key, None)) for t in FORWARD_TRANSFORMS if t.where == where]
    return [(transform, value) for transform, value in values if not _is_inactive(value, transform.inactive)]


def apply_embedding_transforms(hidden: torch.Tensor, config: Any, *, training: bool) -> torch.Tensor:
    """Apply the model's active embedding transforms to token embeddings [B, S, H] (first stage only)."""
    for transform, value in active_forward_transforms(config, "embeddings"):
        hidden = transform.apply(hidden, value, training)
    return hidden


def apply_logit_transforms(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """Apply the model's active logit transforms (scaling, soft-capping) to logits [B, S, V] (last stage only)."""
    for transform, value in active_forward_transforms(config, "logits"):
        logits = transform.apply(logits, value, False)
    return logits


def _config_problems(config: Any) -> list[str]:
    handled = {t.config_key for t in FORWARD_TRANSFORMS}
    problems = []
    for key, value in sorted(_config_items(_text_config(config)).items()):
        if key in handled or key in LAYER_LEVEL_CONFIG_KEYS:
            continue
        if key in UNSUPPORTED_FORWARD_FEATURES:
            if not _is_inactive(value, (None, False, 0, 1)):
                problems.append(
                    f"{UNSUPPORTED_FORWARD_FEATURES[key]}: config.{key}={value!r} is applied by the model's own "
                    "forward, which the pipeline forwards do not reproduce. Fix: register a pipeline forward for "
                    "this model_type (`register_pipeline_forward`), or train without PP."
                )
        elif _SUSPICIOUS_KEY.search(key) and not _is_inactive(value, (None, False, 1)):
            problems.append(
                f"config.{key}={value!r} looks like a forward-level embedding/logit transform that the pipeline "
                "forwards do not know. Fix: if the model's forward applies it outside its layers, add a "
                "`ForwardTransform` to `am_pipelining.FORWARD_TRANSFORMS`; if its layers apply it, add the key to "
                "`am_pipelining.LAYER_LEVEL_CONFIG_KEYS`."
            )
    return problems


def _runs_something(module: nn.Module) -> bool:
    """True for children that change the computation if skipped: parameters, buffers, or an active dropout."""
    if isinstance(module, nn.Dropout):
        return module.p > 0
    return not isinstance(module, nn.Identity)


def _module_problems(owner: nn.Module, owner_name: str, known: frozenset[str], forward_name: str) -> list[str]:
    problems = []
    for child_name, child in owner.named_children():
        if child_name in known or not _runs_something(child):
            continue
        path = f"{owner_name}.{child_name}" if owner_name else child_name
        problems.append(
            f"{path} ({type(child).__name__}) is part of the model's own forward, but the {forward_name} only runs "
            f"{', '.join(sorted(known))}: skipping it would train a different model. Fix: register a pipeline "
            "forward for this model_type (`register_pipeline_forward`), or give the class a PP-aware forward and "
            "declare it (`am_contract()` with `PipelineContract(keeps_own_forward=True)`), or train without PP."
        )
    return problems


def pipeline_forward_problems(
    model: nn.Module, *, text_module: nn.Module | None, text_name: str, generic_text: bool, generic_outer: bool
) -> list[str]:
    """Every reason the generic pipeline forwards would not reproduce `model`'s own forward (empty: they do).

    `text_module` is the decoder the text forward is bound to (`text_name` its path); `generic_text` /
    `generic_outer` say whether the generic text / causal-LM forwards are used (a registered architecture forward
    answers for its own module).
    """
    problems: list[str] = []
    if generic_text:
        problems.extend(_config_problems(getattr(model, "config", None)))
        if text_module is not None:
            problems.extend(_module_problems(text_module, text_name, GENERIC_TEXT_MODULES, "generic text forward"))
    if generic_outer and text_module is not model:
        problems.extend(_module_problems(model, "", GENERIC_CAUSAL_LM_MODULES, "generic causal-LM forward"))
    return problems
