"""`--fsdp-optimizations`: BackendConfig.enable_fsdp_optimizations of an am-models preset, honoured by the trainer.

The trainer calls the model's own hooks around gradient accumulation, as upstream's training loop does:
`prepare_for_grad_accumulation` before the first microbatch's backward, `prepare_for_final_backward` before the last
(trainer/batch_step.py). In-process: the hooks run in that order, on a preset built with the field, and the option is
refused where it would do nothing (pp > 1, no FSDP2, a model without the hooks). Launched: Nemotron-H at dp 2 x ep 2
with 2 microbatches per rank equals the same run without the option EXACTLY (losses and final weights): deferring the
reduce-scatter and the resharding changes when FSDP2 communicates, not what it sums.
"""

from __future__ import annotations

import pytest
import torch
from trainer.batch_step import forward_backward
from trainer.config import parse_args
from trainer.models import build_model, preset_spec
from trainer.validation import BadInput, validate

TINY = ["--hidden-size", "32", "--layers", "2", "--seq-len", "16", "--global-batch", "4", "--steps", "1"]


def test_the_hooks_run_around_the_microbatches_in_upstreams_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.step_parts import TokenSumLoss

    from am_pipelining import PipelineCausalLMLoss

    spec = preset_spec(
        "nemotron", hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=False, vocab_size=None,
        fsdp_optimizations=True,
    )  # fmt: skip
    model = build_model(spec, seed=0)
    assert model.backend.enable_fsdp_optimizations
    events: list[str] = []
    for hook in ("prepare_for_grad_accumulation", "prepare_for_final_backward"):
        inner = getattr(model, hook)

        def recorded(*, pp_enabled: bool, hook: str = hook, inner=inner) -> None:
            events.append(f"{hook}(pp_enabled={pp_enabled})")
            inner(pp_enabled=pp_enabled)

        monkeypatch.setattr(model, hook, recorded)
    backward = torch.Tensor.backward

    def counted(self, *args, **kwargs):
        events.append("backward")
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", counted)
    ids = torch.randint(3, 256, (3, 16))
    loss = PipelineCausalLMLoss(TokenSumLoss(), model=model)
    forward_backward(model, loss, ids, ids.clone(), microbatch_size=1, fsdp_hooks=True)
    assert events == [
        "prepare_for_grad_accumulation(pp_enabled=False)",
        "backward",
        "backward",
        "prepare_for_final_backward(pp_enabled=False)",
        "backward",
    ]
    events.clear()
    forward_backward(model, loss, ids, ids.clone(), microbatch_size=1)  # without the plan's flag: no hook
    assert events == ["backward"] * 3


def test_the_option_is_refused_where_it_would_do_nothing() -> None:
    with pytest.raises(BadInput) as info:
        validate(parse_args(["--model", "nemotron", "--pp", "2", "--dtype", "fp32", "--fsdp-optimizations", *TINY]),
                 world_size=2)  # fmt: skip
    message = str(info.value)
    assert "which the pipeline schedules already do at --pp 2" in message
    assert "this run has no FSDP2 (dp x cp = 1, --dtype fp32)" in message
    with pytest.raises(BadInput, match="not of 'llama'"):
        validate(parse_args(["--model", "llama", "--dp", "2", "--fsdp-optimizations", *TINY]), world_size=2)
    plan = validate(
        parse_args(["--model", "gemma4-moe", "--dp", "2", "--fsdp-optimizations", *TINY]), world_size=2
    ).plan
    assert plan.fsdp_optimizations
    assert plan.to_json()["fsdp_optimizations"] is True


def test_deferred_sync_equals_the_run_without_exactly(runs) -> None:
    """dp 2 x ep 2, 2 microbatches per rank: the hooks defer every FSDP unit's reduce-scatter (dense and expert
    units) to the last microbatch; losses and final weights are bitwise those of the run without the option."""
    optimized, plain = runs.get("nemotron-dp2-ep2-fsdp-opt").check(), runs.get("nemotron-dp2-ep2").check()
    assert optimized.summary["plan"]["fsdp_optimizations"] is True
    assert plain.summary["plan"]["fsdp_optimizations"] is False
    assert optimized.summary["plan"]["batch"]["microbatches"] == 2
    assert optimized.summary["losses"] == plain.summary["losses"]
    got, want = optimized.final_weights(), plain.final_weights()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
