"""HF integration: a tiny LlamaForCausalLM trained 3 steps with CP=2 on gloo equals the same training at CP=1.

Each rank builds the same seeded model, shards every batch with `make_cp_batch_and_ctx(..., model=model)`, runs
forward and backward inside the returned context (the model's HF attention is routed to the ring), takes the
global-token-mean loss and sums gradients over the CP group (`cp_token_mean_loss`, `all_reduce_cp_gradients`). The
pytest process trains the same model on the unsharded batches with plain HF attention (its own causal + padding
mask) and compares the loss of every step and every final parameter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cp_dist import case_result, run_cases, run_group
from torch.distributed.device_mesh import init_device_mesh

from am_context_parallel import (
    RING_ATTENTION_NAME,
    IdentityLayout,
    RingAttentionContext,
    all_reduce_cp_gradients,
    count_ring_bytes,
    cp_token_mean_loss,
    make_cp_batch_and_ctx,
    register_ring_attention,
)

transformers = pytest.importorskip("transformers")

STEPS = 3
LR = 0.5
# fp32 parity after 3 SGD steps: the ring changes only the order of fp32 sums (~1e-7 relative per op).
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
# fp32 gradients of the first step: same reordering of fp32 sums; atol covers entries near 0.
GRAD_RTOL = 1e-5
GRAD_ATOL = 1e-6


def _model(attn_implementation: str = "sdpa") -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(1234)
    return transformers.LlamaForCausalLM(config).float()


def _batch(step: int) -> dict[str, torch.Tensor]:
    """13 tokens (CP=2 pads to 16); row 1 is right-padded by 3 tokens; labels already shifted (label t = token t+1)."""
    gen = torch.Generator().manual_seed(step)
    input_ids = torch.randint(1, 64, (2, 13), generator=gen)
    attention_mask = torch.ones(2, 13, dtype=torch.long)
    attention_mask[1, 10:] = 0
    input_ids[1, 10:] = 0
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:]
    labels[attention_mask == 0] = -100
    labels[1, 9] = -100  # the last real token of row 1 has no next token
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _train_cp(mesh: Any) -> dict[str, Any]:
    group = mesh.get_group()
    model = _model()
    initial = _params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first_logits, first_grads = [], None, {}
    with count_ring_bytes() as stats:
        for step in range(STEPS):
            ctx, batch = make_cp_batch_and_ctx(mesh, _batch(step), model=model)
            with ctx():
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
                local_loss, global_loss = cp_token_mean_loss(logits, batch["labels"], group=group)
                local_loss.backward()
            if step == 0:
                first_logits = ctx.unshard(logits.detach(), seq_dim=1)
            all_reduce_cp_gradients(model, group=group)
            if step == 0:
                first_grads = _grads(model)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(global_loss.item())
    return {
        "losses": losses,
        "params": _params(model),
        "initial": initial,
        "first_logits": first_logits,
        "first_grads": first_grads,
        "ring_calls": stats.calls,
    }


def _eager_forward(mesh: Any) -> torch.Tensor:
    """The `eager` attention name is routed too: logits equal the reference forward."""
    model = _model("eager")
    ctx, batch = make_cp_batch_and_ctx(mesh, _batch(0), model=model)
    with torch.no_grad(), ctx():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return ctx.unshard(logits, seq_dim=1)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    assert dist.get_world_size(mesh.get_group()) == 2
    return run_cases({"train": lambda: _train_cp(mesh), "eager": lambda: _eager_forward(mesh)})


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(2, _worker)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """CP=1: plain HF attention on the full batches, the same loss definition (token mean over the batch)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses: list[float] = []
    first_logits, first_grads = None, {}
    for step in range(STEPS):
        batch = _batch(step)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits.reshape(-1, 64), batch["labels"].reshape(-1), ignore_index=-100)
        loss.backward()
        if step == 0:
            first_logits, first_grads = logits.detach(), _grads(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": _params(model),
        "initial": _params(_model()),
        "first_logits": first_logits,
        "first_grads": first_grads,
    }


def _real_tokens() -> torch.Tensor:
    return _batch(0)["attention_mask"].bool()


