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
    corpus = validate(cfg, world_size=1).corpus
    whole = validate(parse_args([*TINY_ARGS, "--model", "llama", "--out", str(tmp_path)]), world_size=1).corpus.train
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


def test_validation_runs_in_eval_mode_so_dropout_does_not_change_the_loss(one_rank_group) -> None:
    """Issue 22 item 4: a model with dropout (HF Llama, attention dropout 0.5) gets, from `evaluate` through the
    loop's forward-only path, exactly the loss of its eval-mode single forward, and goes back to training mode."""
    from trainer.batch_step import forward_backward
    from trainer.evaluation import evaluate
    from trainer.models import build_model, preset_spec
    from trainer.step_parts import TokenSumLoss

    from am_pipelining import PipelineCausalLMLoss

    spec = preset_spec("llama", hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=False, vocab_size=None)
    model = build_model(spec, seed=0).train()
    attentions = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert attentions
    for attention in attentions:
        attention.attention_dropout = 0.5
    cfg = parse_args(["--seq-len", "16", "--global-batch", "2", "--val-batches", "2"])
    batches = validation_batches(torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0)), cfg)
    loss_fn = TokenSumLoss()
    loss_module = PipelineCausalLMLoss(loss_fn, model=model)

    def run_batch(inputs: torch.Tensor, labels: torch.Tensor, *, train: bool) -> torch.Tensor:
        return forward_backward(model, loss_module, inputs, labels, microbatch_size=cfg.microbatch_size, backward=train)

    validation = evaluate(batches, run_batch=run_batch, loss_fn=loss_fn, model_parts=[model])
    assert all(m.training for m in model.modules()), "back in training mode"
    inputs, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    reference = TokenSumLoss()
    reference.denominator = float(labels.numel())
    with torch.no_grad():
        model.eval()
        eval_loss = float(reference(model(input_ids=inputs).logits, labels))
        model.train()
        train_loss = float(reference(model(input_ids=inputs).logits, labels))
    assert validation == pytest.approx(eval_loss, rel=1e-6, abs=0.0)
    assert abs(train_loss - eval_loss) > 1e-3, "dropout is on in training mode (else this test proves nothing)"


def test_eval_mode_keeps_a_models_training_objective_and_restores_every_flag() -> None:
    """Nemotron-H declares `compute_mtp_in_eval`: under `eval_mode` its MTP term still runs (the validation loss is
    the training objective, and a pipeline stage keeps its output shapes); afterwards every flag is as before."""
    from trainer.evaluation import eval_mode
    from trainer.models import build_model, preset_spec

    spec = preset_spec("nemotron", hidden_size=32, num_layers=4, mtp_depths=1, tie_embeddings=False, vocab_size=None)
    model = build_model(spec, seed=0).train()
    model.mtp.eval()  # a submodule in its own mode comes back in it
    with torch.no_grad(), eval_mode([model]):
        assert not any(m.training for m in model.modules())
        output = model(input_ids=torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0)))
        assert len(output.mtp_per_depth_h) == 1
    assert model.training
    assert not model.mtp.training
    assert model.compute_mtp_in_eval is False
