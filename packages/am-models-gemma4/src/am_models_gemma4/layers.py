"""Small building blocks shared by the Gemma 4 modules.

What it is for: `Gemma4RMSNorm`, transformers' Gemma 4 RMSNorm (same `weight`, same `with_scale=False` variant,
fp32 compute, output in the input dtype, weight initialized to ones — not Gemma 2/3's `1 + weight`) computed by
`rms_norm`, a hand-written autograd function: three passes forward (a fused vector norm, two multiplies) and a
closed-form backward (about six passes, the weight gradient and the row dot products as mat-vecs) that saves only
the input and the per-row `rstd` — instead of the decomposed op's pow/mean/add/rsqrt graph and its backward.
What it must not do: change the numerics beyond rounding order (checked against transformers in the tests).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm as _HFGemma4RMSNorm

__all__ = ["Gemma4RMSNorm", "rms_norm"]


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
