"""Expert-parallel correctness that upstream stacks keep breaking (issue 25), on 4 real gloo ranks, one launch.

Every case trains a small MoE model (router with a selection bias, grouped experts, `RouterBalancer`) for two steps
of two micro-batches per rank under EP x FSDP2 (SUM reduction, as the reference trainer) and compares with ONE
process running the same micro-batches one after the other (gradient accumulation), step by step, fp32:
- an expert that receives no token globally (expert 7), or none on its owner's ep group (expert 3 is blocked on
  ranks 0 and 1), has a ZERO gradient, not None, and FSDP2 reduces it (the full gradient equals the single process);
- the router's parameters get the single process's gradient, with the aux losses on (Switch per micro-batch,
  sequence-level and z-loss, scaled by 1 / the step's global token count) under gradient accumulation, and the
  reported aux values are the single process's;
- the global gradient norm, computed per mesh as the reference trainer does, counts every expert parameter exactly
  once (equals the single-process norm);
- the bias update from the all-reduced load gives the single process's bias after every step;
- skewed routing (every token to expert 0) at ep 2 and ep 4: exact, no hang, and the dispatch receive buffer of
  expert 0's owner holds exactly its ep group's routed pairs (the README's bound, reached), the other ranks' none;
- ep x expert_dp > E (2 experts on ep 2 x expert_dp 2): the expert weights shard on dim 1 for FSDP2, exact;
- context parallelism (each cp rank holds columns of the same rows): the sequence-level term over whole sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _moe_dist import case_result, run_cases, run_group
from torch import nn

from am_moe import (
    GroupedExperts,
    LoadBalancing,
    RouterBalancer,
    aux_loss_values,
    configure_load_balancing,
    count_all_to_all_bytes,
    expert_fsdp_dim,
    expert_load,
    set_aux_loss_scale,
    update_expert_bias,
)

# fp32: the parallel run computes the same products; reductions (FSDP reduce-scatter, all-to-all sums) reorder.
TOL = 1e-5
H, INTER = 16, 8
B, S = 2, 5  # each micro-batch: B sequences of S tokens
MICRO, STEPS, WORLD = 2, 2, 4
LR = 0.1
ALL_TERMS = LoadBalancing(bias_update_rate=1e-3, aux_loss_coeff=0.1, seq_aux_loss_coeff=0.1, z_loss_coeff=0.01)


@dataclass(frozen=True)
class Spec:
    name: str
    ep: int
    num_experts: int = 8
    top_k: int = 2
    rule: str | None = None  # "zero": expert 7 nowhere, expert 3 not on ranks 0-1; "one": every token to expert 0
    balancing: LoadBalancing = field(default_factory=LoadBalancing)


SPECS = [
    Spec("ep2_zero_token_experts_balanced", ep=2, rule="zero", balancing=ALL_TERMS),
    Spec("ep4_zero_token_experts_balanced", ep=4, rule="zero", balancing=ALL_TERMS),
    Spec("ep2_all_to_one_expert", ep=2, top_k=1, rule="one"),
    Spec("ep4_all_to_one_expert", ep=4, top_k=1, rule="one"),
    Spec("ep2_more_ranks_than_experts_dim1", ep=2, num_experts=2, top_k=1, balancing=ALL_TERMS),
]


# Context parallelism: each cp rank holds some columns of the same rows; the sequence-level term must see whole rows.
CP_SPEC = Spec("cp2_sequence_aux", ep=1, balancing=LoadBalancing(seq_aux_loss_coeff=0.5, z_loss_coeff=0.01))
CP_COLUMNS = (slice(0, 3), slice(3, S))


def _cp_batches() -> tuple[dict[str, list[torch.Tensor]], int]:
    """Two data-parallel batches of whole sequences (one per dp rank) and their real-token count."""
    batches = [_batch(CP_SPEC, 0, d, 0) for d in range(2)]
    total = sum(int(b["mask"].sum()) for b in batches)
    return {k: [b[k] for b in batches] for k in batches[0]}, total


class EPModel(nn.Module):
    """in-projection -> softmax router (+ fp32 selection bias) -> experts (+ residual) -> out-projection."""

    score_bias: torch.Tensor

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.top_k = spec.top_k
        self.inp = nn.Linear(H, H)
        self.router = nn.Linear(H, spec.num_experts, bias=False)
        self.register_buffer("score_bias", torch.zeros(spec.num_experts))
        self.experts = GroupedExperts(spec.num_experts, H, INTER, gated=True, activation="silu")
        self.experts.init_weights(std=0.3)
        self.balancer = RouterBalancer(bias_name="score_bias")
        self.out = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """x [B, S, H], mask [B, S] (True = real), blocked [B, S, E] (True = this token may not pick the expert)."""
        h = self.inp(x).reshape(-1, H)
        logits = self.router(h).masked_fill(blocked.reshape(h.shape[0], -1), -1e4)
        probs = torch.softmax(logits, dim=-1)
        index = (probs + self.score_bias).topk(self.top_k, dim=-1).indices
        token_mask = mask.reshape(-1)
        y = self.experts(h, index, probs.gather(1, index), token_mask=token_mask)
        y = self.balancer(
            y,
            probs=probs,
            logits=logits,
            top_k_index=index,
            sequence_ids=torch.arange(x.shape[0]).repeat_interleave(x.shape[1]),
            num_sequences=x.shape[0],
            token_mask=token_mask,
        )
        return self.out(h + y).reshape(x.shape)


def _batch(spec: Spec, step: int, rank: int, micro: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro + sum(map(ord, spec.name)))
    blocked = torch.zeros(B, S, spec.num_experts, dtype=torch.bool)
    if spec.rule == "zero":
        blocked[..., 7] = True
        if rank in (0, 1):
            blocked[..., 3] = True
    elif spec.rule == "one":
        blocked[..., 1:] = True
    mask = torch.rand(B, S, generator=gen) > 0.2
    mask[0, 0] = True
    return {
        "x": torch.randn(B, S, H, generator=gen),
        "mask": mask,
        "blocked": blocked,
        "grad": torch.randn(B, S, H, generator=gen),
    }


def _step_batches(spec: Spec, step: int) -> tuple[list[list[dict[str, torch.Tensor]]], int]:
    batches = [[_batch(spec, step, r, m) for m in range(MICRO)] for r in range(WORLD)]
    total = sum(int(b["mask"].sum()) for rank in batches for b in rank)
    return batches, total


def _micro_backward(model: nn.Module, batch: dict[str, torch.Tensor], total: int) -> None:
    out = model(batch["x"], batch["mask"], batch["blocked"])
    (out * batch["grad"] * batch["mask"][..., None]).sum().div(total).backward()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _global_grad_norm(model: nn.Module) -> torch.Tensor:
    """The reference trainer's rule: one norm per mesh (DTensor ops do not mix meshes), combined."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.stack(norms).square().sum().sqrt()


