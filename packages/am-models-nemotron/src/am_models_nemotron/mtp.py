"""Multi-token prediction (MTP): extra depths that predict tokens further ahead, and their loss.

What it is for: `MTPConfig` (depth count, per-depth block pattern, loss scale, repeated layer), `MTPModule` (a flat
`layers` list of `physical_depths × len(pattern)` sublayers, checkpoint names `mtp.layers.{i}.*`; the first sublayer
of each depth fuses `eh_proj([enorm(embedding), hnorm(hidden)])`, the last applies `final_layernorm`), the input
roll (`roll_tensor`) and the loss (`mtp_loss`): depth k (0-based) at position t predicts token t + k + 2, never
across a packed-sequence boundary.
What it must not do: import am-pipelining (it has its own `calculate_mtp_loss`; this is the model's small copy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from am_precision import BackendConfig, initialize_linear_module, initialize_rms_norm_module

from ._init import reset_linear_
from .blocks import NemotronV3Block
from .config import PATTERN_SYMBOLS, NemotronConfig
from .loss import cross_entropy

__all__ = [
    "MTPConfig",
    "MTPModule",
    "MTPSublayer",
    "NemotronV3MTPSublayer",
    "build_mtp_config_from_hf",
    "parse_mtp_layer_pattern",
    "mtp_depth_losses",
    "mtp_loss",
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


def roll_tensor(tensor: torch.Tensor, shifts: int = -1, dim: int = -1, *, fill_value: float = 0) -> torch.Tensor:
    """torch.roll, with the wrapped-around slice replaced by `fill_value` (the trailing |shifts| for shifts < 0)."""
    if shifts == 0 or tensor.shape[dim] == 0:
        return tensor
    rolled = torch.roll(tensor, shifts=shifts, dims=dim)
    length = tensor.shape[dim]
    count = min(abs(shifts), length)
    start = length - count if shifts < 0 else 0
    return rolled.index_fill(dim, torch.arange(start, start + count, device=tensor.device), fill_value)


def shift_within_documents(
    tensor: torch.Tensor, shift: int, *, seq_idx: torch.Tensor | None = None, fill_value: float = 0
) -> torch.Tensor:
    """Shift left along dim 1 without crossing documents: out[:, t] = tensor[:, t + shift], or `fill_value` past the
    end of the row or when position t + shift lies in another document. tensor: [B, S, ...]; seq_idx: [B, S]."""
    out = roll_tensor(tensor, -shift, dim=1, fill_value=fill_value)
    if seq_idx is not None:
        crosses = roll_tensor(seq_idx, -shift, dim=1, fill_value=-1) != seq_idx
        out = out.masked_fill(crosses.view(*crosses.shape, *([1] * (tensor.dim() - 2))), fill_value)
    return out


def shift_labels(
    labels: torch.Tensor, shift: int, *, seq_idx: torch.Tensor | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """Targets at distance `shift`: out[:, t] = labels[:, t + shift], or `ignore_index` past the end or when
    position t + shift lies in another packed sequence. labels, seq_idx: [B, S]."""
    return shift_within_documents(labels, shift, seq_idx=seq_idx, fill_value=ignore_index)


def _mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """Mean over the non-ignored targets; 0 (not NaN) when a depth has none (short rows at deep depths)."""
    return cross_entropy(logits, targets, ignore_index=ignore_index, empty_is_zero=True)


def mtp_depth_losses(
    per_depth_hidden: Sequence[torch.Tensor],
    *,
    shifted_labels: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    seq_idx: torch.Tensor | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] | None = None,
    ignore_index: int = -100,
) -> list[torch.Tensor]:
    """The unscaled loss of each MTP depth: depth k at position t against shifted_labels[t + k + 1] (= the token
    t + k + 2), ignored where that lies past the row or in another document.

    per_depth_hidden: D tensors [B, S, H]; shifted_labels: [B, S] next-token targets; targets: D precomputed [B, S]
    targets instead (context parallelism shifts before sharding); loss_fn: default mean cross entropy (0 when a
    depth has no target).

    Raises:
        ValueError: precomputed targets of the wrong count or shape.
    """
    depths = len(per_depth_hidden)
    if targets is not None:
        targets = list(targets)
        if len(targets) != depths or any(t.shape != shifted_labels.shape for t in targets):
            raise ValueError(
                f"MTP: got {len(targets)} target tensors of shapes {[tuple(t.shape) for t in targets]} for {depths} "
                f"depths; each must have the labels' shape {tuple(shifted_labels.shape)}."
            )
    else:
        targets = [
            shift_labels(shifted_labels, k + 1, seq_idx=seq_idx, ignore_index=ignore_index) for k in range(depths)
        ]
    fn = loss_fn or functools.partial(_mean_cross_entropy, ignore_index=ignore_index)
    return [fn(lm_head(h), t) for h, t in zip(per_depth_hidden, targets, strict=True)]


def mtp_loss(
    per_depth_hidden: Sequence[torch.Tensor],
    *,
    labels: torch.Tensor,
    lm_head: nn.Module,
    scaling_factor: float,
    seq_idx: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """scaling_factor × mean over depths of the mean cross entropy of depth k against labels[t + k + 2].

    per_depth_hidden: D tensors [B, S, H]; labels: [B, S] unshifted token ids (as for the main loss).
    """
    shifted = shift_labels(labels, 1, seq_idx=seq_idx, ignore_index=ignore_index)
    losses = mtp_depth_losses(
        per_depth_hidden, shifted_labels=shifted, lm_head=lm_head, seq_idx=seq_idx, ignore_index=ignore_index
    )
    return torch.stack(losses).sum() * scaling_factor / len(losses)


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


def build_mtp_config_from_hf(
    config: Any,
    *,
    loss_scaling_factor: float = 0.1,
    num_nextn_predict_layers: int | None = None,
    use_repeated_layer: bool = False,
) -> MTPConfig:
    """Upstream's name for `MTPConfig.from_config`: depths and per-depth kinds from an HF / NVIDIA / our config
    (`mtp_hybrid_override_pattern` or `mtp_layers_block_type`). `layer_pattern` holds the kinds themselves
    (upstream: the pattern string, or "X" × n as a length sentinel for the list form)."""
    return MTPConfig.from_config(
        config,
        num_nextn_predict_layers=num_nextn_predict_layers,
        loss_scaling_factor=loss_scaling_factor,
        use_repeated_layer=use_repeated_layer,
    )


class MTPSublayer(NemotronV3Block):
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


class MTPModule(nn.Module):
    """All MTP depths. forward(hidden [B, S, H], embed_inputs: D × [B, S, H]) -> D × [B, S, H].

    Upstream's signature: `MTPModule(mtp_config, block_types, sublayer_factory)`. `block_types` are the kinds of
    one depth's sublayers (same length as `mtp_config.layer_pattern`); `sublayer_factory(*, global_idx, depth,
    sublayer_idx, block_type, has_fusion, has_final_norm)` builds each of the `num_physical_depths × len(pattern)`
    sublayers (flat `layers`, checkpoint names `mtp.layers.{global_idx}.*`). `MTPModule.for_config` builds the
    Nemotron sublayers (`MTPSublayer`).

    Raises:
        ValueError: a disabled `mtp_config`, or `block_types` of another length than its pattern.
    """

    def __init__(
        self, mtp_config: MTPConfig, block_types: Sequence[str], sublayer_factory: Callable[..., nn.Module]
    ) -> None:
        super().__init__()
        if not mtp_config.enabled:
            raise ValueError(
                f"MTPModule needs an enabled MTPConfig (num_layers > 0, non-empty pattern), got {mtp_config}"
            )
        if len(block_types) != len(mtp_config.layer_pattern):
            raise ValueError(
                f"MTPModule: {len(block_types)} block_types {list(block_types)} but the MTP pattern has "
                f"{len(mtp_config.layer_pattern)} sublayers per depth ({mtp_config.layer_pattern})"
            )
        self.mtp_config = mtp_config
        pattern_len = len(block_types)
        self.layers = nn.ModuleList(
            sublayer_factory(
                global_idx=depth * pattern_len + position,
                depth=depth,
                sublayer_idx=position,
                block_type=kind,
                has_fusion=position == 0,
                has_final_norm=position == pattern_len - 1,
            )
            for depth in range(mtp_config.num_physical_depths)
            for position, kind in enumerate(block_types)
        )

    @classmethod
    def for_config(
        cls,
        config: NemotronConfig | Any,
        mtp_config: MTPConfig,
        *,
        backend: BackendConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> MTPModule:
        """The Nemotron MTP module: `MTPSublayer`s with cache slots after the backbone's layers."""
        config = NemotronConfig.from_any(config)

        def sublayer(
            *, global_idx: int, block_type: str, has_fusion: bool, has_final_norm: bool, **_: int
        ) -> nn.Module:
            return MTPSublayer(
                config,
                config.num_hidden_layers + global_idx,
                block_type=block_type,
                has_fusion=has_fusion,
                has_final_norm=has_final_norm,
                backend=backend,
                device=device,
                dtype=dtype,
            )

        return cls(mtp_config, mtp_config.layer_pattern, sublayer)

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


NemotronV3MTPSublayer = MTPSublayer  # upstream's class name
