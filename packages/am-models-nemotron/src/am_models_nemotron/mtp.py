"""Multi-token prediction (MTP): extra depths that predict tokens further ahead, and their loss.

What it is for: `MTPConfig` (depth count, per-depth block pattern, loss scale, repeated layer), `MTPModule` (a flat
`layers` list of `physical_depths × len(pattern)` sublayers, checkpoint names `mtp.layers.{i}.*`; the first sublayer
of each depth fuses `eh_proj([enorm(embedding), hnorm(hidden)])`, the last applies `final_layernorm`), the input
shifts (`shift_within_documents`, `shift_labels`; `roll_tensor` is am-context-parallel's): depth k (0-based) at
position t predicts token t + k + 2, never across a packed-sequence boundary. The loss is
`loss.combined_causal_lm_loss` (one rule).
What it must not do: import am-pipelining, or compute a loss (one implementation lives in `loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from am_context_parallel.mtp_loss import roll_tensor, shift_packed_tensor
from am_precision import BackendConfig, initialize_linear_module, initialize_rms_norm_module

from ._init import reset_linear_
from .blocks import NemotronBlock
from .config import NemotronConfig
from .tp_plan import MTP_TP_PLAN

__all__ = [
    "MTPConfig",
    "MTPModule",
    "MTPSublayer",
    "mtp_layer_slots",
    "roll_tensor",
    "shift_labels",
    "shift_within_documents",
]


@dataclass(frozen=True)
class MTPConfig:
    """num_layers: MTP depths D; layer_pattern: block kinds of one depth; use_repeated_layer: one physical depth
    applied D times (shared weights); loss_scaling_factor: weight of the mean depth loss."""

    num_layers: int = 0
    layer_pattern: tuple[str, ...] = ()
    loss_scaling_factor: float = 0.1
    use_repeated_layer: bool = False

    @property
    def enabled(self) -> bool:
        return self.num_layers > 0 and len(self.layer_pattern) > 0

    @property
    def num_physical_depths(self) -> int:
        return 1 if self.use_repeated_layer else self.num_layers

    @property
    def total_sublayers(self) -> int:
        return self.num_physical_depths * len(self.layer_pattern)

    @classmethod
    def from_config(
        cls,
        config: NemotronConfig | Any,
        *,
        num_nextn_predict_layers: int | None = None,
        loss_scaling_factor: float = 0.1,
        use_repeated_layer: bool = False,
    ) -> MTPConfig:
        """Depths from the config unless overridden (0 disables MTP); any config `NemotronConfig.from_any` reads."""
        config = NemotronConfig.from_any(config)
        depths = config.num_nextn_predict_layers if num_nextn_predict_layers is None else num_nextn_predict_layers
        if depths < 0:
            raise ValueError(f"num_nextn_predict_layers={depths} must be >= 0")
        return cls(depths, tuple(config.mtp_layers_block_type), float(loss_scaling_factor), use_repeated_layer)


def shift_within_documents(
    tensor: torch.Tensor, shift: int, *, seq_idx: torch.Tensor | None = None, fill_value: float = 0
) -> torch.Tensor:
    """Shift left along dim 1 without crossing documents: out[:, t] = tensor[:, t + shift], or `fill_value` past the
    end of the row or when position t + shift lies in another document. tensor: [B, S, ...]; seq_idx: [B, S];
    shift > 0 (am-context-parallel's `shift_packed_tensor`, the one implementation)."""
    return shift_packed_tensor(tensor, depth=shift, seq_idx=seq_idx, fill_value=fill_value)


def shift_labels(
    labels: torch.Tensor, shift: int, *, seq_idx: torch.Tensor | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """Targets at distance `shift`: out[:, t] = labels[:, t + shift], or `ignore_index` past the end or when
    position t + shift lies in another packed sequence. labels, seq_idx: [B, S]."""
    return shift_within_documents(labels, shift, seq_idx=seq_idx, fill_value=ignore_index)


class MTPSublayer(NemotronBlock):
    """A block of an MTP depth; the first of a depth owns the fusion, the last the final norm.

    forward(hidden [B, S, H], embed_input [B, S, H] | None, **block inputs) -> [B, S, H].
    """

    def __init__(
        self,
        config: NemotronConfig | Any,
        layer_idx: int,
        *,
        block_type: str,
        has_fusion: bool,
        has_final_norm: bool,
        backend: BackendConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(config, layer_idx, backend=backend, block_type=block_type, device=device, dtype=dtype)
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.enorm: nn.Module | None = None
        self.hnorm: nn.Module | None = None
        self.eh_proj: nn.Module | None = None
        self.final_layernorm: nn.Module | None = None
        if has_fusion:
            self.enorm = initialize_rms_norm_module(backend.rms_norm, hidden, eps=eps, device=device, dtype=dtype)
            self.hnorm = initialize_rms_norm_module(backend.rms_norm, hidden, eps=eps, device=device, dtype=dtype)
            self.eh_proj = initialize_linear_module(
                backend.linear, 2 * hidden, hidden, bias=False, device=device, dtype=dtype
            )
        if has_final_norm:
            self.final_layernorm = initialize_rms_norm_module(
                backend.rms_norm, hidden, eps=eps, device=device, dtype=dtype
            )

    @torch.no_grad()
    def init_weights(self, *, num_hidden_layers: int, rescale_prenorm_residual: bool) -> None:
        super().init_weights(num_hidden_layers=num_hidden_layers, rescale_prenorm_residual=rescale_prenorm_residual)
        for module in (self.enorm, self.hnorm, self.eh_proj, self.final_layernorm):
            reset_linear_(module)

    def forward(
        self, hidden_states: torch.Tensor, *, embed_input: torch.Tensor | None = None, **block_inputs: Any
    ) -> torch.Tensor:
        if self.eh_proj is not None:
            if embed_input is None:
                raise ValueError("The first sublayer of an MTP depth needs the depth's token embeddings (embed_input).")
            assert self.enorm is not None
            assert self.hnorm is not None
            hidden_states = self.eh_proj(torch.cat([self.enorm(embed_input), self.hnorm(hidden_states)], dim=-1))
        hidden_states = super().forward(hidden_states, **block_inputs)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


def mtp_layer_slots(mtp_config: MTPConfig, block_types: Sequence[str]) -> list[dict[str, Any]]:
    """Where each of the `num_physical_depths × len(block_types)` sublayers sits (flat order = checkpoint order
    `mtp.layers.{global_idx}`): `global_idx, depth, sublayer_idx, block_type, has_fusion` (first of a depth),
    `has_final_norm` (last of a depth).

    Raises:
        ValueError: a disabled `mtp_config`, or `block_types` of another length than its pattern.
    """
    if not mtp_config.enabled:
        raise ValueError(f"MTPModule needs an enabled MTPConfig (num_layers > 0, non-empty pattern), got {mtp_config}")
    if len(block_types) != len(mtp_config.layer_pattern):
        raise ValueError(
            f"MTPModule: {len(block_types)} block_types {list(block_types)} but the MTP pattern has "
            f"{len(mtp_config.layer_pattern)} sublayers per depth ({mtp_config.layer_pattern})"
        )
    width = len(block_types)
    return [
        {
            "global_idx": depth * width + position,
            "depth": depth,
            "sublayer_idx": position,
            "block_type": kind,
            "has_fusion": position == 0,
            "has_final_norm": position == width - 1,
        }
        for depth in range(mtp_config.num_physical_depths)
        for position, kind in enumerate(block_types)
    ]


class MTPModule(nn.Module):
    """All MTP depths. forward(hidden [B, S, H], embed_inputs: D × [B, S, H]) -> D × [B, S, H].

    `MTPModule(config, mtp_config, *, backend, device, dtype)` builds the Nemotron sublayers (`MTPSublayer`, cache
    slots after the backbone's layers) in a flat `layers` list of `num_physical_depths × len(pattern)` (checkpoint
    names `mtp.layers.{i}.*`); depth d runs physical depth d (or 0 with `use_repeated_layer`).

    Raises:
        ValueError: a disabled `mtp_config`.
    """

    _tp_plan: ClassVar[Any] = MTP_TP_PLAN  # am-tensor-parallel: the fusion projections (tp_plan.py)

    def __init__(
        self,
        config: NemotronConfig | Any,
        mtp_config: MTPConfig,
        *,
        backend: BackendConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        config = NemotronConfig.from_any(config)
        slots = mtp_layer_slots(mtp_config, mtp_config.layer_pattern)
        self.mtp_config = mtp_config
        self.layers = nn.ModuleList(
            MTPSublayer(
                config,
                config.num_hidden_layers + slot["global_idx"],
                block_type=slot["block_type"],
                has_fusion=slot["has_fusion"],
                has_final_norm=slot["has_final_norm"],
                backend=backend,
                device=device,
                dtype=dtype,
            )
            for slot in slots
        )

    def forward(
        self, hidden_states: torch.Tensor, *, embed_inputs: Sequence[torch.Tensor], **block_inputs: Any
    ) -> list[torch.Tensor]:
        depths = self.mtp_config.num_layers
        if len(embed_inputs) != depths:
            raise ValueError(f"MTP has {depths} depths but received {len(embed_inputs)} embedding tensors.")
        pattern_len = len(self.mtp_config.layer_pattern)
        outputs = []
        for depth in range(depths):
            physical = 0 if self.mtp_config.use_repeated_layer else depth
            for position in range(pattern_len):
                layer = self.layers[physical * pattern_len + position]
                embed = embed_inputs[depth] if position == 0 else None
                hidden_states = layer(hidden_states, embed_input=embed, **block_inputs)
            outputs.append(hidden_states)
        return outputs
