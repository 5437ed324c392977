"""Held-out validation (trainer/evaluation.py), in-process: the held-out tokens never reach the training stream,
the validation windows, and every incomplete or contradictory request refused before the run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_ARGS
from trainer.config import find_problems, parse_args
from trainer.evaluation import split_validation, validation_batches
from trainer.validation import BadInput, validate


def test_val_fraction_holds_out_the_tail_of_the_data(tmp_path: Path) -> None:
    args = [*TINY_ARGS, "--model", "llama", "--val-every", "2", "--val-fraction", "0.25", "--out", str(tmp_path)]
    cfg = parse_args(args)
    _, _, corpus, _, _ = validate(cfg, world_size=1)
    whole = validate(parse_args([*TINY_ARGS, "--model", "llama", "--out", str(tmp_path)]), world_size=1)[2].train
    assert corpus.val is not None
    assert torch.equal(torch.cat([corpus.train, corpus.val]), whole)
    assert corpus.val.numel() == round(whole.numel() * 0.25)


def test_validation_batches_are_consecutive_held_out_windows() -> None:
    tokens = torch.arange(1000)
    cfg = parse_args(["--seq-len", "8", "--global-batch", "2", "--val-batches", "3"])
    batches = validation_batches(tokens, cfg)
    assert len(batches) == 3
    starts = [int(inputs[i, 0]) for inputs, _ in batches for i in range(2)]
    assert starts == [0, 8, 16, 24, 32, 40]
    for inputs, labels in batches:
        assert inputs.shape == labels.shape == (2, 8)
        assert torch.equal(labels, inputs + 1)
    train, val = split_validation(tokens, fraction=0.1)
    assert (train.numel(), val.numel(), int(val[0])) == (900, 100, 900)


def test_incomplete_or_contradictory_validation_requests_are_refused(tmp_path: Path) -> None:
    def problems(*args: str) -> list[str]:
        return find_problems(parse_args(list(args)), world_size=1)

    assert problems("--val-every", "5", "--val-fraction", "0.1") == []
    assert "needs held-out data: give --val-fraction F" in problems("--val-every", "5")[0]
    both = problems("--val-every", "5", "--val-fraction", "0.1", "--val-data", "x.txt")
    assert both == ["--val-fraction and --val-data both name the validation data: give one of them"]
    assert problems("--val-fraction", "0.1") == ["--val-fraction only apply with --val-every N > 0"]
    bad = problems("--val-every", "-1", "--val-batches", "0", "--val-fraction", "1.5")
    assert len(bad) == 4, bad  # val-every, val-batches, "only with --val-every", the fraction's range
    # Too little held-out data for --val-batches: the numbers needed are named.
    short = [*TINY_ARGS, "--model", "llama", "--out", str(tmp_path), "--val-every", "1", "--val-batches", "9"]
    (tmp_path / "val.txt").write_text("a short held-out text")
    with pytest.raises(BadInput, match=r"--val-data .*val.txt holds 21 validation tokens, but --val-batches 9 x"):
        validate(parse_args([*short, "--val-data", str(tmp_path / "val.txt")]), world_size=1)
