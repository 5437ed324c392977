"""Weight-initialization helpers shared by the blocks (private).

What it is for: resetting a linear layer of any backend (torch, TE, quack) and zeroing its bias without assuming its
class. What it must not do: sample in a low-precision dtype (callers run under `yield_fp32_model`).
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def reset_linear_(module: nn.Module | None) -> None:
    """`module.reset_parameters()` when it has one, then zero its bias (if any: norms have none, or reset it)."""
    if module is None:
        return
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.zero_()


def weight_of(module: nn.Module) -> torch.Tensor:
    """The `weight` tensor of a linear-like module (a clear error instead of a None deep inside an init)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor to initialize.")
    return weight
