"""Expert parallelism on real gloo processes: parity with the single-process layer, FSDP2 on top, DCP, HF export.

One group of 4 processes for the whole module (rank start-up is the expensive part):
- EP=2 cases run on the trainer-shaped mesh (pp=2, dp=2, cp=1): each pipeline row {0, 1} / {2, 3} is an EP pair
  with its own data (the ep mesh comes from `build_expert_meshes` on the flattened dp x cp mesh, as the trainer will
  build it);
- the EP=2 x FSDP2 cases run on (pp=1, dp=2, cp=2): experts sharded over ep (2) and FSDP2 over expert_dp (2),
  everything else FSDP2 over dp x cp (4), gradients SUMMED as the reference trainer does.
Oracle: the same layer / model in the pytest process on the union of every rank's tokens (fp32): outputs, input
gradients, routing-weight gradients and full expert-weight gradients within 1e-5; DCP checkpoints reload exactly
(also into a plain single-process model); exported expert weights are the full `[E, out, in]` tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _moe_dist import case_result, run_cases, run_group
from torch import nn
from torch.distributed.tensor import Shard

from am_moe import (
    DeepEPExchange,
    GroupedExperts,
    RoutingError,
    TokenDispatcher,
    apply_expert_parallel,
    build_expert_meshes,
    count_all_to_all_bytes,
    expert_load,
    fully_shard_experts,
    gather_expert_state_dict,
    plan_expert_parallel,
)

# fp32: EP computes the same products as the single process; only reductions are reordered (expert-weight
# gradients summed over ranks, FSDP reduce-scatter), a few ulps at these magnitudes.
TOL = 1e-5
# bf16 (8 mantissa bits): the expert-weight gradients are summed over ranks in bf16, a few bf16 ulps.
BF16_TOL = 3e-2
H, INTER, E = 16, 8, 8


@dataclass(frozen=True)
class EPSpec:
    name: str
    gated: bool = True
    activation: str = "gelu_tanh"
    backend: str = "grouped_mm"
    tokens: tuple[int, int] = (23, 17)  # per ep rank
    top_k: int = 2
    padding: bool = False
    skew: bool = False  # rank 1's tokens only pick experts 0..3 (ep rank 1 owns 4..7)
    checkpointed: bool = False
    dtype: torch.dtype = torch.float32
    dispatcher: str = "torch"  # "torch_token": DeepEP's token-level protocol, the libraries' shared logic


EP_SPECS = [
    EPSpec("gated_grouped_mm"),
    EPSpec("plain_relu2_loop", gated=False, activation="relu2", backend="loop", top_k=3),
    EPSpec("padding_and_skew", padding=True, skew=True),
    EPSpec("empty_rank", tokens=(19, 0), backend="loop"),
    EPSpec("top_k_all_experts", top_k=E, tokens=(5, 6)),
    EPSpec("activation_checkpointing", checkpointed=True, padding=True),
    EPSpec("bf16", dtype=torch.bfloat16, padding=True),
    EPSpec("token_gated_grouped_mm", dispatcher="torch_token"),
    EPSpec("token_padding_and_skew_loop", padding=True, skew=True, backend="loop", dispatcher="torch_token"),
    EPSpec("token_empty_rank_plain", gated=False, activation="relu2", tokens=(19, 0), dispatcher="torch_token"),
    EPSpec("token_top_k_all_experts", top_k=E, tokens=(5, 6), dispatcher="torch_token"),
    EPSpec("token_activation_checkpointing", checkpointed=True, padding=True, dispatcher="torch_token"),
    # am_moe.DeepEPExchange calling a stand-in `deep_ep` with DeepEP's signatures (tests/_fake_deep_ep.py), in bf16:
    # DeepEP moves bf16 tokens only
    EPSpec("deepep_exchange_bf16", padding=True, skew=True, dtype=torch.bfloat16, dispatcher="deepep_stand_in"),
]


def _experts(spec: EPSpec) -> GroupedExperts:
    torch.manual_seed(123)
    experts = GroupedExperts(E, H, INTER, gated=spec.gated, activation=spec.activation, grouped_mm=spec.backend)
    experts.init_weights(std=0.3)
    return experts.to(spec.dtype)


def _pair_inputs(spec: EPSpec, pair: int) -> dict[str, torch.Tensor]:
    """The whole pair's batch (both ep ranks' tokens, rank 0's first)."""
    gen = torch.Generator().manual_seed(1000 * pair + sum(map(ord, spec.name)))
    total = sum(spec.tokens)
    x = torch.randn(total, H, generator=gen)
    scores = torch.rand(total, E, generator=gen)
    if spec.skew:
        scores[spec.tokens[0] :, E // 2 :] = -1.0
    index = scores.topk(spec.top_k, dim=-1).indices
    weights = torch.rand(total, spec.top_k, generator=gen) + 0.1
    mask = torch.rand(total, generator=gen) > 0.25 if spec.padding else torch.ones(total, dtype=torch.bool)
    grad = torch.randn(total, H, generator=gen)
    # routing weights stay fp32 (routers compute in fp32); tokens and their gradient in the layer's dtype
    return {"x": x.to(spec.dtype), "index": index, "weights": weights, "mask": mask, "grad": grad.to(spec.dtype)}


def _forward_backward(experts: nn.Module, inputs: dict[str, torch.Tensor], spec: EPSpec) -> dict[str, torch.Tensor]:
    x = inputs["x"].clone().requires_grad_()
    weights = inputs["weights"].clone().requires_grad_()
    mask = inputs["mask"] if spec.padding else None
    if spec.checkpointed:
        out = torch.utils.checkpoint.checkpoint(
            lambda a, b: experts(a, inputs["index"], b, token_mask=mask), x, weights, use_reentrant=False
        )
    else:
        out = experts(x, inputs["index"], weights, token_mask=mask)
    out.backward(inputs["grad"])
    return {"out": out.detach(), "x_grad": x.grad, "weights_grad": weights.grad}


# ----------------------------------------------------------------------------------------------- FSDP2 model
class TinyMoE(nn.Module):
    """in-projection -> softmax top-2 router -> gated experts (+ residual) -> out-projection."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(H, H)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = GroupedExperts(E, H, INTER, gated=True, activation="silu")
        self.experts.init_weights(std=0.3)
        self.out = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        weights, index = torch.softmax(self.router(h), dim=-1).topk(2, dim=-1)
        return self.out(h + self.experts(h, index, weights, token_mask=mask))


FSDP_TOKENS = 13  # per rank
LR = 0.1


def _fsdp_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(77)
    total = 4 * FSDP_TOKENS
    return {
        "x": torch.randn(total, H, generator=gen),
        "mask": torch.rand(total, generator=gen) > 0.2,
        "grad": torch.randn(total, H, generator=gen),
    }


def _parallelize(model: TinyMoE, dp_cp: Any) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    ep_mesh, expert_dp_mesh = build_expert_meshes(dp_cp, plan_expert_parallel(data_parallel_size=dp_cp.size(), ep=2))
    apply_expert_parallel(model, ep_mesh)
    fully_shard_experts(model, mesh=expert_dp_mesh)
    fully_shard(model, mesh=dp_cp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# ----------------------------------------------------------------------------------------------- worker
def _worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    rows = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "cp"))
    pair_mesh = rows["dp", "cp"]._flatten("dp_cp")
    ep_mesh, _ = build_expert_meshes(pair_mesh, plan_expert_parallel(data_parallel_size=2, ep=2))
    pair, ep_rank = rank // 2, ep_mesh.get_local_rank()
    cases: dict[str, Any] = {}

    def ep_case(spec: EPSpec) -> Any:
        def run() -> dict[str, Any]:
            experts = _experts(spec)
            stand_in = spec.dispatcher == "deepep_stand_in"
            apply_expert_parallel(experts, ep_mesh, dispatcher="torch_token" if stand_in else spec.dispatcher)
            if stand_in:  # the real DeepEP needs CUDA: the exchange calls a stand-in module with its API
                exchange = DeepEPExchange(ep_mesh.get_group(), module="_fake_deep_ep", num_sms=24)
                experts.dispatcher = TokenDispatcher(ep_mesh.get_group(), exchange, name="deepep")
            inputs = _pair_inputs(spec, pair)
            start = sum(spec.tokens[:ep_rank])
            local = {k: v[start : start + spec.tokens[ep_rank]] for k, v in inputs.items()}
            result = _forward_backward(experts, local, spec)
            result["first_grad"] = _full(experts.first_proj.grad)
            result["down_grad"] = _full(experts.down_proj.grad)
            result["load"] = expert_load(experts, group=ep_mesh.get_group()).tokens_per_expert[""]
            result["local_experts"] = experts.first_proj.to_local().shape[0]
            if stand_in:
                import _fake_deep_ep

                result["deepep_num_sms"] = _fake_deep_ep.Buffer.num_sms
                result["deepep_buffers"] = _fake_deep_ep.Buffer.created
            return result

        return run

    for spec in EP_SPECS:
        cases[f"ep2/{spec.name}"] = ep_case(spec)

    def bytes_case() -> dict[str, int]:
        experts = _experts(EPSpec("bytes"))
        apply_expert_parallel(experts, ep_mesh)
        tokens, top_k = 64, 2
        index = (torch.arange(tokens * top_k) % E).view(tokens, top_k)  # uniform: every expert gets 16 pairs
        x = torch.randn(tokens, H, requires_grad=True)
        with count_all_to_all_bytes() as stats:
            experts(x, index, torch.ones(tokens, top_k)).sum().backward()
        return {k: getattr(stats, k) for k in ("dispatch_bytes", "combine_bytes", "backward_bytes", "metadata_bytes")}

    cases["ep2/bytes"] = bytes_case

    def bad_input_case() -> dict[str, str]:
        experts = _experts(EPSpec("bad"))
        apply_expert_parallel(experts, ep_mesh)
        errors = {}
        x, weights = torch.randn(4, H), torch.ones(4, 2)
        good = torch.tensor([[0, 5], [1, 6], [2, 7], [3, 4]])
        bad = torch.tensor([[0, 8], [1, 6], [2, 7], [-3, 4]]) if ep_rank == 0 else good
        for name, call in (
            ("out_of_range_on_rank0", lambda: experts(x, bad, weights)),
            ("shape_on_rank1", lambda: experts(x, good, weights[:3] if ep_rank == 1 else weights)),
        ):
            try:
                call()
                errors[name] = "no error"
            except RoutingError as exc:
                errors[name] = str(exc)
        errors["afterwards"] = str(experts(x, good, weights).shape)  # the group is still in step
        token_experts = _experts(EPSpec("bad_token"))
        apply_expert_parallel(token_experts, ep_mesh, dispatcher="torch_token")
        try:
            token_experts(x, bad, weights)
            errors["token_out_of_range_on_rank0"] = "no error"
        except RoutingError as exc:
            errors["token_out_of_range_on_rank0"] = str(exc)
        errors["token_afterwards"] = str(token_experts(x, good, weights).shape)
        for name, kwargs in (
            ("deepep_on_cpu", {"dispatcher": "deepep", "dispatcher_num_sms": 24}),
            ("torch_with_knobs", {"dispatcher": "torch", "dispatcher_num_sms": 24, "dispatcher_async_dispatch": True}),
        ):
            try:  # refused before any collective: every rank raises, none waits
                apply_expert_parallel(_experts(EPSpec(name)), ep_mesh, **kwargs)
                errors[name] = "no error"
            except ValueError as exc:
                errors[name] = str(exc)
        two = nn.ModuleList([_experts(EPSpec("shared")), _experts(EPSpec("shared"))])
        apply_expert_parallel(two, ep_mesh, dispatcher="torch_token")
        separate = nn.ModuleList([_experts(EPSpec("separate")), _experts(EPSpec("separate"))])
        apply_expert_parallel(separate, ep_mesh, dispatcher="torch_token", dispatcher_share_token_dispatcher=False)
        errors["shared_one_dispatcher"] = str(two[0].dispatcher is two[1].dispatcher)
        errors["separate_dispatchers"] = str(separate[0].dispatcher is not separate[1].dispatcher)
        try:
            apply_expert_parallel(GroupedExperts(5, H, INTER, gated=False, activation="relu2"), ep_mesh)
            errors["indivisible"] = "no error"
        except ValueError as exc:
            errors["indivisible"] = str(exc)
        try:  # a plan made for another data-parallel size is refused, not re-planned (before any collective)
            build_expert_meshes(pair_mesh, plan_expert_parallel(data_parallel_size=4, ep=2))
            errors["plan_mismatch"] = "no error"
        except ValueError as exc:
            errors["plan_mismatch"] = str(exc)
        return errors

    cases["ep2/bad_input"] = bad_input_case

    grid = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "cp"))
    dp_cp = grid["dp", "cp"]._flatten("dp_cp")
    checkpoint_dir = os.path.join(folder, "dcp")

    def fsdp_case() -> dict[str, Any]:
        model = TinyMoE(seed=5)
        _parallelize(model, dp_cp)
        batch = _fsdp_batch()
        rows = slice(rank * FSDP_TOKENS, (rank + 1) * FSDP_TOKENS)
        out = model(batch["x"][rows], batch["mask"][rows])
        out.backward(batch["grad"][rows])
        grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        load = expert_load(model, group=dp_cp.get_group(), reset=True).tokens_per_expert["experts"]
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        dcp.save(model.state_dict(), checkpoint_id=checkpoint_dir)
        exported = gather_expert_state_dict(model)
        reloaded = TinyMoE(seed=99)
        _parallelize(reloaded, dp_cp)
        state = reloaded.state_dict()
        dcp.load(state, checkpoint_id=checkpoint_dir)
        mismatched = [
            name
            for (name, p), q in zip(model.named_parameters(), reloaded.parameters(), strict=True)
            if not torch.equal(_full(p.detach()), _full(q.detach()))
        ]
        return {
            "out": out.detach(),
            "grads": grads,
            "load": load,
            "exported": exported,
            "reload_mismatches": mismatched,
            "placements": tuple(model.experts.gate_up_proj.placements),
            "mesh_dims": model.experts.gate_up_proj.device_mesh.mesh_dim_names,
        }

    cases["fsdp"] = fsdp_case
    return run_cases(cases)


@pytest.fixture(scope="module")
def group_results() -> tuple[list[dict[str, Any]], str]:
    return run_group(4, _worker, timeout=300)


# ----------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("spec", EP_SPECS, ids=[s.name for s in EP_SPECS])
def test_ep2_equals_single_process_layer(group_results: Any, spec: EPSpec) -> None:
    results, _ = group_results
    tol = TOL if spec.dtype == torch.float32 else BF16_TOL
    for pair in (0, 1):
        inputs = _pair_inputs(spec, pair)
        reference = _experts(spec)
        expected = _forward_backward(reference, inputs, spec)
        ranks = [case_result(results, f"ep2/{spec.name}", 2 * pair + r) for r in (0, 1)]
        for key in ("out", "x_grad", "weights_grad"):
            got = torch.cat([ranks[0][key], ranks[1][key]])
            torch.testing.assert_close(got, expected[key], rtol=tol, atol=tol, msg=f"pair {pair} {key}")
        for rank in ranks:
            assert rank["local_experts"] == E // 2
            torch.testing.assert_close(rank["first_grad"], reference.first_proj.grad, rtol=tol, atol=tol)
            torch.testing.assert_close(rank["down_grad"], reference.down_proj.grad, rtol=tol, atol=tol)
            # load summed over the ep group = the single-process layer's counts (padding excluded, counted once)
            assert torch.equal(rank["load"], reference.tokens_per_expert)
            if spec.dispatcher == "deepep_stand_in":  # Buffer.set_num_sms(24); one buffer reused fwd and bwd
                assert (rank["deepep_num_sms"], rank["deepep_buffers"]) == (24, 1)


def test_all_to_all_bytes_match_the_formula(group_results: Any) -> None:
    """Uniform routing: tokens x top-k x hidden x 4 bytes x (ep - 1) / ep leave each rank per all-to-all."""
    results, _ = group_results
    formula = 64 * 2 * H * 4 * (2 - 1) // 2
    for rank in range(4):
        got = case_result(results, "ep2/bytes", rank)
        assert got["dispatch_bytes"] == formula
        assert got["combine_bytes"] == formula
        assert got["backward_bytes"] == 2 * formula
        assert got["metadata_bytes"] == (E + 2) * 8  # one int64 header row to the one peer


def test_bad_input_raises_on_every_rank(group_results: Any) -> None:
    results, _ = group_results
    for rank in range(4):
        errors = case_result(results, "ep2/bad_input", rank)
        ep_rank = rank % 2
        assert "rank(s) [0] of 2 got invalid router outputs" in errors["out_of_range_on_rank0"]
        if ep_rank == 0:
            assert "2 routing indices are out of range [0, 8)" in errors["out_of_range_on_rank0"]
        assert "rank(s) [1] of 2" in errors["shape_on_rank1"]
        if ep_rank == 1:
            assert "same shape" in errors["shape_on_rank1"]
        assert errors["afterwards"] == "torch.Size([4, 16])"
        assert "5 experts cannot be split evenly over ep=2" in errors["indivisible"]
        assert "the data mesh has 2 ranks but the plan was made for data_parallel_size=4" in errors["plan_mismatch"]


def test_token_dispatchers_refuse_and_share_as_asked(group_results: Any) -> None:
    """The token-level dispatcher raises on every rank for one rank's bad input, like the pair dispatcher; deepep on
    this machine is refused naming the package and CUDA (one ValueError, before any collective); the library knobs
    are refused for the torch dispatcher; dispatcher_share_token_dispatcher gives one object to all layers or one
    per layer."""
    results, _ = group_results
    for rank in range(4):
        errors = case_result(results, "ep2/bad_input", rank)
        assert "rank(s) [0] of 2 got invalid router outputs" in errors["token_out_of_range_on_rank0"]
        assert errors["token_afterwards"] == "torch.Size([4, 16])"
        deepep = errors["deepep_on_cpu"]
        assert "`deep_ep` package, not installed" in deepep
        assert "needs tokens on a CUDA GPU" in deepep
        knobs = errors["torch_with_knobs"]
        assert "dispatcher_num_sms=24, dispatcher_async_dispatch=True tune the communication kernels" in knobs
        assert errors["shared_one_dispatcher"] == "True"
        assert errors["separate_dispatchers"] == "True"


def _reference_fsdp() -> tuple[TinyMoE, torch.Tensor, torch.Tensor]:
    model = TinyMoE(seed=5)
    batch = _fsdp_batch()
    out = model(batch["x"], batch["mask"])
    out.backward(batch["grad"])
    return model, out.detach(), model.experts.tokens_per_expert.clone()


def test_ep2_with_fsdp2_equals_single_process(group_results: Any) -> None:
    results, _ = group_results
    reference, out, load = _reference_fsdp()
    got = [case_result(results, "fsdp", rank) for rank in range(4)]
    torch.testing.assert_close(torch.cat([g["out"] for g in got]), out, rtol=TOL, atol=TOL)
    for rank_result in got:
        # a 2-D sharding of the expert dim: FSDP2 over expert_dp outside, ep innermost
        assert rank_result["mesh_dims"] == ("expert_dp", "ep")
        assert rank_result["placements"][-1] == Shard(0)
        for name, param in reference.named_parameters():
            torch.testing.assert_close(rank_result["grads"][name], param.grad, rtol=TOL, atol=TOL, msg=name)
        assert torch.equal(rank_result["load"], load)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the plain-model load below runs without a group
def test_dcp_round_trip_and_export(group_results: Any) -> None:
    import torch.distributed.checkpoint as dcp

    results, folder = group_results
    reference, _, _ = _reference_fsdp()
    with torch.no_grad():
        for p in reference.parameters():
            p -= LR * p.grad
    for rank in range(4):
        got = case_result(results, "fsdp", rank)
        assert got["reload_mismatches"] == []
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            expected = dict(reference.named_parameters())[name].detach()
            torch.testing.assert_close(got["exported"][name], expected, rtol=TOL, atol=TOL)
            assert got["exported"][name].shape == expected.shape
    # the sharded checkpoint loads into a plain single-process model: global shapes and offsets are right
    plain = TinyMoE(seed=31)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"), no_dist=True)
    plain.load_state_dict(state)
    for (name, p), q in zip(plain.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=TOL, atol=TOL, msg=name)


def test_plan_rules_without_a_process_group() -> None:
    plan = plan_expert_parallel(data_parallel_size=8, ep=4, num_experts=[128, 64])
    assert (plan.ep, plan.expert_dp) == (4, 2)
    with pytest.raises(ValueError, match="invalid expert-parallel layout") as info:
        plan_expert_parallel(data_parallel_size=6, ep=4, num_experts=[10, 128, 30])
    message = str(info.value)
    assert "ep=4 must divide dp x cp = 6" in message
    assert "10 experts cannot be split evenly over ep=4" in message
    assert "30 experts" in message
    assert "128 experts" not in message
    with pytest.raises(ValueError, match="ep must be a positive int"):
        plan_expert_parallel(data_parallel_size=2, ep=0)


def test_gather_expert_state_dict_without_sharding() -> None:
    experts = _experts(EPSpec("plain"))
    wrapper = nn.ModuleDict({"moe": experts})
    full = gather_expert_state_dict(wrapper)
    assert set(full) == {"moe.gate_up_proj", "moe.down_proj"}
    assert torch.equal(full["moe.down_proj"], experts.down_proj.detach())
