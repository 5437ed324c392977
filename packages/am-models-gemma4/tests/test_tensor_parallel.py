"""Tensor parallelism of Gemma 4 (dense and MoE) from its declared plan, on real gloo processes: TP=2 against TP=1.

One group of 2 processes for the whole module. Every case builds the same `Gemma4ForCausalLM` (same seed, same
weights) on each rank and in the pytest process, applies `am_tensor_parallel.apply_tensor_parallel` with the plan the
model declares (`tp_plan.py`), runs the whole batch on both ranks (tp ranks see the same tokens) and returns the
logits, the loss and every gradient gathered to its full shape (`full_tensor()`).
Oracle: the single-process model on the same batch (fp32): logits, loss, every gradient within 1e-5 of the largest
entry. The MoE case checks that the experts stay whole on each tp rank (the plan leaves them to expert parallelism).
Sequence parallelism (dense configs) is compared the same way. Without a group: the declared plan, the refusals (KV
heads that tp does not divide; sequence parallelism with MoE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _g4_configs import VOCAB, perturb_, text_config
from _g4_dist import case_result, run_cases, run_group

import am_moe
from am_models_gemma4 import Gemma4ForCausalLM
from am_tensor_parallel import declared_plan, plan_tensor_parallel, tp_problems

# fp32: TP computes the same products; only the reductions over the sharded features (and the batched attention
# matmuls over fewer heads) run in another order. Logits and loss within 1e-5 of their largest entry; gradients
# within 5e-5 (the CP test's bound): measured up to 1.5e-5 (dense) and 4.2e-5 (MoE, whose experts are scaled up to
# matter, amplifying the reordering through four layers). The fp64 runs of the same cases agree to 2e-6 (the RMSNorms
# compute in fp32 by design, so fp64 runs still round there; measured 5e-7): twenty times tighter than fp32, so the
# fp32 differences are rounding, not a missing or doubled term (which would show at the same size in both).
TOL = 1e-5
GRAD_TOL = 5e-5
FP64_TOL = 2e-6
TP = 2


@dataclass(frozen=True)
class Case:
    name: str
    moe: bool = False
    padding: bool = False
    fp64: bool = False
    sequence_parallel: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)


# tp=2 needs every attention's KV heads divisible: the tiny config's full (K=V) layers get 2 global KV heads.
CASES = [
    Case("dense", overrides={"num_global_key_value_heads": 2}),
    Case(
        "dense_padding_kv_shared", padding=True, overrides={"num_global_key_value_heads": 2, "num_kv_shared_layers": 2}
    ),
    Case("moe", moe=True, overrides={"num_global_key_value_heads": 2}),
    Case("moe_padding", moe=True, padding=True, overrides={"num_global_key_value_heads": 2, "num_experts": 8}),
    Case("dense_sp", sequence_parallel=True, overrides={"num_global_key_value_heads": 2}),
    Case(
        "dense_sp_padding_kv_shared",
        sequence_parallel=True,
        padding=True,
        overrides={"num_global_key_value_heads": 2, "num_kv_shared_layers": 2},
    ),
    # the MoE block on whole sequences (gathered in, sliced back to the shard); padding excluded from routing
    Case(
        "moe_sp_padding",
        moe=True,
        padding=True,
        sequence_parallel=True,
        overrides={"num_global_key_value_heads": 2, "num_experts": 8},
    ),
    Case("dense_fp64", fp64=True, overrides={"num_global_key_value_heads": 2}),
    Case("moe_fp64", moe=True, fp64=True, overrides={"num_global_key_value_heads": 2}),
]


def _build(case: Case) -> Gemma4ForCausalLM:
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(text_config(moe=case.moe, **case.overrides))
    perturb_(model, seed=3)
    if case.fp64:
        model.double()
    if case.moe:
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():  # experts large enough to matter next to the dense MLP
            for _, experts in am_moe.expert_modules(model):
                for param in (experts.gate_up_proj, experts.down_proj):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model.train()


def _batch(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(map(ord, case.name)))
    ids = torch.randint(1, VOCAB - 5, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    if case.padding:
        mask[0, :3] = 0
        mask[1, -2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _step(model: Gemma4ForCausalLM, case: Case) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    ids, mask, labels = _batch(case)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {}
    for name, param in model.named_parameters():  # same order on every rank: full_tensor() is collective
        if param.grad is not None:
            grad = param.grad
            grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "grads": grads}


def _tp_case(case: Case, mesh: Any) -> dict[str, Any]:
    model = _build(case)
    from am_tensor_parallel import apply_tensor_parallel

    plan = apply_tensor_parallel(model, mesh, sequence_parallel=case.sequence_parallel)
    result = _step(model, case)
    attn = model.model.layers["0"].self_attn
    result["local_q_rows"] = attn.q_proj.weight.to_local().shape[0]
    result["local_heads"] = (attn.num_heads, attn.num_key_value_heads)
    result["styles"] = dict(plan.styles)
    result["norms_on_shards"] = len(plan.norms)
    if case.moe:
        experts = model.model.layers["0"].moe.experts
        result["experts_shape"] = tuple(experts.gate_up_proj.shape)
    return result


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return run_cases({case.name: (lambda case=case: _tp_case(case, mesh)) for case in CASES})


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_group(TP, _worker, timeout=300.0)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = TOL) -> None:
    scale = expected.abs().max().clamp(min=1e-12)
    err = (actual - expected).abs().max()
    assert err <= tol * scale, f"{what}: max abs err {err.item():.3e} > {tol} x scale {scale.item():.3e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tp2_matches_the_single_process_model(ranks: list[dict[str, Any]], case: Case) -> None:
    model = _build(case)
    attn = model.model.layers["0"].self_attn
    ref = _step(model, case)
    config = text_config(moe=case.moe, **case.overrides)
    for rank in range(TP):
        got = case_result(ranks, case.name, rank)
        assert got["local_q_rows"] == attn.num_heads * attn.head_dim // TP
        assert got["local_heads"] == (attn.num_heads // TP, attn.num_key_value_heads // TP)
        tol, grad_tol = (FP64_TOL, FP64_TOL) if case.fp64 else (TOL, GRAD_TOL)
        _close(got["logits"], ref["logits"], f"rank {rank} logits", tol)
        _close(got["loss"], ref["loss"], f"rank {rank} loss", tol)
        assert got["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            _close(got["grads"][name], grad, f"rank {rank} grad {name}", grad_tol)
        assert (got["norms_on_shards"] > 0) == case.sequence_parallel
        if case.moe:  # experts whole on every tp rank: expert parallelism, not tp, splits them
            assert got["experts_shape"] == (config.num_experts, 2 * config.moe_intermediate_size, config.hidden_size)
            assert not any("experts" in name for name in got["styles"])


def test_declared_plan_names_our_modules() -> None:
    model = Gemma4ForCausalLM(text_config(moe=True, num_global_key_value_heads=2))
    plan = declared_plan(model)
    assert plan is not None
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert not any("experts" in key or "router" in key for key in plan)
    frozen = plan_tensor_parallel(model, tp=2)
    assert frozen.tied == ("model.embed_tokens", "lm_head")


def test_kv_heads_that_tp_does_not_divide_are_refused_per_layer() -> None:
    """The tiny config's full layers have 1 global KV head (K=V): tp=2 names exactly those layers."""
    model = Gemma4ForCausalLM(text_config())
    problems = tp_problems(model, 2)
    assert len(problems) == 2, problems
    assert all("1 key/value heads cannot be split over tp=2" in p for p in problems)
    assert {p.split(":")[0] for p in problems} == {"model.layers.1.self_attn", "model.layers.3.self_attn"}
    assert tp_problems(model, 3)  # 4 query heads, vocabulary 100, intermediate 64: none divides by 3


def test_sequence_parallelism_runs_the_moe_block_on_whole_sequences() -> None:
    """Under sequence parallelism the MoE block (router + experts, whole on every tp rank) is `sequence_gather`:
    declared by `Gemma4MoE`, so only MoE layers carry it; its norms beside it run on the shards."""
    model = Gemma4ForCausalLM(text_config(moe=True, num_global_key_value_heads=2))
    assert tp_problems(model, 2) == []
    assert tp_problems(model, 2, sequence_parallel=True) == []
    frozen = plan_tensor_parallel(model, tp=2, sequence_parallel=True)
    assert frozen.styles["model.layers.0.moe"] == "sequence_gather"
    assert "model.layers.0.post_feedforward_layernorm_2" in frozen.norms
    assert not any(n.startswith("model.layers.0.moe.") for n in frozen.norms)
    dense = Gemma4ForCausalLM(text_config(num_global_key_value_heads=2))
    assert tp_problems(dense, 2, sequence_parallel=True) == []
