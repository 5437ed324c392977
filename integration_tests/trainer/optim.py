"""Optimizer and learning-rate schedule of the reference trainer: `--optimizer`, `--lr-schedule` and their numbers.

What it is for: `build_optimizers(parts, cfg)` is the ONE place that turns the options into optimizers (one per model
part: the same math as one optimizer over every parameter, and each part's state stays with its FSDP2 shards and
pipeline stages), and `lr_at(step, cfg)` the one rule for the learning rate of a step. The schedule is a pure function
of the step, so a resumed run (whose step counter the checkpoint restores) continues it exactly; the optimizers'
state (AdamW moments, SGD momentum buffers) is in the checkpoint.
What it must not do: step or clip (the loop does), or read anything but the options.

Defaults (`--optimizer adamw --lr-schedule cosine`) are the trainer's original behaviour: AdamW with betas
(0.9, 0.95), linear warm-up, cosine decay to `--min-lr`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from trainer.config import RunConfig

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("cosine", "linear", "constant")
ADAMW_BETAS = (0.9, 0.95)
DEFAULT_SGD_MOMENTUM = 0.9
_DEFAULT_ADAM_EPS = 1e-8  # the parser's defaults: another value is a request that must apply
_DEFAULT_MIN_LR = 3e-4


def build_optimizers(parts: list[nn.Module], cfg: RunConfig) -> list[torch.optim.Optimizer]:
    """One optimizer per model part, as `--optimizer` says, at the peak `--lr` (the loop sets each step's rate)."""
    if cfg.optimizer == "adamw":
        return [
            torch.optim.AdamW(
                part.parameters(), lr=cfg.lr, betas=ADAMW_BETAS, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
            )
            for part in parts
        ]
    if cfg.optimizer == "sgd":
        momentum = DEFAULT_SGD_MOMENTUM if cfg.momentum is None else cfg.momentum
        return [
            torch.optim.SGD(part.parameters(), lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay)
            for part in parts
        ]
    raise ValueError(f"--optimizer {cfg.optimizer!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warm-up to `--lr` over `--warmup-steps`, then
    `--lr-schedule`: cosine or linear decay to `--min-lr` at `--steps`, or constant `--lr`."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min((step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1), 1.0)
    if cfg.lr_schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


def optimizer_option_problems(cfg: RunConfig) -> list[str]:
    """Options that do not apply to the chosen optimizer or schedule (refused: an option is never ignored)."""
    problems = []
    if cfg.momentum is not None:
        if cfg.optimizer != "sgd":
            problems.append(f"--momentum {cfg.momentum} applies to --optimizer sgd only, not {cfg.optimizer}")
        elif not (math.isfinite(cfg.momentum) and 0.0 <= cfg.momentum < 1.0):
            problems.append(f"--momentum {cfg.momentum}: must be a number in [0, 1)")
    if cfg.optimizer == "sgd" and cfg.adam_eps != _DEFAULT_ADAM_EPS:
        problems.append(f"--adam-eps {cfg.adam_eps} applies to --optimizer adamw only; drop it for sgd")
    if cfg.lr_schedule == "constant" and cfg.min_lr != _DEFAULT_MIN_LR:
        problems.append(
            f"--min-lr {cfg.min_lr} does not apply to --lr-schedule constant (the rate stays at --lr after the "
            "warm-up); drop it or choose cosine / linear"
        )
    return problems


__all__ = [
    "ADAMW_BETAS",
    "DEFAULT_SGD_MOMENTUM",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "build_optimizers",
    "lr_at",
    "optimizer_option_problems",
    "set_lr",
]
