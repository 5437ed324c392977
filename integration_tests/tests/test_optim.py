"""`--optimizer` and `--lr-schedule` (trainer/optim.py): one builder, schedules as functions of the step, the
default identical to the trainer's original AdamW + warm-up + cosine."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from trainer.config import find_problems, parse_args
from trainer.optim import build_optimizers, lr_at


def test_cosine_default_is_the_original_rule() -> None:
    cfg = parse_args(["--steps", "100", "--warmup-steps", "10", "--lr", "1e-3", "--min-lr", "1e-4"])
    assert cfg.lr_schedule == "cosine"
    for step in range(1, 101):  # the formula the trainer used before --lr-schedule existed, bit for bit
        if step <= 10:
            want = 1e-3 * step / 10
        else:
            want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1.0 + math.cos(math.pi * min((step - 10) / 90, 1.0)))
        assert lr_at(step, cfg) == want


def test_linear_and_constant_schedules() -> None:
    common = ["--steps", "20", "--warmup-steps", "4", "--lr", "1e-3"]
    linear = parse_args([*common, "--min-lr", "1e-4", "--lr-schedule", "linear"])
    assert [lr_at(s, linear) for s in (2, 4)] == pytest.approx([5e-4, 1e-3])
    assert lr_at(12, linear) == pytest.approx(1e-3 - 0.9e-3 * 8 / 16)
    assert lr_at(20, linear) == pytest.approx(1e-4)
    values = [lr_at(s, linear) for s in range(4, 21)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    constant = parse_args([*common, "--lr-schedule", "constant"])
    assert lr_at(2, constant) == pytest.approx(5e-4)
    assert {lr_at(s, constant) for s in range(4, 21)} == {1e-3}
    # constant ignores --min-lr, so a peak below the default min-lr is fine, and an explicit --min-lr is refused
    assert find_problems(parse_args(["--lr", "1e-4", "--lr-schedule", "constant"]), world_size=1) == []
    (problem,) = find_problems(parse_args(["--min-lr", "1e-5", "--lr-schedule", "constant"]), world_size=1)
    assert "--min-lr 1e-05 does not apply to --lr-schedule constant" in problem


def test_build_optimizers_makes_one_per_part_as_asked() -> None:
    parts = [torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)]
    adamw = build_optimizers(parts, parse_args(["--adam-eps", "1e-6", "--weight-decay", "0.1"]))
    assert [type(o) for o in adamw] == [torch.optim.AdamW] * 2
    group = adamw[0].param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.95), 1e-6, 0.1)
    sgd = build_optimizers(parts, parse_args(["--optimizer", "sgd", "--momentum", "0.5"]))
    assert [type(o) for o in sgd] == [torch.optim.SGD] * 2
    assert sgd[1].param_groups[0]["momentum"] == 0.5
    assert build_optimizers(parts, parse_args(["--optimizer", "sgd"]))[0].param_groups[0]["momentum"] == 0.9
    assert [p for g in sgd[1].param_groups for p in g["params"]] == list(parts[1].parameters())


def test_options_of_the_other_optimizer_are_refused() -> None:
    problems = find_problems(parse_args(["--momentum", "0.9"]), world_size=1)
    assert problems == ["--momentum 0.9 applies to --optimizer sgd only, not adamw"]
    problems = find_problems(
        parse_args(["--optimizer", "sgd", "--adam-eps", "1e-6", "--momentum", "1.5"]), world_size=1
    )
    assert len(problems) == 2, problems
    assert "--momentum 1.5: must be a number in [0, 1)" in problems[0]
    assert "--adam-eps 1e-06 applies to --optimizer adamw only" in problems[1]