def test_same_initial_weights(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    for rank in range(2):
        initial = case_result(results, "train", rank)["initial"]
        assert all(torch.equal(initial[name], reference["initial"][name]) for name in reference["initial"])


def test_forward_logits_match_cp1(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    real = _real_tokens()
    for rank in range(2):
        logits = case_result(results, "train", rank)["first_logits"]
        torch.testing.assert_close(logits[real], reference["first_logits"][real], rtol=1e-5, atol=1e-5)
        eager = case_result(results, "eager", rank)
        torch.testing.assert_close(eager[real], reference["first_logits"][real], rtol=1e-5, atol=1e-5)


def test_first_step_gradients_match_cp1(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """After the CP gradient sum, every parameter's gradient equals the CP=1 gradient of the same loss."""
    expected = reference["first_grads"]
    assert len(expected) == len(reference["params"])  # every parameter got a gradient
    for rank in range(2):
        grads = case_result(results, "train", rank)["first_grads"]
        assert sorted(grads) == sorted(expected)
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_three_training_steps_match_cp1(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    for rank in range(2):
        trained = case_result(results, "train", rank)
        assert trained["ring_calls"] == STEPS * 2  # every attention layer of every step ran the ring
        for step, (got, expected) in enumerate(zip(trained["losses"], reference["losses"], strict=True)):
            assert abs(got - expected) <= LOSS_RTOL * abs(expected), f"step {step}: {got} vs {expected}"
        moved = 0.0
        for name, expected in reference["params"].items():
            torch.testing.assert_close(trained["params"][name], expected, rtol=0, atol=PARAM_ATOL, msg=name)
            moved = max(moved, (expected - reference["initial"][name]).abs().max().item())
        assert moved > 100 * PARAM_ATOL, "training must move the weights well beyond the tolerance"


def test_routing_is_scoped_to_the_model() -> None:
    """Single process, C=1 context: inside, the given model's attention is the ring (its config names it) while
    transformers' registry and every other model keep theirs; outside, the model's own sdpa is back."""
    from transformers.modeling_utils import AttentionInterface

    model, bystander = _model(), _model()
    batch = _batch(0)
    ids = batch["input_ids"][:1]
    ctx = RingAttentionContext(
        group=None,
        layout=IdentityLayout(),
        positions=torch.arange(13),
        doc_ids=None,
        seq_len=13,
        padded_len=13,
        route_hf_attention=True,
        model=model,
    )
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        before = dict(AttentionInterface._global_mapping)
        with count_ring_bytes() as stats, ctx():
            assert model.config._attn_implementation == RING_ATTENTION_NAME
            assert bystander.config._attn_implementation == "sdpa"
            assert {k: v for k, v in AttentionInterface._global_mapping.items() if k != RING_ATTENTION_NAME} == {
                k: v for k, v in before.items() if k != RING_ATTENTION_NAME
            }
            routed = model(input_ids=ids).logits
            bystander_logits = bystander(input_ids=ids).logits  # its own sdpa, not the ring
    assert stats.calls == 2  # the routed model's two layers, none of the bystander's
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(routed, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bystander_logits, plain, rtol=1e-5, atol=1e-5)


def test_upstream_routing_is_process_wide_and_scoped_to_the_context() -> None:
    """Upstream's model-less convention (`am_context_parallel.upstream`) swaps transformers' `sdpa` entry while open."""
    from transformers.modeling_utils import AttentionInterface

    from am_context_parallel.upstream import routed_hf_attention

    before = dict(AttentionInterface._global_mapping)
    model = _model()
    ids = _batch(0)["input_ids"][:1]
    ctx = RingAttentionContext(
        group=None, layout=IdentityLayout(), positions=torch.arange(13), doc_ids=None, seq_len=13, padded_len=13
    )
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with ctx(), routed_hf_attention():
            assert AttentionInterface._global_mapping["sdpa"] is not before["sdpa"]
            routed = model(input_ids=ids).logits
    assert AttentionInterface._global_mapping == before
    torch.testing.assert_close(routed, plain, rtol=1e-5, atol=1e-5)


def test_attention_sinks_are_refused() -> None:
    """`s_aux` (attention sinks) changes the softmax; the ring does not implement it, so it must not ignore it."""
    from am_context_parallel import hf_ring_attention_forward

    ctx = RingAttentionContext(
        group=None, layout=IdentityLayout(), positions=torch.arange(4), doc_ids=None, seq_len=4, padded_len=4
    )
    q = torch.randn(1, 2, 4, 8)
    with ctx(), pytest.raises(NotImplementedError, match="attention sinks"):
        hf_ring_attention_forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))


def test_registered_name_outside_a_context_is_a_clear_error() -> None:
    assert register_ring_attention() == RING_ATTENTION_NAME
    model = _model(RING_ATTENTION_NAME)
    with pytest.raises(RuntimeError, match="outside a context-parallel context"):
        model(input_ids=_batch(0)["input_ids"])
