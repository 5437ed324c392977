"""Expert load statistics: routed (token, k) pairs per expert, read once per training step.

What it is for: every `GroupedExperts` adds its per-expert pair counts to a device buffer in each forward (no host
sync); `expert_load(model)` reads every layer's buffer with ONE concatenation, at most one all-reduce (when a group is
given: the data-parallel group, for global counts) and one device-to-host copy, and reports tokens per expert and the
imbalance max / mean per layer. `reset_expert_load` zeroes the buffers (or pass `reset=True`).
What it must not do: update routing (the bias update that reads these counts is `balance.update_expert_bias`), or
count a forward twice (activation-checkpoint recomputation is not counted; see `GroupedExperts._record_load`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .parallel import expert_modules

__all__ = ["ExpertLoad", "expert_load", "reset_expert_load"]


@dataclass(frozen=True)
class ExpertLoad:
    """Routed (token, k) pairs per expert of each MoE layer (padding excluded), as int64 CPU tensors `[E]`."""

    tokens_per_expert: dict[str, torch.Tensor]

    def max_over_mean(self) -> dict[str, float]:
        """Per layer: the busiest expert's pairs over the mean per expert (1.0 = perfectly balanced; NaN: no tokens)."""
        ratios = {}
        for name, counts in self.tokens_per_expert.items():
            mean = counts.double().mean().item()
            ratios[name] = counts.max().item() / mean if mean > 0 else math.nan
        return ratios

    def max_imbalance(self) -> float | None:
        """The largest max / mean over the layers (None without MoE layers; NaN if no layer saw a token)."""
        if not self.tokens_per_expert:
            return None
        ratios = [r for r in self.max_over_mean().values() if not math.isnan(r)]
        return max(ratios) if ratios else math.nan


def expert_load(model: nn.Module, *, group: dist.ProcessGroup | None = None, reset: bool = False) -> ExpertLoad:
    """This step's expert load of every `GroupedExperts` in `model`, summed over `group` when given.

    Call it on every rank of `group` at the same point of the step (it is a collective then). Each rank counts the
    pairs of its OWN tokens for every global expert (before dispatch), so summing over the data-parallel ranks
    (dp x cp, which includes ep) gives the global load.
    """
    found = expert_modules(model)
    if not found:
        return ExpertLoad({})
    buffers = [experts.tokens_per_expert for _, experts in found]
    flat = torch.cat([b.reshape(-1) for b in buffers])
    if group is not None:
        dist.all_reduce(flat, group=group)
    host = flat.cpu()
    if reset:
        reset_expert_load(model)
    sizes = [b.numel() for b in buffers]
    return ExpertLoad({name: part.clone() for (name, _), part in zip(found, host.split(sizes), strict=True)})


def reset_expert_load(model: nn.Module) -> None:
    """Zero every `GroupedExperts` load counter in `model` (start of a step)."""
    with torch.no_grad():
        for _, experts in expert_modules(model):
            experts.tokens_per_expert.zero_()
