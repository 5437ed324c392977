"""Tensor parallelism of `NemotronHForCausalLM` from its declared plan, on real gloo processes: TP=2 against TP=1.

One group of 2 processes for the whole module. Every case builds the same model (same seed, same weights) on each
rank and in the pytest process, applies `am_tensor_parallel.apply_tensor_parallel` with the plan the model declares
(`tp_plan.py`: attention by heads, MLP and shared expert by features, the Mamba2 mixer by heads and groups as
Megatron does, routed experts whole), runs the whole batch on both ranks and returns logits, loss and every gradient
re-assembled to its full shape (DTensors `full_tensor()`, the mixers' segment shards `gather_mamba2_grads`).
Oracle: the single-process model on the same batch: logits and loss within 1e-5 (fp32) of their largest entry,
gradients within 1e-5 too (fp32) and, in an fp64 run, within 1e-6 (the router still rounds in fp32).
Without a group: the declared plan, and the refusals (groups or KV heads that tp does not divide, a Mamba2 out_proj
bias under sequence parallelism) that am-capabilities reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from am_nemotron_dist import case_result, run_cases, run_group
from am_nemotron_helpers import VOCAB, randomize_, tiny_hf_config

from am_models_nemotron import NemotronHForCausalLM
from am_models_nemotron.tp_plan import gather_mamba2_grads, gather_mamba2_state_dict
from am_tensor_parallel import declared_plan, tp_problems

# fp32: the same products; the sharded reductions are re-summed over 2 ranks (gradients measured <= 5.4e-6)
TOL = 1e-5
# fp64 runs: the MoE router computes in fp32 by design (gate_precision), so they round there (measured 6e-8)
FP64_TOL = 1e-6
TP = 2


@dataclass(frozen=True)
class Case:
    name: str
    pattern: str
    padding: bool = False
    fp64: bool = False
    sequence_parallel: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("mamba_attention_mlp", "M*-M"),
    Case("moe_padding", "ME*E", padding=True),
    Case("mamba_one_group_per_rank_bias", "M-M", overrides={"n_groups": 2, "mamba_num_heads": 8, "use_bias": True}),
    Case("fp64_mamba_attention_moe", "M*ME", fp64=True),
    Case("mtp", "M*E", overrides={"mtp_depths": 1}),
    # sequence parallelism: norms on shards, Mamba2 / attention / MLP regions, the MoE and MTP fusion on whole
    # sequences (gathered in, sliced out), padding excluded from routing as without it
    Case("sp_mamba_attention_mlp_moe_mtp", "M*-E", padding=True, sequence_parallel=True, overrides={"mtp_depths": 1}),
]


def _build(case: Case) -> NemotronHForCausalLM:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_hf_config(case.pattern, **case.overrides))
    randomize_(model, seed=11)
    return (model.double() if case.fp64 else model).train()


def _batch(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(map(ord, case.name)))
    ids = torch.randint(3, VOCAB, (2, 10), generator=gen)
    mask = torch.ones_like(ids)
    if case.padding:
        mask[0, :3] = 0
        mask[1, -2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _step(model: NemotronHForCausalLM, case: Case) -> dict[str, Any]:
    ids, mask, labels = _batch(case)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    loss = out.loss if out.mtp_loss is None else out.loss + out.mtp_loss  # MTP layers (attention, MoE) too
    loss.backward()
    return {"logits": out.logits.detach(), "loss": loss.detach()}


def _tp_case(case: Case, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from am_tensor_parallel import apply_tensor_parallel

    model = _build(case)
    plan = apply_tensor_parallel(model, mesh, sequence_parallel=case.sequence_parallel)
    result = _step(model, case)
    grads = {}
    for name, param in model.named_parameters():  # same order on every rank: full_tensor() is collective
        if param.grad is not None and isinstance(param.grad, DTensor):
            grads[name] = param.grad.full_tensor()
        elif param.grad is not None:
            grads[name] = param.grad.clone()
    grads.update(gather_mamba2_grads(model))  # the mixers' shards, re-assembled (collective)
    result["grads"] = grads
    result["weights"] = {k: v for k, v in gather_mamba2_state_dict(model).items() if k.endswith("in_proj.weight")}
    mixer = model.model.layers["0"].mixer
    result["local_sizes"] = (mixer.num_heads, mixer.n_groups, tuple(mixer.in_proj.weight.shape))
    result["styles"] = dict(plan.styles)
    result["norms_on_shards"] = len(plan.norms)
    return result


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return run_cases({case.name: (lambda case=case: _tp_case(case, mesh)) for case in CASES})


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_group(TP, _worker, timeout=300.0)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float) -> None:
    scale = expected.abs().max().clamp(min=1e-12)
    err = (actual - expected).abs().max()
    assert err <= tol * scale, f"{what}: max abs err {err.item():.3e} > {tol} x scale {scale.item():.3e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tp2_matches_the_single_process_model(ranks: list[dict[str, Any]], case: Case) -> None:
    model = _build(case)
    mixer = model.model.layers["0"].mixer
    full_in_proj = model.model.layers["0"].mixer.in_proj.weight.detach().clone()
    ref = _step(model, case)
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    tol = FP64_TOL if case.fp64 else TOL
    for rank in range(TP):
        got = case_result(ranks, case.name, rank)
        local_rows = full_in_proj.shape[0] // TP
        assert got["local_sizes"] == (mixer.num_heads // TP, mixer.n_groups // TP, (local_rows, full_in_proj.shape[1]))
        assert torch.equal(got["weights"]["model.layers.0.mixer.in_proj.weight"], full_in_proj)  # exact round trip
        assert got["styles"]["model.layers.0.mixer"] == "module"
        if case.name == "mtp":  # the MTP sublayers' attention and shared expert are sharded too
            assert got["styles"]["mtp.layers.0.mixer.q_proj"] == "colwise"
        assert (got["norms_on_shards"] > 0) == case.sequence_parallel
        _close(got["logits"], ref["logits"], f"rank {rank} logits", tol)
        _close(got["loss"], ref["loss"], f"rank {rank} loss", tol)
        assert got["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            _close(got["grads"][name], grad, f"rank {rank} grad {name}", tol)


def test_declared_plan_covers_every_mixer_kind() -> None:
    model = NemotronHForCausalLM(tiny_hf_config("M*-E"))
    plan = declared_plan(model)
    assert plan == {
        "lm_head": "colwise_gather_output",
        "model.embed_tokens": "embedding_rowwise",
        "model.layers.0.mixer": "module",
        "model.layers.1.mixer.q_proj": "colwise",
        "model.layers.1.mixer.k_proj": "colwise",
        "model.layers.1.mixer.v_proj": "colwise",
        "model.layers.1.mixer.o_proj": "rowwise",
        "model.layers.2.mixer.up_proj": "colwise",
        "model.layers.2.mixer.down_proj": "rowwise",
        "model.layers.3.mixer": "sequence_gather",
        "model.layers.3.mixer.shared_experts.up_proj": "colwise",
        "model.layers.3.mixer.shared_experts.down_proj": "rowwise",
    }
    assert tp_problems(model, 2) == []


def test_groups_and_heads_that_tp_does_not_divide_are_refused() -> None:
    """n_groups=2 at tp=4: each Mamba layer says the groups cannot be split exactly; KV heads too; all at once."""
    model = NemotronHForCausalLM(tiny_hf_config("M*M", n_groups=2, mamba_num_heads=8, num_attention_heads=8))
    problems = tp_problems(model, 4)
    groups = [p for p in problems if "n_groups=2" in p]
    assert [p.split(":")[0] for p in groups] == ["model.layers.0.mixer", "model.layers.2.mixer"]
    assert "cannot be split exactly over tp=4" in groups[0]
    assert any("2 key/value heads cannot be split over tp=4" in p for p in problems)
    assert len(problems) == 3, problems


def test_sequence_parallelism_is_declared_and_an_out_proj_bias_is_refused() -> None:
    """Sequence parallelism: the routed MoE and the MTP fusion run on whole sequences ("sequence_gather"), the block
    norms on shards; a Mamba2 `out_proj` bias (which the reduce-scatter would not add once) is refused per mixer."""
    model = NemotronHForCausalLM(tiny_hf_config("M*E", mtp_depths=1))
    assert tp_problems(model, 2, sequence_parallel=True) == []
    plan = declared_plan(model)
    assert plan is not None
    assert plan["model.layers.2.mixer"] == "sequence_gather"
    assert plan["mtp.layers.*.eh_proj"] == "sequence_gather"
    biased = NemotronHForCausalLM(tiny_hf_config("M-M", use_bias=True))
    problems = tp_problems(biased, 2, sequence_parallel=True)
    assert [p.split(":")[0] for p in problems] == ["model.layers.0.mixer", "model.layers.2.mixer"], problems
    assert all("out_proj has a bias" in p for p in problems), problems
