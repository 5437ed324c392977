"""Gemma 4 MoE (am_models_gemma4) through am-pipelining on 2 real gloo ranks, with padded rows.

Contract: the pipelined loss of every micro-batch and every parameter's gradient equal the unsplit model's own
forward on the same micro-batches (fp32, `RTOL`), and padding never reaches the experts: the per-expert routing
counts of each stage's layers (am_moe's load statistics) equal the unsplit model's exactly, and sum to top_k x the
real tokens. The padding travels as `attention_mask` / `padding_mask` kwargs given to `schedule.step` on every rank
(masks never travel between stages). Text model and VLM wrapper (an image per row); one process group for both.

This lives in integration_tests because it needs two packages that are tested in isolation: am-pipelining (whose
package tests use transformers' Gemma 4) and am_models_gemma4 (which must not import am-pipelining).
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest
import torch
from torch import nn

from am_testing import case_result, run_cases, run_group

# fp64 (the routers still compute in fp32): the pipeline and the reference run the same micro-batch shapes, but the
# VLM's pipeline forward scatters the image features in another order than the model's, and the vision tower's tiny
# q/k-norm gradients (|g| ~ 3e-4) then differ by ~5e-5 relative in fp32 (1e-16 in fp64).
RTOL = 1e-6
SEQ = 12
VOCAB = 64
IMAGE_TOKEN = 60
PADS_PER_ROW = (0, 3, 6, 1)  # right padding, after the image tokens (positions 1-4)
CASES = ("text", "vlm")
LAUNCH_DEADLINE_S = 300  # the group's whole run (~60 s on 2 busy cores)


def _text_config() -> Any:
    from trainer.models import gemma4_config

    config = gemma4_config(hidden_size=32, num_layers=4, moe=True, vocab_size=VOCAB)
    config.sliding_window = 4  # shorter than the sequence: the stages' sliding masks matter
    return config


def _model(case: str) -> nn.Module:
    from transformers import Gemma4Config, Gemma4VisionConfig

    from am_models_gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    torch.manual_seed(7)
    if case == "text":
        return Gemma4ForCausalLM(_text_config()).double().train()
    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=2,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    config = Gemma4Config(
        text_config=_text_config().to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=IMAGE_TOKEN,
        boi_token_id=58,
        eoi_token_id=59,
        audio_token_id=57,
        video_token_id=56,
    )
    return Gemma4ForConditionalGeneration(config).double().train()


def _batch(case: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 56, (4, SEQ + 1), generator=gen)
    batch = {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}
    pads = torch.zeros(4, SEQ, dtype=torch.bool)
    for row, count in enumerate(PADS_PER_ROW):
        if count:
            pads[row, -count:] = True
    if case == "vlm":  # one image per row: 4 x 4 patches of 2 x 2 pixels, pooled 2 x 2 -> 4 soft tokens
        batch["input_ids"][:, 1:5] = IMAGE_TOKEN
        batch["pixel_values"] = torch.rand(4, 16, 12, generator=gen, dtype=torch.float64)
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
        batch["image_position_ids"] = grid.repeat(4, 1, 1)
    batch["input_ids"] = batch["input_ids"].masked_fill(pads, 0)
    labels = batch["labels"].masked_fill(pads, -100)
    batch["labels"] = labels.masked_fill(batch["input_ids"] == IMAGE_TOKEN, -100)
    batch["attention_mask"] = (~pads).long()
    batch["padding_mask"] = pads
    return batch


def _mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _load(model: nn.Module) -> dict[str, torch.Tensor]:
    from am_moe import expert_load

    return expert_load(model, reset=True).tokens_per_expert


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _case(case: str, mesh: Any) -> dict[str, Any]:
    from am_pipelining import build_pipeline_schedule, split_model_into_stages, sync_tied_embedding_grads

    reference = _model(case)
    model = copy.deepcopy(reference)
    batch = _batch(case)
    media = ("pixel_values", "image_position_ids")
    _load(reference)
    reference_losses = []
    for row in range(4):
        chunk = {k: v[row : row + 1] for k, v in batch.items() if k not in ("labels", "padding_mask")}
        loss = _mean_ce(reference(**chunk).logits, batch["labels"][row : row + 1])
        loss.backward()
        reference_losses.append(loss.detach())
    reference_load = _load(reference)

    stages, parts = split_model_into_stages(model, mesh, "pp", "1F1B", "cpu", microbatch_size=1, seq_len=SEQ)
    _load(model)
    schedule = build_pipeline_schedule(None, "1F1B", 1, 4, stages, _mean_ce)
    has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses: list[torch.Tensor] = []
    kwargs = {k: batch[k] for k in ("attention_mask", "padding_mask", *media) if k in batch}
    args = (batch["input_ids"],) if has_first else ()
    schedule.step(*args, target=batch["labels"], losses=losses, **kwargs)
    sync_tied_embedding_grads(parts)

    problems = []
    if has_last:
        for row, (got, want) in enumerate(zip(losses, reference_losses, strict=True)):
            if _rel(got.detach(), want) > RTOL:
                problems.append(f"micro-batch {row}: loss {got.item()} vs {want.item()}")
    reference_params = dict(reference.named_parameters(remove_duplicate=False))
    for part in parts:
        for name, param in part.named_parameters():
            want_grad = reference_params[name].grad
            if param.grad is None or want_grad is None:
                problems.append(f"{name}: no gradient ({param.grad is None=}, {want_grad is None=})")
            elif _rel(param.grad, want_grad) > RTOL or param.grad.dtype != torch.float64:
                problems.append(f"{name}: gradient relative error {_rel(param.grad, want_grad):.2e}")
    stage_load = {name: counts for part in parts for name, counts in _load(part).items()}
    real_pairs = int((~batch["padding_mask"]).sum()) * int(_text_config().top_k_experts)
    for name, counts in stage_load.items():
        if not torch.equal(counts, reference_load[name]):
            problems.append(
                f"{name}: routed {counts.tolist()} per expert, unsplit model {reference_load[name].tolist()}"
            )
        if int(counts.sum()) != real_pairs:
            problems.append(f"{name}: {int(counts.sum())} routed pairs, expected top_k x real tokens = {real_pairs}")
    return {"problems": problems, "moe_layers": sorted(stage_load), "losses": len(losses)}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `trainer` for the configs
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    # A failed case may leave pipeline messages unmatched: the cases after it are then recorded as not run.
    return run_cases({case: functools.partial(_case, case, mesh) for case in CASES}, stop_after_failure=True)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    """One 2-rank gloo group (am-testing, with a deadline) runs both cases."""
    return run_group(2, _worker, timeout=LAUNCH_DEADLINE_S)


@pytest.mark.parametrize("case", CASES)
def test_moe_pipeline_matches_the_unsplit_model_and_keeps_padding_out_of_the_experts(results, case: str) -> None:
    for rank in range(len(results)):
        outcome = case_result(results, case, rank)
        assert not outcome["problems"], f"rank {rank}:\n" + "\n".join(outcome["problems"])
        assert len(outcome["moe_layers"]) == 2, f"rank {rank} holds MoE layers {outcome['moe_layers']}"
    assert results[1][case]["losses"] == 4  # the last stage computed every micro-batch's loss
