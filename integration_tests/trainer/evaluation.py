"""Held-out validation of the reference trainer: `--val-every N` with `--val-fraction F` or `--val-data PATH`.

What it is for: the validation loss, computed on tokens the training stream never contains, through the SAME
forward and loss path as training (the loop's `run_batch`, with backward off: the pipeline schedule's `eval` at
pp > 1, a forward-only pass at pp = 1, CP-sharded like training, each dp replica on its rows), so it is the global
token mean over the validation batches and equal on every layout to the single-process value.
  - `--val-fraction F` holds out the LAST F of the `--data` tokens (`split_validation`); training windows come from
    the rest only.
  - `--val-data PATH` reads another corpus (any `--data` format, same tokenizer).
Every evaluation reads the same `--val-batches` global batches of non-overlapping windows from the start of the
held-out tokens, so the values of one run are comparable step to step. The model runs in eval mode under
`torch.no_grad()` (`model.eval()` on every model part, pipeline stages included, then back to training mode): no
dropout, so a model with dropout gets the loss of its deterministic forward. A model that declares
`compute_mtp_in_eval` (Nemotron-H's multi-token prediction) keeps that term on for the evaluation, so training and
validation losses measure the same objective and a pipeline stage's outputs keep the shapes it was built with.
What it must not do: touch the optimizer or the training data stream, or run a collective the training ranks do not
all run (every rank evaluates at the same steps).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from trainer.config import RunConfig


def validation_option_problems(cfg: RunConfig) -> list[str]:
    """`--val-every`, `--val-fraction`, `--val-data` and `--val-batches` must make one complete request."""
    problems = []
    if cfg.val_every < 0:
        problems.append(f"--val-every {cfg.val_every}: must be >= 0 (0: no validation)")
    if cfg.val_batches < 1:
        problems.append(f"--val-batches {cfg.val_batches}: must be >= 1")
    sources = [f"--{name.replace('_', '-')}" for name in ("val_fraction", "val_data") if getattr(cfg, name) is not None]
    if cfg.val_every > 0 and not sources:
        problems.append(
            f"--val-every {cfg.val_every} needs held-out data: give --val-fraction F (the last F of --data) or "
            "--val-data PATH"
        )
    if len(sources) == 2:
        problems.append("--val-fraction and --val-data both name the validation data: give one of them")
    if sources and cfg.val_every <= 0:
        problems.append(f"{' and '.join(sources)} only apply with --val-every N > 0")
    if cfg.val_fraction is not None and not (math.isfinite(cfg.val_fraction) and 0.0 < cfg.val_fraction < 1.0):
        problems.append(f"--val-fraction {cfg.val_fraction}: must be a number in (0, 1)")
    return problems


def pipeline_eval_problems(cfg: RunConfig, plan: Any) -> list[str]:
    """pp > 1: the schedule must run forward only (torch's `schedule.eval`); else `--val-every` is refused."""
    if cfg.val_every <= 0 or plan is None:
        return []
    schedule_class = getattr(plan, "schedule_class", None)
    if schedule_class is not None and not callable(getattr(schedule_class, "eval", None)):
        return [
            f"--val-every {cfg.val_every} with --pp {cfg.pp}: the {cfg.schedule} schedule of this torch has no "
            "forward-only `eval`, so no validation loss can be computed in this layout; drop --val-every or use "
            "another --schedule"
        ]
    return []


def split_validation(tokens: torch.Tensor, *, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, held-out tokens): the last `round(fraction * N)` tokens are held out."""
    held_out = round(tokens.numel() * fraction)
    return tokens[: tokens.numel() - held_out], tokens[tokens.numel() - held_out :]


def validation_windows_needed(cfg: RunConfig) -> int:
    """Tokens the held-out data must hold: `--val-batches` x `--global-batch` non-overlapping windows (+1 label)."""
    return cfg.val_batches * cfg.global_batch * cfg.seq_len + 1


def validation_batches(tokens: torch.Tensor, cfg: RunConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The `--val-batches` global batches (input_ids, labels), int64 `[global_batch, seq_len]`: consecutive
    non-overlapping windows from the start of the held-out tokens (checked long enough by validation.py)."""
    batches = []
    for b in range(cfg.val_batches):
        starts = [(b * cfg.global_batch + i) * cfg.seq_len for i in range(cfg.global_batch)]
        windows = torch.stack([tokens[s : s + cfg.seq_len + 1] for s in starts])
        batches.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return batches


@contextlib.contextmanager
def eval_mode(parts: Sequence[nn.Module]) -> Iterator[None]:
    """Every module of `parts` in eval mode for the duration (dropout off), each restored to the mode it had.

    A module that declares `compute_mtp_in_eval` gets it set to True meanwhile (its training objective, e.g.
    Nemotron-H's multi-token-prediction term, stays in the validation loss), then restored.
    """
    modes = [(module, module.training) for part in parts for module in part.modules()]
    flag_name = "compute_mtp_in_eval"  # a plain attribute the model declares (read and set by name, not typed)
    mtp = [(m, getattr(m, flag_name)) for m, _ in modes if isinstance(getattr(m, flag_name, None), bool)]
    try:
        for module, _ in mtp:
            setattr(module, flag_name, True)
        for part in parts:
            part.eval()
        yield
    finally:
        for module, training in modes:
            module.training = training
        for module, flag in mtp:
            setattr(module, flag_name, flag)


def evaluate(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    run_batch: Callable[..., torch.Tensor],
    loss_fn: Any,
    model_parts: Sequence[nn.Module] = (),
) -> float:
    """The validation loss: the global token mean over `batches` (collective: every rank calls it).

    `run_batch(input_ids, labels, train=False)` is the loop's step body (this rank's share of the loss, detached);
    `loss_fn` is the training loss whose `denominator` (the label-token count the shares are divided by) is set to the
    count of all validation batches for the duration, then restored. `model_parts` (this rank's model parts or
    pipeline stage modules) run in eval mode for the duration (`eval_mode`), then go back to their modes.
    """
    saved = loss_fn.denominator
    loss_fn.denominator = float(sum(int((labels != -100).sum()) for _, labels in batches))
    try:
        with torch.no_grad(), eval_mode(model_parts):
            total = torch.stack([run_batch(inputs, labels, train=False) for inputs, labels in batches]).sum()
    finally:
        loss_fn.denominator = saved
    dist.all_reduce(total)
    return float(total)


__all__ = [
    "eval_mode",
    "evaluate",
    "pipeline_eval_problems",
    "split_validation",
    "validation_batches",
    "validation_option_problems",
    "validation_windows_needed",
]
