"""The router load-balancing loss of transformers MoE models (issue 22, item 2): the trainer's objective is the
model's own `loss` (cross-entropy + router_aux_loss_coef x aux), exactly, however the global batch is split.

In-process oracles against transformers for Mixtral, Qwen2-MoE and OLMoE built tiny from config; one multi-process
launch (Mixtral, dp 2 with two microbatches per rank vs the single process) for the trainer end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer.step_parts import RouterAuxLoss, TokenSumLoss, router_aux_spec

VOCAB = 64
COEF = 0.02


def _tiny(family: str, *, output_router_logits: bool = True) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=output_router_logits,
        router_aux_loss_coef=COEF, max_position_embeddings=64,
    )  # fmt: skip
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, **common)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=
                                             24, **common)  # fmt: skip
        cls = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.OlmoeConfig(num_experts=4, **common)
        cls = transformers.OlmoeForCausalLM
    torch.manual_seed(0)
    return cls(config).train()


def _windows(rows: int = 4, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq + 1), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_objective_and_gradient_equal_the_models_own_loss_however_the_batch_is_split(family: str) -> None:
    """CE (global token mean) + coef x aux, computed from pieces of the batch (2 "ranks" x 2 microbatches of one
    row: counts summed first, then each piece's share), equals transformers' loss on the whole batch, value and
    gradient; the imbalance is the worst layer's busiest expert over the mean, from the same top-k counts."""
    model = _tiny(family)
    assert router_aux_spec(model) == (4, 2, COEF, True)
    windows = _windows()
    inputs, labels = windows[:, :-1], windows[:, 1:]
    theirs = model(input_ids=windows[:, :-1], labels=windows[:, :-1].clone(), output_router_logits=True)
    # transformers shifts internally: its labels are the inputs; ours are pre-shifted (the last position has no
    # target in theirs), so compare on the windows' first seq positions with the last label ignored.
    labels = labels.clone()
    labels[:, -1] = -100
    ref_grads = torch.autograd.grad(theirs.loss, list(model.parameters()), allow_unused=True)

    router = RouterAuxLoss.for_model(model)
    assert router is not None and router.coef == COEF
    ce = TokenSumLoss()
    ce.denominator = float((labels != -100).sum())
    pieces = []
    counts = None
    for row in range(inputs.shape[0]):  # 4 pieces: e.g. dp 2 x 2 microbatches of one row each
        out = model(input_ids=inputs[row : row + 1], output_router_logits=True)
        c, p = router.layer_stats(out.router_logits)
        counts = c if counts is None else counts + c
        pieces.append((ce(out.logits, labels[row : row + 1]), p))
    assert counts is not None
    global_counts = router.reduce(counts)
    shares = [router.share(global_counts, p) for _, p in pieces]
    objective = sum(loss + router.coef * share for (loss, _), share in zip(pieces, shares, strict=True))
    aux = sum(s.detach() for s in shares)
    torch.testing.assert_close(objective, theirs.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(aux, theirs.aux_loss, rtol=1e-6, atol=1e-7)
    grads = torch.autograd.grad(objective, list(model.parameters()), allow_unused=True)
    for name, ours, ref in zip([n for n, _ in model.named_parameters()], grads, ref_grads, strict=True):
        if ref is None:
            assert ours is None or not ours.abs().any(), name
            continue
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7, msg=name)
    # the imbalance from the same counts, per layer on the whole batch
    worst = 0.0
    for logits in theirs.router_logits:
        top = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices.reshape(-1)
        load = torch.bincount(top, minlength=4).double()
        worst = max(worst, float(load.max() / load.mean()))
    assert router.last_imbalance == pytest.approx(worst, rel=1e-12)


def test_a_model_whose_config_leaves_the_aux_loss_out_keeps_cross_entropy_but_reports_the_imbalance() -> None:
    """`output_router_logits=False`: transformers' loss is cross-entropy alone, so ours is too (coef 0); the
    router logits still give the expert imbalance. A model without a router has no spec."""
    model = _tiny("mixtral", output_router_logits=False)
    assert router_aux_spec(model) == (4, 2, COEF, False)
    router = RouterAuxLoss.for_model(model)
    assert router is not None and router.coef == 0.0
    from trainer.models import build_model, preset_spec

    llama = build_model(
        preset_spec("llama", hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=False, vocab_size=None),
        seed=0,
    )
    assert router_aux_spec(llama) is None and RouterAuxLoss.for_model(llama) is None
