"""Expert parallelism of `NemotronHForCausalLM` on real gloo processes: EP=2 against the single-process model.

One group of 2 processes for the whole module. Every case builds the same model (same seed, same weights) on each
rank and in the pytest process, shards the routed experts with `apply_expert_parallel` over a 1-D ep mesh of both
ranks, and gives rank r rows [r * B / 2, (r + 1) * B / 2) of the batch. Oracle: the single-process model on the whole
batch (fp32): logits, the loss (each rank contributes its token-sum share), every gradient (dense: summed over the
ranks; experts: the sharded gradients gathered back to `[E, out, in]`) within 1e-5, and the expert load — padding
tokens are never routed, so the ranks' counts add up to the single-process counts and to real tokens x top-k.
The HF-export case gathers the experts (`am_moe.gather_expert_state_dict`), writes the folder from rank 0 with
`save_pretrained(..., state_dict=...)`, and transformers' NemotronH loads it with the single-process logits.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from am_nemotron_dist import case_result, run_cases, run_group
from am_nemotron_helpers import VOCAB, assert_close_rel, randomize_, tiny_hf_config

import am_moe
from am_models_nemotron import NemotronHForCausalLM, default_backend

TOL = 1e-5  # fp32: the same products as the single process; only the gradient sums over ranks are reordered
WORLD = 2
PER_RANK = 2  # rows of the batch per rank


@dataclass(frozen=True)
class Case:
    name: str
    pattern: str
    experts: str = "torch"  # BackendConfig.experts: "torch" (loop) or "torch_mm" (torch._grouped_mm)
    seq: int = 10
    padding: str = "none"  # "none", "mixed" (left and right padding), "rank1_only_padding"
    overrides: dict[str, Any] = field(default_factory=dict)
    # apply_expert_parallel(dispatcher=...): None = the backend's ("torch": (token, k) pairs over all-to-all);
    # "torch_token" = DeepEP's token-level protocol in plain torch, the logic deepep / hybridep / uccl_ep share
    dispatcher: str | None = None


CASES = [
    Case("moe_mamba_attention_loop", "M*E-E"),
    Case("grouped_mm_with_padding", "ME*E", experts="torch_mm", padding="mixed"),
    Case("latent_moe", "*E", overrides={"moe_latent_size": 16}),
    Case("rank_with_only_padding", "ME-E", padding="rank1_only_padding"),
    Case("token_dispatch_with_padding", "ME*E", experts="torch_mm", padding="mixed", dispatcher="torch_token"),
]
EXPORT_CASE = CASES[1]


def _build(case: Case) -> NemotronHForCausalLM:
    torch.manual_seed(0)
    backend = default_backend().replace(experts=case.experts)
    model = NemotronHForCausalLM(tiny_hf_config(case.pattern, **case.overrides), backend=backend)
    return randomize_(model, seed=11).train()


def _batch(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of the whole batch `[WORLD * PER_RANK, seq]`; labels -100 on padding."""
    gen = torch.Generator().manual_seed(sum(map(ord, case.name)))
    rows = WORLD * PER_RANK
    ids = torch.randint(3, VOCAB, (rows, case.seq), generator=gen)
    mask = torch.ones(rows, case.seq, dtype=torch.long)
    if case.padding == "mixed":
        mask[0, :3] = 0  # left padding
        mask[1, -4:] = 0  # right padding
        mask[3, -2:] = 0
    elif case.padding == "rank1_only_padding":
        mask[0, -3:] = 0
        mask[PER_RANK:] = 0  # rank 1 routes no token at all (it still joins every all-to-all)
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _target_count(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def _loads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.tokens_per_expert.clone() for name, m in am_moe.expert_modules(model)}


def _run(model: NemotronHForCausalLM, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, total: int) -> Any:
    """Forward + backward of this part of the batch; the loss is its share of the whole batch's token mean (a token
    sum: a rank without targets contributes 0, and still runs the backward all-to-alls)."""
    out = model(input_ids=ids, attention_mask=mask)
    logits = out.logits[:, :-1].flatten(0, 1)
    share = F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100, reduction="sum") / total
    share.backward()
    return out.logits.detach(), share.detach()


_SINGLE: dict[str, dict[str, Any]] = {}


def _single(case: Case) -> dict[str, Any]:
    """The oracle (computed once per case): the single-process model on the whole batch."""
    if case.name not in _SINGLE:
        _SINGLE[case.name] = _single_uncached(case)
    return _SINGLE[case.name]


def _single_uncached(case: Case) -> dict[str, Any]:
    model = _build(case)
    ids, mask, labels = _batch(case)
    logits, loss = _run(model, ids, mask, labels, _target_count(labels))
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits, "loss": loss, "grads": grads, "load": _loads(model), "real": int(mask.sum())}


def _ep_case(case: Case, rank: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    model = _build(case)
    sharded = model.apply_expert_parallel(mesh, dispatcher=case.dispatcher)
    if case.dispatcher is not None:  # the layers share one token dispatcher (dispatcher_share_token_dispatcher)
        assert {type(e.dispatcher).__name__ for e in sharded} == {"TokenDispatcher"}
        assert len({id(e.dispatcher) for e in sharded}) == 1
    ids, mask, labels = _batch(case)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    logits, loss = _run(model, ids[rows], mask[rows], labels[rows], _target_count(labels))
    grads = {}
    for name, param in model.named_parameters():  # same order on every rank: full_tensor() is collective
        if param.grad is None:
            continue
        grad = param.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()
    return {
        "logits": logits,
        "loss": loss,
        "grads": grads,
        "load": _loads(model),
        "expert_names": sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor)),
        "local_experts": [experts.num_local_experts for experts in sharded],
    }


