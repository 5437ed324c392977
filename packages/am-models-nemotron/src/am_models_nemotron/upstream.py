"""NeMo AutoModel's spellings of this package's classes and functions (`nemo_automodel.components.models.nemotron_v3`
`.{model,layers,mtp,state_dict_adapter}` and `models.common.mtp`), with upstream's calling conventions.

What it is for: code written against upstream runs after changing its imports to this module. Each name is a thin
layer over the core (`am_models_nemotron`): an upstream class name for a core class, a constructor with upstream's
positional order, or an upstream helper expressed through the core's one rule.
What it must not do: hold behaviour of its own, or be imported by the core (nothing in this package imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from am_precision import BackendConfig

from .attention import NemotronAttention
from .backend import resolve_backend
from .blocks import NemotronBlock
from .config import PATTERN_SYMBOLS, NemotronConfig
from .cp import MTP_CP_KEYS
from .mamba2 import Mamba2FP32Params, Mamba2Mixer, MambaRMSNormGated
from .model import NemotronHForCausalLM as _NemotronHForCausalLM
from .mtp import MTPConfig, MTPSublayer, mtp_layer_slots
from .mtp import MTPModule as _MTPModule
from .state_dict_adapter import NemotronStateDictAdapter

__all__ = [
    "MTPModule",
    "ModelClass",
    "NemotronHForCausalLM",
    "NemotronV3Attention",
    "NemotronV3Block",
    "NemotronV3MTPSublayer",
    "NemotronV3Mamba2Mixer",
    "NemotronV3MambaFP32Params",
    "NemotronV3MambaRMSNormGated",
    "NemotronV3StateDictAdapter",
    "build_mtp_config_from_hf",
    "parse_mtp_layer_pattern",
]

# Upstream's class names (`nemotron_v3.layers`, `nemotron_v3.mtp`) for core classes that already take upstream's
# positional arguments: `(config, layer_idx)`, `(hidden, group_size, eps)`, `(num_heads)`.
NemotronV3Mamba2Mixer = Mamba2Mixer
NemotronV3MambaRMSNormGated = MambaRMSNormGated
NemotronV3MambaFP32Params = Mamba2FP32Params
NemotronV3MTPSublayer = MTPSublayer


def _moe_config_problems(config: NemotronConfig, moe_config: Any) -> list[str]:
    """Upstream passes a separate `MoEConfig`; ours is read from the config, so a given one must agree with it."""
    experts = getattr(moe_config, "n_routed_experts", None)
    if moe_config is None or experts == config.n_routed_experts:
        return []
    return [
        f"moe_config.n_routed_experts={experts!r} disagrees with the config's n_routed_experts="
        f"{config.n_routed_experts}; the MoE is built from the config, pass moe_config=None or the model's own"
    ]


class NemotronV3Attention(NemotronAttention):
    """`NemotronV3Attention(config, backend=None)`: `NemotronAttention` with the backend second (None ->
    `default_backend()`, values that cannot run refused as the model does); the cache slot `layer_idx` is keyword-only
    (upstream's block sets it), default 0."""

    def __init__(
        self,
        config: NemotronConfig | Any,
        backend: BackendConfig | None = None,
        *,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        backend = resolve_backend(backend, owner=type(self).__name__)
        super().__init__(config, layer_idx, backend=backend, device=device, dtype=dtype)


class NemotronV3Block(NemotronBlock):
    """`NemotronV3Block(config, layer_idx, moe_config=None, backend=None, block_type=None)`: `NemotronBlock` in
    upstream's positional order. A `moe_config` (anything with `n_routed_experts`) must agree with the config.

    Raises:
        ValueError: a `moe_config` that disagrees with the config, or an unknown `block_type`.
    """

    def __init__(
        self,
        config: NemotronConfig | Any,
        layer_idx: int,
        moe_config: Any = None,
        backend: BackendConfig | None = None,
        block_type: str | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        problems = _moe_config_problems(NemotronConfig.from_any(config), moe_config)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        super().__init__(config, layer_idx, backend=backend, block_type=block_type, device=device, dtype=dtype)


class NemotronV3StateDictAdapter(NemotronStateDictAdapter):
    """`NemotronV3StateDictAdapter(config, moe_config=None, backend=None, dtype=None)`: `NemotronStateDictAdapter` in
    upstream's positional order. A `moe_config` must agree with the config's expert count; `backend` must be a
    `BackendConfig` or None (the layout does not depend on it); `dtype=None` keeps dtypes (upstream: bf16).

    Raises:
        ValueError: a disagreeing `moe_config` and a wrong `backend` (both listed), or a wrong `dtype`.
    """

    def __init__(
        self,
        config: Any,
        moe_config: Any = None,
        backend: BackendConfig | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        problems = _moe_config_problems(NemotronConfig.from_any(config), moe_config)
        if backend is not None and not isinstance(backend, BackendConfig):
            problems.append(f"backend={backend!r} must be an am_precision.BackendConfig or None")
        if problems:
            raise ValueError(f"{type(self).__name__}:\n  - " + "\n  - ".join(problems))
        super().__init__(config, dtype=dtype)


class MTPModule(_MTPModule):
    """`MTPModule(mtp_config, block_types, sublayer_factory)`: the core `MTPModule` (forward, depths, repeated
    layer) over sublayers built by `sublayer_factory(*, global_idx, depth, sublayer_idx, block_type, has_fusion,
    has_final_norm)`; `block_types` has the length of `mtp_config.layer_pattern`.

    Raises:
        ValueError: a disabled `mtp_config`, or `block_types` of another length than its pattern.
    """

    def __init__(
        self, mtp_config: MTPConfig, block_types: Sequence[str], sublayer_factory: Callable[..., nn.Module]
    ) -> None:
        slots = mtp_layer_slots(mtp_config, block_types)
        nn.Module.__init__(self)  # the core constructor builds Nemotron sublayers; these come from the factory
        self.mtp_config = mtp_config
        self.layers = nn.ModuleList(sublayer_factory(**slot) for slot in slots)


def parse_mtp_layer_pattern(pattern: str) -> list[str]:
    """Block kinds of an MTP pattern string: "*E" -> ["attention", "moe"] (M mamba, * attention, - mlp, E moe).

    Raises:
        ValueError: an empty pattern ("MTP layer pattern is empty") or unknown symbols (all listed).
    """
    if not pattern:
        raise ValueError("MTP layer pattern is empty")
    unknown = sorted({symbol for symbol in pattern if symbol not in PATTERN_SYMBOLS})
    if unknown:
        raise ValueError(
            f"Unknown MTP layer symbol(s) {unknown} in {pattern!r}; use M (mamba), * (attention), - (mlp), E (moe)"
        )
    return [PATTERN_SYMBOLS[symbol] for symbol in pattern]


# `MTPConfig.from_config` takes upstream's keywords: depths and per-depth kinds from an HF / NVIDIA / our config.
# `layer_pattern` holds the kinds themselves (upstream: the pattern string, or "X" × n as a length sentinel).
build_mtp_config_from_hf = MTPConfig.from_config


class NemotronHForCausalLM(_NemotronHForCausalLM):
    """The core `NemotronHForCausalLM` plus upstream's `prepare_mtp_inputs_for_cp` hook and class flag."""

    # NeMo AutoModel's spelling of `am_contract().pp.keeps_own_forward` (the seed documents it on this class); code
    # written against upstream reads it, nothing in am-* does.
    _pp_keep_self_forward: ClassVar[bool] = True

    def prepare_mtp_inputs_for_cp(
        self, batch: Mapping[str, Any], *, ignore_index: int = -100, labels_shifted: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """The per-depth MTP inputs and targets of `batch` (`mtp_per_depth_input_ids` / `mtp_per_depth_targets`
        [B, D, S]), computed on the whole sequences before sharding: the MTP part of `prepare_batch_for_cp`; None
        when the model runs no MTP now (no MTP depths, or eval without `compute_mtp_in_eval`). `batch` is unchanged.
        """
        if not (self.num_mtp_depths and (self.training or self.compute_mtp_in_eval)):
            return None
        prepared = self.prepare_batch_for_cp(dict(batch), labels_shifted=labels_shifted, ignore_index=ignore_index)
        return {key: prepared[key] for key in MTP_CP_KEYS}


ModelClass = NemotronHForCausalLM  # upstream's module-level registry name
