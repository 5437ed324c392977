"""Expert parallelism of the Gemma 4 MoE text model on real gloo processes: EP=2 against the single-process model.

One group of 2 processes for the whole module. Every case builds the same `Gemma4ForCausalLM` (same seed, same
weights) on each rank and in the pytest process, shards the experts with `apply_expert_parallel` over a 1-D ep mesh
of both ranks, and gives rank r rows [r * B / 2, (r + 1) * B / 2) of the batch. Oracle: the single-process model on
the whole batch (fp32): logits, the loss (each rank contributes its token-sum share), every gradient (dense: summed
over the ranks; experts: the sharded gradients gathered back to `[E, out, in]`) within 1e-5, and the expert load —
padding tokens are never routed, so the ranks' counts add up to the single-process counts and to real tokens x top-k.
The HF-export case gathers the experts (`am_moe.gather_expert_state_dict`), writes the folder from rank 0 with
`save_pretrained(..., state_dict=...)`, and transformers' Gemma4ForCausalLM loads it with the single-process logits.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _g4_configs import VOCAB, perturb_, text_config
from _g4_dist import case_result, run_cases, run_group

import am_moe
from am_models_gemma4 import Gemma4ForCausalLM

TOL = 1e-5  # fp32: the same products as the single process; only the gradient sums over ranks are reordered
WORLD = 2
PER_RANK = 2  # rows of the batch per rank


@dataclass(frozen=True)
class Case:
    name: str
    seq: int = 12
    padding: str = "none"  # "none", "mixed" (left and right padding), "rank1_mostly_padding"
    overrides: dict[str, Any] = field(default_factory=dict)
    # apply_expert_parallel(dispatcher=...): None = the backend's ("torch": (token, k) pairs over all-to-all);
    # "torch_token" = DeepEP's token-level protocol in plain torch, the logic deepep / hybridep / uccl_ep share
    dispatcher: str | None = None


CASES = [
    Case("moe_text"),
    Case("padding", padding="mixed"),
    Case("top_k_all_experts", overrides={"top_k_experts": 4}),
    Case("rank_with_one_token_per_row", padding="rank1_mostly_padding", overrides={"num_experts": 8}),
    Case("token_dispatch_with_padding", padding="mixed", dispatcher="torch_token"),
]
EXPORT_CASE = CASES[1]


def _config(case: Case) -> Any:
    return text_config(moe=True, **case.overrides)


def _build(case: Case) -> Gemma4ForCausalLM:
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(_config(case))
    perturb_(model, seed=3)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # experts large enough to matter next to the dense MLP (their init std is 0.02)
        for _, experts in am_moe.expert_modules(model):
            for param in (experts.gate_up_proj, experts.down_proj):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model.train()


def _batch(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of the whole batch `[WORLD * PER_RANK, seq]`; labels -100 on padding."""
    gen = torch.Generator().manual_seed(sum(map(ord, case.name)))
    rows = WORLD * PER_RANK
    ids = torch.randint(1, VOCAB - 5, (rows, case.seq), generator=gen)
    mask = torch.ones(rows, case.seq, dtype=torch.long)
    if case.padding == "mixed":
        mask[0, :3] = 0  # left padding
        mask[1, -4:] = 0  # right padding
        mask[3, -2:] = 0
    elif case.padding == "rank1_mostly_padding":
        mask[0, -3:] = 0
        mask[PER_RANK:, 1:] = 0  # rank 1 routes one token per row
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _target_count(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def _loads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.tokens_per_expert.clone() for name, m in am_moe.expert_modules(model)}