def _export_case(case: Case, rank: int, mesh: Any, folder: str) -> str:
    model = _build(case)
    model.apply_expert_parallel(mesh)
    with pytest.raises(ValueError, match="sharded DTensors"):
        model.save_pretrained(os.path.join(folder, "refused"))
    full = {**model.state_dict(), **am_moe.gather_expert_state_dict(model)}  # collective: every rank
    path = os.path.join(folder, "export")
    if rank == 0:
        model.save_pretrained(path, state_dict=full)
    torch.distributed.barrier()
    return path


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    folder = [tempfile.mkdtemp(prefix="am_nemotron_ep_") if rank == 0 else ""]
    torch.distributed.broadcast_object_list(folder, src=0)
    cases = {case.name: (lambda case=case: _ep_case(case, rank, mesh)) for case in CASES}
    cases["export"] = lambda: _export_case(EXPORT_CASE, rank, mesh, folder[0])
    cases["indivisible_experts"] = lambda: _refusal(rank, world_size)
    return run_cases(cases)


def _refusal(rank: int, world_size: int) -> str:
    """5 experts over ep=2 (and a mesh that is not 1-D): one error listing both, raised before any collective."""
    from torch.distributed.device_mesh import init_device_mesh

    model = NemotronHForCausalLM(tiny_hf_config("ME", n_routed_experts=5, n_group=1, topk_group=1))
    mesh_2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("a", "ep"))
    with pytest.raises(ValueError, match="apply_expert_parallel") as info:
        model.apply_expert_parallel(mesh_2d)
    return str(info.value)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_group(WORLD, _worker, timeout=300.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ep2_matches_the_single_process_model(ranks: list[dict[str, Any]], case: Case) -> None:
    ref = _single(case)
    got = [case_result(ranks, case.name, rank) for rank in range(WORLD)]
    assert got[0]["local_experts"]
    assert all(n == 3 for n in got[0]["local_experts"])  # 6 experts over 2 ranks
    logits = torch.cat([g["logits"] for g in got])
    assert_close_rel(logits, ref["logits"], rtol=TOL, what="logits")
    assert_close_rel(sum(g["loss"] for g in got), ref["loss"], rtol=TOL, what="loss")
    expert_names = set(got[0]["expert_names"])
    assert expert_names
    assert all(".experts." in name for name in expert_names)
    assert set(got[0]["grads"]) == set(ref["grads"])
    for name, expected in ref["grads"].items():
        if name in expert_names:  # gathered: already the whole batch's gradient on every rank
            actual = got[0]["grads"][name]
            assert torch.equal(actual, got[1]["grads"][name])
        else:  # replicated parameter: each rank holds the gradient of its own rows
            actual = got[0]["grads"][name] + got[1]["grads"][name]
        assert_close_rel(actual, expected, rtol=TOL, what=f"grad {name}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_padding_is_never_routed(ranks: list[dict[str, Any]], case: Case) -> None:
    ref = _single(case)
    got = [case_result(ranks, case.name, rank) for rank in range(WORLD)]
    top_k = tiny_hf_config(case.pattern).num_experts_per_tok
    for name, expected in ref["load"].items():
        summed = got[0]["load"][name] + got[1]["load"][name]
        assert torch.equal(summed, expected), name
        assert int(summed.sum()) == ref["real"] * top_k, name
    if case.padding == "rank1_only_padding":
        assert all(int(load.sum()) == 0 for load in got[1]["load"].values())


def test_ep_export_loads_in_transformers_with_equal_logits(ranks: list[dict[str, Any]]) -> None:
    from transformers import NemotronHForCausalLM as HFNemotronH

    path = case_result(ranks, "export", 0)
    hf = HFNemotronH.from_pretrained(path, dtype=torch.float32).eval()
    ours = _build(EXPORT_CASE).eval()
    ids, mask, _ = _batch(EXPORT_CASE)
    with torch.no_grad():
        expected = ours(input_ids=ids, attention_mask=mask).logits
        actual = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert_close_rel(actual[real], expected[real], rtol=TOL, what="HF logits of the EP export")
    ours_reloaded = NemotronHForCausalLM.from_pretrained(path, backend=default_backend().replace(experts="torch_mm"))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(ours_reloaded.state_dict()[name], tensor), name


def test_indivisible_experts_are_refused_before_any_collective(ranks: list[dict[str, Any]]) -> None:
    message = case_result(ranks, "indivisible_experts", 0)
    assert "5 experts cannot be split evenly over ep=2" in message
    assert "ep_mesh must be 1-D" in message


def test_am_capabilities_allows_ep_only_for_moe_configs() -> None:
    """What am-capabilities concludes (it is not a dependency: skipped when absent): the MoE model implements EP
    (`apply_expert_parallel`), a dense config declares it off, and 6 experts do not split over ep_size=4."""
    am_capabilities = pytest.importorskip("am_capabilities")
    moe_model, dense_model = NemotronHForCausalLM(tiny_hf_config("ME")), NemotronHForCausalLM(tiny_hf_config("M*-"))
    assert am_capabilities.ModelSupports(moe_model).supports_ep
    assert not am_capabilities.ModelSupports(dense_model).supports_ep
    mesh = type("Mesh", (), {"ep_size": 2})()
    am_capabilities.validate_for_mesh(moe_model, mesh)
    with pytest.raises(ValueError, match="ep_size=2: NemotronHForCausalLM cannot use expert parallelism: its capa"):
        am_capabilities.validate_for_mesh(dense_model, mesh)
    with pytest.raises(ValueError, match=r"n_routed_experts=6 not divisible by 4"):
        am_capabilities.validate_for_mesh(moe_model, type("Mesh", (), {"ep_size": 4})())
