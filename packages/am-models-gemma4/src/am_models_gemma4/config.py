"""Config helpers: read what a Gemma 4 layer needs from transformers' `Gemma4TextConfig` / `Gemma4Config`.

What it is for: per-layer head dim and KV heads (full layers use `global_head_dim` and, with `attention_k_eq_v`,
`num_global_key_value_heads`), KV-sharing roles, the MoE fields (with the older `expert_intermediate_size`
spelling), one validation that lists every unsupported setting at once, and `check_moe_config`, which holds
NeMo AutoModel's MoE settings (`moe_config`, `moe_overrides`) against the MoE this package builds from the config.
What it must not do: build modules or change the config it is given (except `normalize_text_config`, which only
mirrors the two MoE spellings).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "check_moe_config",
    "is_moe_config",
    "kv_sharing_modes",
    "layer_head_dim",
    "layer_num_kv_heads",
    "moe_intermediate_size",
    "normalize_text_config",
    "text_config_of",
    "ties_word_embeddings",
    "validate_text_config",
]

SLIDING = "sliding_attention"
FULL = "full_attention"


def text_config_of(config: Any) -> Any:
    """The text sub-config of a `Gemma4Config`, or the config itself when it is already a text config."""
    text_config = getattr(config, "text_config", None)
    return text_config if text_config is not None else config


def ties_word_embeddings(config: Any) -> bool:
    """Whether the LM head is the input embedding: `tie_word_embeddings` of the config (a `Gemma4Config`'s top-level
    flag wins), else of its text config (default True, Gemma 4's)."""
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(text_config_of(config), "tie_word_embeddings", True)
    return bool(tied)


def _layer_override(config: Any, layer_idx: int, name: str) -> Any:
    """A per-layer value from transformers' `per_layer_config` (>= 5.23), or None when it has none."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is None:
        return None
    try:
        return getattr(per_layer[layer_idx], name, None)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def layer_head_dim(config: Any, layer_idx: int) -> int:
    """Head dim of layer `layer_idx`: `global_head_dim` on full-attention layers (when set), else `head_dim`."""
    value = _layer_override(config, layer_idx, "head_dim")
    if value is not None:
        return int(value)
    if config.layer_types[layer_idx] == FULL and getattr(config, "global_head_dim", None):
        return int(config.global_head_dim)
    return int(config.head_dim)


def layer_num_kv_heads(config: Any, layer_idx: int) -> int:
    """KV heads of layer `layer_idx`: `num_global_key_value_heads` on full layers with `attention_k_eq_v`."""
    value = _layer_override(config, layer_idx, "num_key_value_heads")
    if value is not None:
        return int(value)
    global_kv = getattr(config, "num_global_key_value_heads", None)
    if config.layer_types[layer_idx] == FULL and getattr(config, "attention_k_eq_v", False) and global_kv:
        return int(global_kv)
    return int(config.num_key_value_heads)


def kv_sharing_modes(config: Any) -> list[str | None]:
    """Per layer: None (own K/V), "store" (own K/V, also published for later layers) or "reuse" (no K/V weights)."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is not None:
        return list(modes)
    # transformers without the property: the last `num_kv_shared_layers` layers reuse, and the last earlier layer
    # of each type stores.
    layers = int(config.num_hidden_layers)
    first_shared = layers - int(getattr(config, "num_kv_shared_layers", 0) or 0)
    result: list[str | None] = [None if i < first_shared else "reuse" for i in range(layers)]
    if first_shared < layers:
        for layer_type in set(config.layer_types):
            producers = [i for i in range(first_shared) if config.layer_types[i] == layer_type]
            if not producers:
                raise ValueError(
                    f"num_kv_shared_layers={layers - first_shared} leaves no earlier '{layer_type}' layer to share "
                    "K/V from; lower num_kv_shared_layers"
                )
            result[producers[-1]] = "store"
    return result


def is_moe_config(config: Any) -> bool:
    """True when the decoder layers carry the MoE block next to the dense MLP (`enable_moe_block`)."""
    return bool(getattr(text_config_of(config), "enable_moe_block", False))


def moe_intermediate_size(config: Any) -> int | None:
    """Expert width: `moe_intermediate_size`, else the older `expert_intermediate_size`."""
    value = getattr(config, "moe_intermediate_size", None)
    if value is None:
        value = getattr(config, "expert_intermediate_size", None)
    return None if value is None else int(value)


def normalize_text_config(config: Any) -> Any:
    """Mirror `moe_intermediate_size` <-> `expert_intermediate_size` when only one is set; return the config."""
    value = moe_intermediate_size(config)
    if value is not None:
        if getattr(config, "moe_intermediate_size", None) is None:
            config.moe_intermediate_size = value
        if getattr(config, "expert_intermediate_size", None) is None:
            object.__setattr__(config, "expert_intermediate_size", value)
    return config


def validate_text_config(config: Any) -> None:
    """Raise one ValueError listing every setting this implementation cannot run, each with its fix.

    Raises:
        ValueError: unknown layer types, a last layer that is not full attention, incomplete MoE fields,
            `use_bidirectional_attention="all"`.
    """
    problems = []
    layer_types = list(getattr(config, "layer_types", None) or [])
    if len(layer_types) != config.num_hidden_layers:
        problems.append(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers={config.num_hidden_layers}; give one "
            f"'{SLIDING}' or '{FULL}' entry per layer"
        )
    unknown = sorted({t for t in layer_types if t not in (SLIDING, FULL)})
    if unknown:
        problems.append(f"layer_types contains {unknown}; only '{SLIDING}' and '{FULL}' exist in Gemma 4")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        problems.append(
            "use_bidirectional_attention='all' (fully bidirectional text attention) is not supported; use None or "
            "'vision'"
        )
    if is_moe_config(config):
        missing = [
            name
            for name, value in (
                ("num_experts", getattr(config, "num_experts", None)),
                ("top_k_experts", getattr(config, "top_k_experts", None)),
                ("moe_intermediate_size", moe_intermediate_size(config)),
            )
            if not value
        ]
        if missing:
            problems.append(f"enable_moe_block=True needs positive {missing}; set them or disable the MoE block")
        elif int(config.top_k_experts) > int(config.num_experts):
            problems.append(
                f"top_k_experts={config.top_k_experts} exceeds num_experts={config.num_experts}; lower top_k_experts"
            )
    if problems:
        raise ValueError("unsupported Gemma 4 text config:\n  - " + "\n  - ".join(problems))


def _moe_fields_of(config: Any) -> dict[str, Any]:
    """Upstream's `MoEConfig` fields as this package builds the MoE from `config` (upstream's defaults for Gemma 4)."""
    return {
        "dim": int(config.hidden_size),
        "inter_dim": int(config.intermediate_size),
        "moe_inter_dim": moe_intermediate_size(config),
        "n_routed_experts": int(config.num_experts),
        "n_shared_experts": 0,
        "n_activated_experts": int(config.top_k_experts),
        "n_expert_groups": 0,
        "n_limited_groups": 0,
        "gate_bias_update_factor": 0,
        "score_func": "softmax",
        "route_scale": 1.0,
        "aux_loss_coeff": 0,
        "norm_topk_prob": True,
        "expert_activation": "geglu",
        "softmax_before_topk": False,
    }


def check_moe_config(config: Any, moe_config: Any = None, *, overrides: dict[str, Any] | None = None) -> None:
    """Refuse upstream MoE settings that disagree with the MoE this package builds from `config`.

    `moe_config` is anything with upstream's `MoEConfig` attribute names (only the fields it has are compared);
    `overrides` is upstream's `moe_overrides` dict. Fields that do not describe the computation (`dtype`,
    `train_gate`, ...) are not compared.

    Raises:
        ValueError: the config has no MoE block, or listing every field that disagrees (or is unknown in `overrides`).
    """
    text = text_config_of(config)
    if not is_moe_config(text):
        raise ValueError(
            "a Gemma 4 MoE layer needs a config with enable_moe_block=True (and num_experts, top_k_experts, "
            "moe_intermediate_size); this config is dense: pass no moe_config, or use Gemma4DecoderLayer / "
            "Gemma4TextModel"
        )
    expected = _moe_fields_of(text)
    problems: list[str] = []
    for name, value in expected.items():
        if moe_config is not None and hasattr(moe_config, name) and getattr(moe_config, name) != value:
            problems.append(f"moe_config.{name}={getattr(moe_config, name)!r}, but the config gives {value!r}")
    for name, value in (overrides or {}).items():
        if name not in expected:
            problems.append(f"moe_overrides[{name!r}]: not a field this package reads (known: {sorted(expected)})")
        elif value != expected[name]:
            problems.append(f"moe_overrides[{name!r}]={value!r}, but the config gives {expected[name]!r}")
    if problems:
        raise ValueError(
            "the MoE is built from the text config (enable_moe_block, num_experts, top_k_experts, "
            "moe_intermediate_size); these upstream MoE settings disagree with it — change the config instead:\n  - "
            + "\n  - ".join(problems)
        )