def _train(model: nn.Module, spec: Spec, *, rank: int | None, group: Any = None) -> dict[str, Any]:
    """STEPS steps; rank None = the single process running every rank's micro-batches in rank order."""
    configure_load_balancing(model, spec.balancing)
    steps = []
    for step in range(STEPS):
        batches, total = _step_batches(spec, step)
        set_aux_loss_scale(model, 1.0 / total)
        mine = [b for r in range(WORLD) for b in batches[r]] if rank is None else batches[rank]
        for batch in mine:
            _micro_backward(model, batch, total)
        grads = {name: None if p.grad is None else _full(p.grad).clone() for name, p in model.named_parameters()}
        norm = _global_grad_norm(model)
        aux = aux_loss_values(model, group=group, normalizer=total, reset=True)
        load = expert_load(model, group=group, reset=True)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
        update_expert_bias(model, load)
        steps.append(
            {
                "grads": grads,
                "norm": norm,
                "aux": aux,
                "load": load.tokens_per_expert["experts"],
                "bias": model.score_bias.clone(),
            }
        )
    params = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    return {"steps": steps, "params": params}


def _worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from am_moe import apply_expert_parallel, build_expert_meshes, fully_shard_experts, plan_expert_parallel

    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp_cp = grid["dp", "cp"]._flatten("dp_cp")
    meshes = {
        2: build_expert_meshes(dp_cp, plan_expert_parallel(data_parallel_size=4, ep=2)),
        4: build_expert_meshes(
            dp_cp, plan_expert_parallel(data_parallel_size=4, ep=4), ep_dim="ep4", expert_dp_dim="expert_dp4"
        ),
    }

    def case(spec: Spec) -> Any:
        def run() -> dict[str, Any]:
            ep_mesh, expert_dp_mesh = meshes[spec.ep]
            model = EPModel(spec)
            apply_expert_parallel(model, ep_mesh)
            fully_shard_experts(model, mesh=expert_dp_mesh)
            fully_shard(model, mesh=dp_cp)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
            with count_all_to_all_bytes() as stats:
                result = _train(model, spec, rank=rank, group=dp_cp.get_group())
            result["receive"] = {
                "rows": stats.peak_receive_rows,
                "bytes": stats.peak_receive_bytes,
                "ep_group": torch.distributed.get_process_group_ranks(ep_mesh.get_group()),
                "ep_rank": ep_mesh.get_local_rank(),
            }
            weight = model.experts.gate_up_proj
            result["placements"] = [str(p) for p in weight.placements]
            result["fsdp_dim"] = expert_fsdp_dim(model.experts, expert_dp_mesh)
            return result

        return run

    cases = {spec.name: case(spec) for spec in SPECS}
    cp_group, dp_rank, cp_rank = grid["cp"].get_group(), grid["dp"].get_local_rank(), grid["cp"].get_local_rank()

    def cp_case() -> dict[str, Any]:
        model = EPModel(CP_SPEC)
        configure_load_balancing(model, CP_SPEC.balancing, sequence_group=cp_group)
        batch, total = _cp_batches()
        mine = {k: v[dp_rank][:, CP_COLUMNS[cp_rank]] for k, v in batch.items()}
        set_aux_loss_scale(model, 1.0 / total)
        _micro_backward(model, mine, total)
        grads = {}
        for name, p in model.named_parameters():
            torch.distributed.all_reduce(p.grad)  # the data-parallel gradient sum, done by hand here
            grads[name] = p.grad.clone()
        aux = aux_loss_values(model, group=dp_cp.get_group(), normalizer=total, reset=True)
        return {"grads": grads, "aux": aux}

    cases["cp2_sequence_aux"] = cp_case
    return run_cases(cases, timeout=120)


