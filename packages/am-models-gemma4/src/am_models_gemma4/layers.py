"""Small building blocks shared by the Gemma 4 modules.

What it is for: `Gemma4RMSNorm`, transformers' Gemma 4 RMSNorm (same `weight`, same `with_scale=False` variant,
fp32 compute, output in the input dtype, weight initialized to ones — not Gemma 2/3's `1 + weight`) computed by
torch's fused `F.rms_norm` kernel instead of five elementwise passes, which matters on the CPU and in backward.
What it must not do: change the numerics beyond rounding order (checked against transformers in the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm as _HFGemma4RMSNorm

__all__ = ["Gemma4RMSNorm"]


class Gemma4RMSNorm(_HFGemma4RMSNorm):
    """`x · (mean(x²) + eps)^-1/2 · weight` in fp32 (no weight with `with_scale=False`), cast back to x's dtype."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.with_scale else None
        return F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), weight, self.eps).type_as(hidden_states)
