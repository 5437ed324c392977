"""The whole model under context parallelism equals the single-process model: logits, MTP hidden states, the
combined loss (next-token + MTP) and every parameter gradient, fp32 within 1e-5 relative.

One 4-rank gloo group for the module: CP = 4 (the whole group) and CP = 2 (two independent pairs), through the
public path a trainer takes — `model.prepare_batch_for_cp(batch)` on the whole batch, am-context-parallel's
`make_cp_batch_and_ctx(mesh, batch, model=model)` (the contiguous layout the model declares), forward and backward
inside the returned ring context, gradients summed over the CP group. The model has every block kind (Mamba2,
attention, MLP, MoE) and two MTP depths. Layouts: plain rows; packed documents (a boundary inside a block, one
exactly at a rank edge, a document spanning ranks) with padding given as `padding_mask`; right padding given as
an `attention_mask`; documents given by restarting `position_ids`; the packed layout under activation
checkpointing. Sequences of 30 tokens are padded by the sharder to 32. The reference is the same model on the
whole batch in the same process. Refusals must reach every rank before any transfer (a problem on one rank only
included) — a hang would fail the module by the group's timeout.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from am_nemotron_dist import case_result, run_cases, run_group
from am_nemotron_helpers import randomize_, tiny_hf_config, tokens
from torch.distributed.device_mesh import init_device_mesh

from am_context_parallel import (
    FlashCPUAttentionKernel,
    TorchAttentionKernel,
    make_cp_batch_and_ctx,
    model_cp_problems,
)
from am_models_nemotron import NemotronHForCausalLM

WORLD = 4
# fp32: CP changes only the summation order (ring merges, states passed across ranks, gradients summed over ranks).
RTOL = 1e-5
BATCH, SEQ = 2, 30
PATTERN = "ME*M-E"
LAYOUTS = ("plain", "packed", "padded", "position_ids")
GLOBAL_COUNT = 100.0  # token-sum losses divided by one global count: the CP ranks' losses add up to the global one


def _model(*, checkpointed: bool = False) -> NemotronHForCausalLM:
    torch.manual_seed(0)
    model = randomize_(NemotronHForCausalLM(tiny_hf_config(PATTERN, mtp_depths=2)), seed=3).train()
    if checkpointed:
        model.gradient_checkpointing_enable()
    return model


def _token_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum") / GLOBAL_COUNT


def _batch(layout: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the raw batch a collator would give, [B, S] True = padding)."""
    ids = tokens(BATCH, SEQ, seed=11)
    batch: dict[str, torch.Tensor] = {"input_ids": ids, "labels": ids.clone()}
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    if layout == "packed":
        # Row 0: documents start at 5 (inside a block), 16 (a rank edge at CP = 2 and 4) and 21; row 1: one
        # document over 22 tokens (it spans ranks), then padding.
        starts = torch.zeros(BATCH, SEQ, dtype=torch.long)
        starts[0, [5, 16, 21]] = 1
        batch["seq_idx"] = starts.cumsum(dim=1) + 3
        padding[1, 22:] = True
        batch["padding_mask"] = padding
    elif layout == "padded":
        padding[1, 24:] = True
        batch["attention_mask"] = (~padding).long()
    elif layout == "position_ids":  # transformers' packed format: positions restart at each document
        batch["position_ids"] = torch.cat([torch.arange(9), torch.arange(7), torch.arange(14)]).expand(BATCH, SEQ)
    return batch, padding


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.detach().double().abs().max().clamp(min=1e-30)
    return float((actual.detach().double() - expected.detach().double()).abs().max() / scale)