@pytest.fixture(scope="module")
def group_results() -> list[dict[str, Any]]:
    results, _ = run_group(WORLD, _worker, timeout=400)
    return results


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_ep_x_fsdp2_training_equals_single_process(group_results: Any, spec: Spec) -> None:
    reference = _train(EPModel(spec), spec, rank=None)
    for rank in range(WORLD):
        got = case_result(group_results, spec.name, rank)
        for step, (mine, ref) in enumerate(zip(got["steps"], reference["steps"], strict=True)):
            where = f"rank {rank} step {step}"
            # no parameter is left without a gradient, zero-token experts included
            assert [n for n, g in mine["grads"].items() if g is None] == [], where
            for name, grad in ref["grads"].items():
                torch.testing.assert_close(mine["grads"][name], grad, rtol=TOL, atol=TOL, msg=f"{where} {name}")
            torch.testing.assert_close(mine["norm"], ref["norm"], rtol=TOL, atol=TOL, msg=f"{where} norm")
            assert mine["aux"] == pytest.approx(ref["aux"], rel=1e-5, abs=1e-7), where
            assert torch.equal(mine["load"], ref["load"]), where
            assert torch.equal(mine["bias"], ref["bias"]), where  # bias values identical after every step
        for name, param in reference["params"].items():
            torch.testing.assert_close(got["params"][name], param, rtol=TOL, atol=TOL, msg=f"rank {rank} {name}")