def _run(model: Gemma4ForCausalLM, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, total: int) -> Any:
    """Forward + backward of this part of the batch; the loss is its share of the whole batch's token mean (a token
    sum: a rank without targets contributes 0, and still runs the backward all-to-alls)."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    flat = logits[:, :-1].flatten(0, 1)
    share = F.cross_entropy(flat, labels[:, 1:].flatten(), ignore_index=-100, reduction="sum") / total
    share.backward()
    return logits.detach(), share.detach()


_SINGLE: dict[str, dict[str, Any]] = {}


def _single(case: Case) -> dict[str, Any]:
    """The oracle (computed once per case): the single-process model on the whole batch."""
    if case.name not in _SINGLE:
        model = _build(case)
        ids, mask, labels = _batch(case)
        logits, loss = _run(model, ids, mask, labels, _target_count(labels))
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        _SINGLE[case.name] = {
            "logits": logits,
            "loss": loss,
            "grads": grads,
            "load": _loads(model),
            "real": int(mask.sum()),
        }
    return _SINGLE[case.name]


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


def _refusal(world_size: int) -> str:
    """3 experts over ep=2 (and a mesh that is not 1-D): one error listing both, raised before any collective."""
    from torch.distributed.device_mesh import init_device_mesh

    model = Gemma4ForCausalLM(text_config(moe=True, num_experts=3))
    mesh_2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("a", "ep"))
    with pytest.raises(ValueError, match="apply_expert_parallel") as info:
        model.apply_expert_parallel(mesh_2d)
    return str(info.value)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    folder = [tempfile.mkdtemp(prefix="am_g4_ep_") if rank == 0 else ""]
    torch.distributed.broadcast_object_list(folder, src=0)
    cases = {case.name: (lambda case=case: _ep_case(case, rank, mesh)) for case in CASES}
    cases["export"] = lambda: _export_case(EXPORT_CASE, rank, mesh, folder[0])
    cases["indivisible_experts"] = lambda: _refusal(world_size)
    return run_cases(cases)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_group(WORLD, _worker, timeout=300.0)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().clamp(min=1e-12)
    err = (actual - expected).abs().max()
    assert err <= TOL * scale, f"{what}: max abs err {err.item():.3e} > {TOL} x scale {scale.item():.3e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ep2_matches_the_single_process_model(ranks: list[dict[str, Any]], case: Case) -> None:
    ref = _single(case)
    got = [case_result(ranks, case.name, rank) for rank in range(WORLD)]
    experts = _config(case).num_experts
    assert got[0]["local_experts"] == [experts // WORLD] * _config(case).num_hidden_layers
    _close(torch.cat([g["logits"] for g in got]), ref["logits"], "logits")
    _close(sum(g["loss"] for g in got), ref["loss"], "loss")
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
        _close(actual, expected, f"grad {name}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_padding_is_never_routed(ranks: list[dict[str, Any]], case: Case) -> None:
    ref = _single(case)
    got = [case_result(ranks, case.name, rank) for rank in range(WORLD)]
    top_k = _config(case).top_k_experts
    for name, expected in ref["load"].items():
        summed = got[0]["load"][name] + got[1]["load"][name]
        assert torch.equal(summed, expected), name
        assert int(summed.sum()) == ref["real"] * top_k, name
    if case.padding == "rank1_mostly_padding":
        assert all(int(load.sum()) == PER_RANK * top_k for load in got[1]["load"].values())


def test_ep_export_loads_in_transformers_with_equal_logits(ranks: list[dict[str, Any]]) -> None:
    from transformers import Gemma4ForCausalLM as HFGemma4ForCausalLM

    path = case_result(ranks, "export", 0)
    hf = HFGemma4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = _build(EXPORT_CASE).eval()
    ids, mask, _ = _batch(EXPORT_CASE)
    with torch.no_grad():
        expected = ours(input_ids=ids, attention_mask=mask).logits
        actual = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    _close(actual[real], expected[real], "HF logits of the EP export")
    reloaded = Gemma4ForCausalLM.from_pretrained(path)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_indivisible_experts_are_refused_before_any_collective(ranks: list[dict[str, Any]]) -> None:
    message = case_result(ranks, "indivisible_experts", 0)
    assert "3 experts cannot be split evenly over ep=2" in message
    assert "ep_mesh must be 1-D" in message