def _model_case(mesh: Any, *, layout: str, checkpointed: bool = False) -> dict[str, float]:
    """Relative errors of the CP run against the single-process run (every rank checks its own view)."""
    group = mesh["cp"].get_group()
    model = _model(checkpointed=checkpointed)
    batch, padding = _batch(layout)

    # Single-process reference: the raw batch, unshifted labels (padding never a target), the combined loss.
    raw = {k: v for k, v in batch.items() if k != "labels"}
    reference = model(**raw)
    labels = batch["labels"].masked_fill(padding, -100)
    documents = batch.get("seq_idx")
    if layout == "position_ids":
        documents = (batch["position_ids"] == 0).cumsum(dim=1)
    loss_ref = model.combined_loss(reference, labels, loss_fn=_token_sum, seq_idx=documents)
    loss_ref.backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    # Context parallel: prepare on the whole batch, shard contiguously, run inside the ring context.
    ctx, shard = make_cp_batch_and_ctx(mesh, model.prepare_batch_for_cp(batch), model=model)
    shard_labels = shard.pop("labels")
    with ctx():
        out = model(**shard)
        loss = model.combined_loss(out, shard_labels, loss_fn=_token_sum, labels_shifted=True)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    real = ~padding
    errors = {
        "loss": _rel(total, loss_ref),
        "logits": _rel(ctx.unshard(out.logits.detach(), seq_dim=1)[real], reference.logits[real]),
    }
    for depth, (h, h_ref) in enumerate(zip(out.mtp_per_depth_h, reference.mtp_per_depth_h, strict=True)):
        errors[f"mtp depth {depth}"] = _rel(ctx.unshard(h.detach(), seq_dim=1)[real], h_ref[real])
    for name, param in model.named_parameters():
        grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=group)
        errors[f"grad {name}"] = _rel(grad, grads_ref[name]) if name in grads_ref else float(grad.abs().max())
    return errors


def _refusal(mesh: Any, case: str) -> str:
    """The message every rank gets for a bad CP input ("did not raise" when it ran)."""
    model = _model()
    batch, _ = _batch("packed")
    if case == "load_balanced":  # upstream's model-less call (the core needs model=, which picks the contiguous path)
        from am_context_parallel.upstream import make_cp_batch_and_ctx as model_less_make_cp_batch_and_ctx

        ctx, shard = model_less_make_cp_batch_and_ctx(mesh, {k: v for k, v in batch.items() if k != "seq_idx"})
    elif case == "short":  # 4 tokens at CP = 4: two per rank, fewer than the conv halo
        short = {"input_ids": batch["input_ids"][:, :4], "labels": batch["labels"][:, :4]}
        ctx, shard = make_cp_batch_and_ctx(mesh, model.prepare_batch_for_cp(short), model=model)
    elif case == "not_prepared":
        ctx, shard = make_cp_batch_and_ctx(mesh, {k: v for k, v in batch.items() if k != "seq_idx"}, model=model)
    else:
        ctx, shard = make_cp_batch_and_ctx(mesh, model.prepare_batch_for_cp(batch), model=model)
    labels = shard.pop("labels")
    kwargs: dict[str, Any] = {}
    if case == "labels":
        kwargs["labels"] = labels
    if case == "short":
        kwargs["use_cache"] = True
    if case == "one_rank" and mesh["cp"].get_local_rank() == 1:
        ids = shard["_packed_seq_ids"].clone()
        ids[:, 2:] += 100  # a document start the context does not have, on CP rank 1 only
        shard["_packed_seq_ids"] = ids
    with ctx():
        try:
            model(**shard, **kwargs)
        except ValueError as error:
            return str(error)
    return "did not raise"


REFUSALS = ("labels", "not_prepared", "load_balanced", "one_rank")
# (size, refusal): "short" needs CP = 4 (at CP = 2 every sequence the sharder pads holds the conv halo per rank).
REFUSAL_CASES = [(size, refusal) for size in (2, 4) for refusal in REFUSALS] + [(4, "short")]


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    meshes = {
        4: init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)),
        2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")),
    }
    cases: dict[str, Any] = {}
    for size, mesh in meshes.items():
        for layout in LAYOUTS:
            cases[f"cp={size} {layout}"] = functools.partial(_model_case, mesh, layout=layout)
        cases[f"cp={size} checkpointed"] = functools.partial(_model_case, mesh, layout="packed", checkpointed=True)
    for size, refusal in REFUSAL_CASES:
        cases[f"cp={size} refuse {refusal}"] = functools.partial(_refusal, meshes[size], refusal)
    return run_cases(cases)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(WORLD, _worker, timeout=420.0)