def test_zero_token_experts_have_zero_gradients_and_aux_terms_are_on(group_results: Any) -> None:
    for name in ("ep2_zero_token_experts_balanced", "ep4_zero_token_experts_balanced"):
        got = case_result(group_results, name, 0)
        first = got["steps"][0]
        for weight in ("experts.gate_up_proj", "experts.down_proj"):
            grad = first["grads"][weight]
            assert torch.count_nonzero(grad[7]) == 0  # no token anywhere: exactly zero
            assert torch.count_nonzero(grad[3]) > 0  # tokens only from ranks 2-3: FSDP2 brought them to rank 0
        assert first["load"][7] == 0
        assert all(value > 0 for value in first["aux"].values())
        assert not torch.equal(got["steps"][1]["bias"], torch.zeros_like(got["steps"][1]["bias"]))


def test_all_to_one_expert_routes_every_pair_to_it(group_results: Any) -> None:
    for name in ("ep2_all_to_one_expert", "ep4_all_to_one_expert"):
        load = case_result(group_results, name, 3)["steps"][0]["load"]
        assert load[0] == load.sum()
        assert load.sum() > 0


@pytest.mark.parametrize("name", ["ep2_all_to_one_expert", "ep4_all_to_one_expert"])
def test_all_to_one_receive_buffer_equals_the_documented_bound(group_results: Any, name: str) -> None:
    """README bound: the dispatch receive buffer of an ep rank holds the (token, k) pairs its ep group routes to its
    experts, R <= ep x T x min(K, E / ep) rows of H values. All to expert 0 (K = 1): its owner receives every real
    token of its ep group in each micro-batch (the bound with padding excluded), the others nothing."""
    spec = next(s for s in SPECS if s.name == name)
    tokens = B * S
    for rank in range(WORLD):
        got = case_result(group_results, name, rank)["receive"]
        group = got["ep_group"]
        assert len(group) == spec.ep
        per_micro = [
            sum(int(_batch(spec, step, source, micro)["mask"].sum()) for source in group) * spec.top_k
            for step in range(STEPS)
            for micro in range(MICRO)
        ]
        expected = max(per_micro) if got["ep_rank"] == 0 else 0
        assert got["rows"] == expected, f"rank {rank}"
        assert got["bytes"] == expected * H * 4, f"rank {rank}"  # fp32 rows of H values
        assert got["rows"] <= spec.ep * tokens * min(spec.top_k, spec.num_experts // spec.ep)


def test_more_ranks_than_experts_shards_experts_on_dim_1(group_results: Any) -> None:
    got = case_result(group_results, "ep2_more_ranks_than_experts_dim1", 0)
    assert got["fsdp_dim"] == 1
    assert got["placements"] == ["S(1)", "S(0)"]  # FSDP2 over expert_dp on dim 1, ep on dim 0
    for spec_name in ("ep2_zero_token_experts_balanced", "ep4_zero_token_experts_balanced"):
        assert case_result(group_results, spec_name, 0)["fsdp_dim"] == 0


def test_sequence_aux_loss_under_context_parallelism_equals_whole_sequences(group_results: Any) -> None:
    """Each cp rank holds part of every sequence; with `sequence_group=cp` the sequence-level term (and so the
    router gradient and the reported value) equals one process holding whole sequences."""
    model = EPModel(CP_SPEC)
    configure_load_balancing(model, CP_SPEC.balancing)
    batch, total = _cp_batches()
    set_aux_loss_scale(model, 1.0 / total)
    for d in range(2):
        _micro_backward(model, {k: v[d] for k, v in batch.items()}, total)
    expected = aux_loss_values(model, normalizer=total, reset=True)
    assert expected["seq_aux_loss"] > 0
    for rank in range(WORLD):
        got = case_result(group_results, "cp2_sequence_aux", rank)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=TOL, atol=TOL, msg=f"rank {rank} {name}")
        assert got["aux"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
