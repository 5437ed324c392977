"""Reading a Nemotron-H configuration into one normalized, immutable description.

What it is for: accept a transformers `NemotronHConfig`, a NVIDIA remote-code config, any attribute object or a
plain dict, and produce `NemotronConfig` whose `layers_block_type` uses one vocabulary ("mamba", "attention",
"mlp", "moe") whatever the source spelled: the pattern string `hybrid_override_pattern` ("M*-E"), NVIDIA's names,
or transformers >= 5.13's "linear_attention" / "full_attention". `as_hf_config` gives the transformers config
that `model.config` holds (generation and checkpoints read it). `construction_dtype`: the parameter dtype a model
is built in when no `dtype=` is given (the config's `torch_dtype`, as upstream builds it).
What it must not do: silently accept an unknown block kind or drop a field the model needs; it never mutates the
object it reads.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from am_model_io import resolve_dtype

__all__ = [
    "BLOCK_KINDS",
    "PATTERN_SYMBOLS",
    "NemotronConfig",
    "as_hf_config",
    "construction_dtype",
    "normalize_block_types",
]

BLOCK_KINDS: tuple[str, ...] = ("mamba", "attention", "mlp", "moe")

# Every spelling seen in NVIDIA checkpoints, transformers < 5.13 and transformers >= 5.13.
_KIND_ALIASES: dict[str, str] = {
    "mamba": "mamba",
    "mamba2": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}
PATTERN_SYMBOLS: dict[str, str] = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# The vocabulary of transformers' own NemotronHConfig (5.13+), used when we build one.
_HF_KIND_NAMES: dict[str, str] = {
    "mamba": "linear_attention",
    "attention": "full_attention",
    "mlp": "mlp",
    "moe": "moe",
}


def normalize_block_types(value: str | Sequence[str], *, field: str = "layers_block_type") -> tuple[str, ...]:
    """Block kinds in our vocabulary from a pattern string ("M*-E") or a list of names in any known vocabulary.

    Raises:
        ValueError: empty input, or unknown symbols / names (all of them listed).
    """
    if isinstance(value, str):
        unknown = sorted({ch for ch in value if ch not in PATTERN_SYMBOLS})
        if unknown:
            raise ValueError(
                f"{field}={value!r} has unknown pattern symbols {unknown}; use M (mamba), * (attention), "
                "- (mlp), E (moe)."
            )
        kinds = tuple(PATTERN_SYMBOLS[ch] for ch in value)
    else:
        unknown = sorted({str(v) for v in value if str(v) not in _KIND_ALIASES})
        if unknown:
            raise ValueError(
                f"{field} has unknown block kinds {unknown}; accepted: {sorted(_KIND_ALIASES)} "
                "(NVIDIA names mamba/attention/mlp/moe or transformers names linear_attention/full_attention)."
            )
        kinds = tuple(_KIND_ALIASES[str(v)] for v in value)
    if not kinds:
        raise ValueError(f"{field} is empty: the model needs at least one block.")
    return kinds


def _get(source: Any, name: str, default: Any) -> Any:
    if isinstance(source, Mapping):
        return source.get(name, default)
    return getattr(source, name, default)


def _has(source: Any, name: str) -> bool:
    """Whether `source` sets `name` itself. A property of its class is a view of other fields (transformers'
    `NemotronHConfig.hybrid_override_pattern` spells `layers_block_type` as a string and raises TypeError when that
    list is unset), so it is not read here: the fields it derives from are checked first."""
    if isinstance(source, Mapping):
        return source.get(name) is not None
    if isinstance(inspect.getattr_static(type(source), name, None), property):
        return False
    return getattr(source, name, None) is not None


def _time_step_limit(value: Any) -> tuple[float, float]:
    if value is None:
        return (0.0, math.inf)
    values = []
    for item in value:
        if isinstance(item, Mapping) and "__float__" in item:  # transformers' JSON spelling of inf
            item = float(item["__float__"])
        values.append(float(item))
    if len(values) != 2 or values[0] > values[1]:
        raise ValueError(f"time_step_limit={value!r} must be a (low, high) pair with low <= high.")
    return (values[0], values[1])


@dataclass(frozen=True)
class NemotronConfig:
    """Every field the model reads, with transformers' NemotronHConfig defaults. Build it with `from_any`."""

    vocab_size: int
    hidden_size: int
    layers_block_type: tuple[str, ...]
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    attention_dropout: float = 0.0
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    chunk_size: int = 128
    conv_kernel: int = 4
    use_conv_bias: bool = True
    mamba_hidden_act: str = "silu"
    use_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    num_nextn_predict_layers: int = 0
    mtp_layers_block_type: tuple[str, ...] = ("attention", "moe")
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True
    residual_in_fp32: bool = False
    tie_word_embeddings: bool = False

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def has_moe(self) -> bool:
        """Whether any backbone or MTP block is a mixture of experts."""
        mtp = self.mtp_layers_block_type if self.num_nextn_predict_layers > 0 else ()
        return "moe" in self.layers_block_type or "moe" in mtp

    @classmethod
    def from_any(cls, config: Any) -> NemotronConfig:
        """Read a transformers / NVIDIA config object, any attribute object, a dict, or a `NemotronConfig`.

        Raises:
            ValueError: no block layout, unknown block kinds, or inconsistent head / group / expert sizes
                (every problem listed).
        """
        if isinstance(config, NemotronConfig):
            return config
        # The first layout field the config sets, in this order of preference.
        layout = [
            name for name in ("layers_block_type", "hybrid_override_pattern", "layer_types") if _has(config, name)
        ]
        if not layout:
            raise ValueError(
                "The config has no block layout: set layers_block_type (list), hybrid_override_pattern (e.g. 'M*-E') "
                "or layer_types."
            )
        kinds = normalize_block_types(_get(config, layout[0], None), field=layout[0])
        # transformers' NemotronHConfig derives the pattern property from the list: prefer the list.
        raw_mtp: Any = _get(config, "mtp_layers_block_type", None)
        if not raw_mtp:
            raw_mtp = _get(config, "mtp_hybrid_override_pattern", None)
        mtp_kinds = normalize_block_types(raw_mtp, field="mtp_layers_block_type") if raw_mtp else ("attention", "moe")

        values: dict[str, Any] = {"layers_block_type": kinds, "mtp_layers_block_type": mtp_kinds}
        for field in dataclasses.fields(cls):
            if field.name in values:
                continue
            default = field.default if field.default is not dataclasses.MISSING else None
            values[field.name] = _get(config, field.name, default)
        if values["num_key_value_heads"] is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values["head_dim"] is None:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        values["time_step_limit"] = _time_step_limit(values["time_step_limit"])
        values["num_nextn_predict_layers"] = int(values["num_nextn_predict_layers"] or 0)
        result = cls(**values)
        result.validate()
        return result

    def validate(self) -> None:
        """Raise one ValueError listing every inconsistent size."""
        problems: list[str] = []
        if self.vocab_size is None or self.hidden_size is None:
            problems.append("vocab_size and hidden_size are required")
        kinds = set(self.layers_block_type) | (
            set(self.mtp_layers_block_type) if self.num_nextn_predict_layers else set()
        )
        if "attention" in kinds and self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if "mamba" in kinds:
            if self.mamba_num_heads % self.n_groups:
                problems.append(f"mamba_num_heads={self.mamba_num_heads} is not a multiple of n_groups={self.n_groups}")
            if self.chunk_size < 1:
                problems.append(f"chunk_size={self.chunk_size} must be >= 1")
        if "moe" in kinds:
            if self.n_routed_experts % self.n_group:
                problems.append(f"n_routed_experts={self.n_routed_experts} is not a multiple of n_group={self.n_group}")
            if self.num_experts_per_tok > self.n_routed_experts:
                problems.append(
                    f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}"
                )
            if self.n_group > 1 and not (1 <= self.topk_group <= self.n_group):
                problems.append(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                problems.append(
                    f"group-limited routing scores each group by its top-2 experts, so every group needs >= 2 "
                    f"experts; n_routed_experts={self.n_routed_experts}, n_group={self.n_group}"
                )
        if self.num_nextn_predict_layers < 0:
            problems.append(f"num_nextn_predict_layers={self.num_nextn_predict_layers} must be >= 0")
        if problems:
            listed = "\n".join(f"  - {p}" for p in problems)
            raise ValueError(f"Invalid Nemotron-H config ({len(problems)} problem(s)):\n{listed}")


def as_hf_config(config: Any) -> Any:
    """A transformers `NemotronHConfig` for `config` (returned unchanged when it already is one).

    Dicts and other objects are converted; block kinds in any vocabulary are translated to transformers' names.
    """
    from transformers import NemotronHConfig

    if isinstance(config, NemotronHConfig):
        return config
    if isinstance(config, NemotronConfig):
        values: dict[str, Any] = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        values = dict(config)
    else:
        to_dict = getattr(config, "to_dict", None)
        values = dict(to_dict()) if callable(to_dict) else dict(vars(config))
    normalized = NemotronConfig.from_any(values)
    for derived in ("hybrid_override_pattern", "mtp_hybrid_override_pattern", "layer_types", "num_hidden_layers"):
        values.pop(derived, None)  # NemotronHConfig derives them from the lists below
    values.pop("model_type", None)
    values["layers_block_type"] = [_HF_KIND_NAMES[k] for k in normalized.layers_block_type]
    values["mtp_layers_block_type"] = [_HF_KIND_NAMES[k] for k in normalized.mtp_layers_block_type]
    values["time_step_limit"] = list(normalized.time_step_limit)
    return NemotronHConfig(**values)


def construction_dtype(config: Any) -> torch.dtype:
    """The parameter dtype a model is built in without `dtype=`: the config's `dtype` / `torch_dtype` (a dtype or its
    name, as a hub `config.json` spells it), else torch's default dtype.

    Raises:
        ValueError: the config names something that is not a torch dtype.
    """
    return resolve_dtype(torch_dtype=None, dtype="auto", config=config) or torch.get_default_dtype()
