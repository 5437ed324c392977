"""Small building blocks shared by the Gemma 4 modules.

What it is for: `Gemma4RMSNorm`, transformers' Gemma 4 RMSNorm (same `weight`, same `with_scale=False` variant,
fp32 compute, output in the input dtype, weight initialized to ones — not Gemma 2/3's `1 + weight`) computed by
`rms_norm`, a hand-written autograd function: three passes forward (a fused vector norm, two multiplies) and a
closed-form backward (about six passes, the weight gradient and the row dot products as mat-vecs) that saves only
the input and the per-row `rstd` — instead of the decomposed op's pow/mean/add/rsqrt graph and its backward.
`Gemma4RotaryEmbedding`: transformers' per-layer-type rotary embedding whose (cos, sin) also carry the fp32 angles
when `fused` (`RotaryTables.angles`), for Transformer Engine's fused RoPE (`BackendConfig.rope_fusion`).
`make_linear` / `make_norm`: the projection and scaled-norm modules a `BackendConfig` asks for (`linear`: torch or
Transformer Engine `Linear`; `rms_norm`: this fp32 norm, `nn.RMSNorm` in the input dtype, TE's `RMSNorm`, QuACK's),
with transformers' parameter names (`weight`, `bias`), so checkpoints do not depend on the backend.
What it must not do: change the numerics beyond rounding order (checked against transformers in the tests), or
import transformer_engine / quack unless a backend asks for them (am-precision imports them lazily).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm as _HFGemma4RMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from am_precision import BackendConfig, initialize_linear_module, initialize_rms_norm_module

__all__ = [
    "Gemma4RMSNorm",
    "Gemma4RotaryEmbedding",
    "RotaryTables",
    "is_backend_linear",
    "is_backend_norm",
    "make_linear",
    "make_norm",
    "rms_norm",
]


class _RMSNormFunction(torch.autograd.Function):
    """`x · rstd · weight` with `rstd = (mean(x²) + eps)^-1/2` per row of a 2-D `[T, H]` input (weight optional)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        size = x.shape[-1]
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rstd = torch.rsqrt(norm.square_().div_(size).add_(eps))
        out = x * rstd
        if weight is not None:
            out.mul_(weight)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        size = x.shape[-1]
        grad = grad.contiguous()
        grad_weight = None
        if weight is not None:
            gx = grad * x  # g·x; weight gradient Σ_t g·x·rstd_t and the row dots Σ_j g·w·x are mat-vecs of it
            if ctx.needs_input_grad[1]:
                grad_weight = rstd.reshape(1, -1).mm(gx).reshape(-1)
            dot = gx.mv(weight).unsqueeze(-1)
            grad_normed = grad * weight
        else:
            dot = (grad * x).sum(dim=-1, keepdim=True)
            grad_normed = grad
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx [x·rstd] applied to g' = g·w: rstd·g' − x·rstd³·Σ(g'·x)/H
            coefficient = dot.mul_(rstd.pow(3)).div_(-size)
            grad_x = (grad_normed * rstd).addcmul_(x, coefficient)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of fp32 `x` (any leading shape), times `weight` when given."""
    shape = x.shape
    out = _RMSNormFunction.apply(x.reshape(-1, shape[-1]), weight, eps)
    return out.view(shape)


class Gemma4RMSNorm(_HFGemma4RMSNorm):
    """`x · (mean(x²) + eps)^-1/2 · weight` in fp32 (no weight with `with_scale=False`), cast back to x's dtype."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.with_scale else None
        return rms_norm(hidden_states.float(), weight, self.eps).type_as(hidden_states)


def make_linear(in_features: int, out_features: int, *, bias: bool, backend: BackendConfig | None) -> nn.Module:
    """`x [..., in] -> [..., out]` as `backend.linear` asks: "torch" (or no backend) `nn.Linear`, "te" Transformer
    Engine's `Linear`, "quack" QuACK's (both CUDA only; `backend_problems` refuses them where they cannot run).
    Parameters in torch's default dtype, as `nn.Linear` creates them."""
    if backend is None or backend.linear == "torch":
        return nn.Linear(in_features, out_features, bias=bias)
    return initialize_linear_module(
        backend.linear, in_features, out_features, bias=bias, dtype=torch.get_default_dtype()
    )


def make_norm(dim: int, *, eps: float, backend: BackendConfig | None) -> nn.Module:
    """A scaled RMSNorm over the last dim as `backend.rms_norm` asks: "torch_fp32" (or no backend) `Gemma4RMSNorm`
    (fp32 compute), "torch" `nn.RMSNorm` (computes in the input dtype), "te" TE's `RMSNorm`, "quack" QuACK's. All
    compute `x · rsqrt(mean(x²) + eps) · weight` with `weight` initialized to ones (Gemma 4's norm, not `1 + w`)."""
    if backend is None or backend.rms_norm == "torch_fp32":
        return Gemma4RMSNorm(dim, eps=eps)
    return initialize_rms_norm_module(backend.rms_norm, dim, eps=eps, dtype=torch.get_default_dtype())


def is_backend_linear(module: nn.Module) -> bool:
    """True for the modules `make_linear` builds (torch, TE or QuACK linears): init draws their weights."""
    return isinstance(module, nn.Linear) or (
        type(module).__name__ == "Linear" and getattr(module, "weight", None) is not None
    )


def is_backend_norm(module: nn.Module) -> bool:
    """True for the scaled norms `make_norm` builds: init sets their weights to ones."""
    if isinstance(module, Gemma4RMSNorm):
        return bool(module.with_scale)
    return isinstance(module, nn.RMSNorm) or (
        type(module).__name__ in ("RMSNorm", "QuackRMSNorm") and getattr(module, "weight", None) is not None
    )


# The attribute of a fused `cos` tensor that holds its fp32 angles (see RotaryTables).
_ANGLES_ATTR = "_am_rope_angles"


class RotaryTables(tuple):
    """`(cos, sin)` `[B or 1, S, d]` in the activation dtype, plus `angles` `[B or 1, S, d]` fp32 radians (the
    `cat(freqs, freqs)` cos/sin were computed from) when the rotary embedding was built `fused`, else None.

    The angles survive torch rebuilding the tables from their elements (`type(x)(generator)`), which FSDP2 does when
    it casts a layer's forward inputs to its compute dtype (`MixedPrecisionPolicy.cast_forward_inputs`): they ride
    on `cos` itself (a Python attribute), and that cast returns `cos` unchanged when it already has the compute dtype
    — always so in a mixed-precision run, where the rotary embedding computes cos in the activations' dtype, which
    is FSDP2's `param_dtype`. The angles are never cast (they stay fp32: they are not an element of the tuple). A
    cast that makes a new `cos` drops them, and the fused RoPE then refuses loudly rather than guess.
    """

    angles: torch.Tensor | None

    def __new__(
        cls,
        cos: torch.Tensor | Iterable[torch.Tensor],
        sin: torch.Tensor | None = None,
        angles: torch.Tensor | None = None,
    ) -> RotaryTables:
        if sin is None:  # rebuilt from one iterable (see above): the angles come with cos, if it is the same tensor
            cos, sin = cos
            angles = getattr(cos, _ANGLES_ATTR, None)
        elif angles is not None:
            setattr(cos, _ANGLES_ATTR, angles)  # cos is this forward's own tensor (Gemma4RotaryEmbedding makes it)
        tables = super().__new__(cls, (cos, sin))
        tables.angles = angles
        return tables


class Gemma4RotaryEmbedding(Gemma4TextRotaryEmbedding):
    """transformers' `Gemma4TextRotaryEmbedding` (same buffers, same cos/sin); `fused=True` also hands over the
    angles TE's fused kernel rotates by (it computes cos/sin itself, without an attention scaling factor).

    Raises:
        ValueError: `fused` with a layer type whose RoPE scales cos/sin (attention_scaling != 1): TE's kernel has no
            such factor.
    """

    def __init__(self, config: Any, *, fused: bool = False) -> None:
        super().__init__(config)
        self.fused = fused
        if fused:
            scaled = {
                t: s
                for t in sorted(set(config.layer_types))
                if (s := float(getattr(self, f"{t}_attention_scaling", 1.0))) != 1.0
            }
            if scaled:
                raise ValueError(
                    f"rope_fusion=True: the RoPE of {sorted(scaled)} scales cos/sin by {scaled}, which Transformer "
                    "Engine's fused kernel cannot; leave rope_fusion False for this config"
                )

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str) -> RotaryTables:
        cos, sin = super().forward(x, position_ids, layer_type)
        if not self.fused:
            return RotaryTables(cos, sin)
        inv_freq = getattr(self, f"{layer_type}_inv_freq").to(device=x.device, dtype=torch.float)
        freqs = position_ids[..., None].float() * inv_freq
        return RotaryTables(cos, sin, torch.cat((freqs, freqs), dim=-1))