def _check(results: list[dict[str, Any]], key: str) -> None:
    for rank in range(WORLD):
        errors = case_result(results, key, rank)
        bad = {name: err for name, err in errors.items() if not err <= RTOL}
        assert not bad, f"{key}, rank {rank}: relative errors above {RTOL}: {bad}"


@pytest.mark.parametrize("layout", [*LAYOUTS, "checkpointed"])
@pytest.mark.parametrize("size", [2, 4])
def test_logits_loss_and_every_gradient_equal_the_single_process_model(
    results: list[dict[str, Any]], size: int, layout: str
) -> None:
    _check(results, f"cp={size} {layout}")


EXPECTED = {
    "labels": ["labels would be shifted here"],
    "short": ["shorter than the Mamba conv halo", "generation cache"],  # every problem at once
    "not_prepared": ["MTP needs mtp_per_depth_input_ids"],
    "load_balanced": ["needs the contiguous layout"],
}


@pytest.mark.parametrize(("size", "refusal"), REFUSAL_CASES)
def test_bad_input_is_refused_on_every_rank_before_any_transfer(
    results: list[dict[str, Any]], size: int, refusal: str
) -> None:
    messages = [case_result(results, f"cp={size} refuse {refusal}", rank) for rank in range(WORLD)]
    for rank, message in enumerate(messages):
        assert "context parallelism" in message, f"rank {rank}: {message}"
        if refusal == "one_rank":
            local = rank % size
            expected = "describe different document boundaries" if local == 1 else "CP rank(s) [1] got invalid inputs"
            assert expected in message, f"rank {rank}: {message}"
        else:
            for part in EXPECTED[refusal]:
                assert part in message, f"rank {rank}: {message}"


def test_the_ring_kernel_is_the_cpu_flash_op_on_the_cpu_and_the_plain_kernel_elsewhere() -> None:
    """The parity cases above run through the kernel the model declares; this pins which one that is."""
    options = NemotronHForCausalLM(tiny_hf_config(PATTERN, mtp_depths=2)).get_cp_options()
    on_cpu = options.kernel_for(torch.device("cpu"))
    if FlashCPUAttentionKernel.available():
        assert isinstance(on_cpu, FlashCPUAttentionKernel)
    else:
        assert isinstance(on_cpu, TorchAttentionKernel)
    assert isinstance(options.kernel_for(torch.device("meta")), TorchAttentionKernel)


def test_cp_problems_name_what_the_forward_refuses_before_any_collective() -> None:
    """The hook a trainer asks up front (am-context-parallel's `model_cp_problems`, no process group) applies the
    forward's rule (`block_cp_problems`): a shard shorter than the conv halo, attention dropout while training —
    in the decoder or in an MTP depth — every problem at once."""
    halo = "S_local=2 tokens per rank is shorter than the Mamba conv halo (3); use a longer sequence or fewer CP ranks"
    dropout = "attention dropout is not supported by ring attention; set attention_dropout=0"
    model = NemotronHForCausalLM(tiny_hf_config(PATTERN, mtp_depths=1)).train()
    assert model_cp_problems(model, seq_len=16, cp_size=2) == []
    assert model_cp_problems(model, seq_len=4, cp_size=2) == [halo]  # 4 tokens over 2 ranks, conv kernel 4
    assert model_cp_problems(model, seq_len=3, cp_size=2) == [halo]  # padded to 4 by the sharder: still 2 per rank
    with_dropout = NemotronHForCausalLM(tiny_hf_config(PATTERN, attention_dropout=0.1)).train()
    assert model_cp_problems(with_dropout, seq_len=4, cp_size=2) == [halo, dropout]
    assert model_cp_problems(with_dropout.eval(), seq_len=16, cp_size=2) == []  # no dropout in eval mode
    # attention only in the MTP depth: its dropout counts while MTP runs (training), not in eval
    mtp_attention = NemotronHForCausalLM(tiny_hf_config("M-", mtp_depths=1, attention_dropout=0.1)).train()
    assert model_cp_problems(mtp_attention, seq_len=16, cp_size=2) == [dropout]
    assert model_cp_problems(mtp_attention.eval(), seq_len=16, cp_size=2) == []
