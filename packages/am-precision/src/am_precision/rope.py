"""RoPE: settings from a HuggingFace v5 config, and Transformer Engine's fused RoPE (`BackendConfig.rope_fusion`).

What it is for: `get_rope_config`, the one place that knows transformers v5 moved `rope_theta` and friends into
`config.rope_parameters` (a dict, per layer type for models such as Gemma); `fused_rope`, TE's fused rotary kernel
(`transformer_engine.pytorch.attention.rope.apply_rotary_pos_emb(..., fused=True)`) on the angles a model's rotary
embedding computed, and `quack_rope`, QuACK's rotary kernel (`BackendConfig.rope="quack"`) on its cos/sin: both the
same rotation as transformers' `x·cos + rotate_half(x)·sin`.
What it must not do: import transformers (the config is duck-typed) or transformer_engine at import time (only
`fused_rope` imports it, when called; quack likewise), or copy the rope dict (callers may rely on identity to share
it with the HF rotary-embedding helpers).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fused_rope", "get_rope_config", "quack_rope"]


def fused_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate `x [B, S, H, d]` by `angles [B or 1, S, d]` (fp32 radians, the two halves repeated as transformers
    builds `cat(freqs, freqs)`) with Transformer Engine's fused kernel (non-interleaved, "bshd").

    Equals `x·cos(angles) + rotate_half(x)·sin(angles)` (transformers' `apply_rotary_pos_emb` with attention scaling
    1). TE takes one angle table for the batch: rows whose positions differ (packed rows, left padding) are rotated
    one at a time.

    Raises:
        ImportError: Transformer Engine is not installed (the models refuse `rope_fusion=True` before that).
    """
    try:
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
    except ImportError as err:  # pragma: no cover - the models refuse rope_fusion without TE first
        raise ImportError(
            "rope_fusion=True needs Transformer Engine (transformer_engine.pytorch.attention.rope): "
            "`pip install am-precision[te]` on a CUDA machine"
        ) from err
    angles = angles.float()

    def rotate(rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        # TE's table is [S, 1, 1, d]: one angle per position and dimension, broadcast over batch and heads.
        return apply_rotary_pos_emb(rows, table[:, None, None, :], tensor_format="bshd", fused=True)

    if angles.shape[0] == 1 or bool((angles == angles[:1]).all()):
        return rotate(x, angles[0])
    return torch.cat([rotate(x[b : b + 1], angles[b]) for b in range(x.shape[0])], dim=0)


def get_rope_config(config: Any, *, layer_type: str | None = None) -> tuple[float, dict[str, Any], float]:
    """`(rope_theta, rope_parameters, partial_rotary_factor)` from an HF v5 config.

    `rope_parameters` is returned as the same dict object the config holds. `partial_rotary_factor` is read from
    `rope_parameters`, then from the config attribute, and defaults to 1.0 (rotate the whole head).

    Args:
        config: an object with a `rope_parameters` dict holding `rope_theta`.
        layer_type: for configs whose `rope_parameters` is keyed by layer type (e.g. "full_attention",
            "sliding_attention"), which entry to read.

    Raises:
        ValueError: `rope_parameters` is missing or lacks `rope_theta`, or `layer_type` is missing/unknown for a
            per-layer-type dict.
    """
    rope_parameters = getattr(config, "rope_parameters", None)
    if not isinstance(rope_parameters, dict):
        raise ValueError(
            f"{type(config).__name__}.rope_parameters must be a dict holding 'rope_theta' (transformers v5 layout), "
            f"got {rope_parameters!r}"
        )
    per_layer_type = "rope_theta" not in rope_parameters and all(isinstance(v, dict) for v in rope_parameters.values())
    if per_layer_type and rope_parameters:
        if layer_type not in rope_parameters:
            raise ValueError(
                f"{type(config).__name__}.rope_parameters is keyed by layer type {sorted(rope_parameters)}; pass "
                f"layer_type=<one of them> (got {layer_type!r})"
            )
        rope_parameters = rope_parameters[layer_type]
    if "rope_theta" not in rope_parameters:
        raise ValueError(
            f"{type(config).__name__}.rope_parameters has no 'rope_theta' (keys: {sorted(rope_parameters)}); "
            "set rope_parameters['rope_theta'] to the RoPE base"
        )
    partial = rope_parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return rope_parameters["rope_theta"], rope_parameters, 1.0 if partial is None else float(partial)


def quack_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [B, S, H, d]` by transformers' `cos`/`sin` `[B or 1, S, d]` (the two halves repeated) with QuACK's
    rotary kernel (`quack.rotary.apply_rotary_emb`, non-interleaved; it takes the `[S, d / 2]` half tables).

    Equals `x·cos + rotate_half(x)·sin`. QuACK takes one table for the batch: rows whose positions differ are
    rotated one at a time.

    Raises:
        ImportError: quack-kernels is not installed (the models refuse `rope="quack"` before that).
    """
    try:
        from quack.rotary import apply_rotary_emb
    except ImportError as err:  # pragma: no cover - the models refuse rope='quack' without the package first
        raise ImportError(
            "rope='quack' requires the 'quack-kernels' package (CUDA only): `pip install quack-kernels`"
        ) from err
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)

    def rotate(rows: torch.Tensor, row_cos: torch.Tensor, row_sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary_emb(rows, row_cos.contiguous(), row_sin.contiguous(), interleaved=False)

    if cos.shape[0] == 1 or bool((cos == cos[:1]).all() and (sin == sin[:1]).all()):
        return rotate(x, cos[0], sin[0])
    return torch.cat([rotate(x[b : b + 1], cos[b], sin[b]) for b in range(x.shape[0])], dim=0)
