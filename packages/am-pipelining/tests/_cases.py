"""Distributed test cases, run inside the gloo ranks started by `_dist.run_ranks` (one launch per test module).

Every case raises on failure. Parity is the oracle: the pipelined loss and every parameter's gradient must match
the unsplit HF model on the same batch, where the reference loss is the sum over microbatches of the per-microbatch
mean cross entropy (the schedule runs with `scale_grads=False`, so its gradients are that sum's gradients too).
"""

from __future__ import annotations

import copy
import functools
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import _models as M
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from am_pipelining import (
    AutoPipeline,
    PipelineCausalLMLoss,
    _compat,
    build_pipeline_schedule,
    build_schedule,
    build_stages,
    pipeline_model,
    plan_for_model,
    reset_pp_stage_shapes,
    scale_grads_by_divisor,
    split_model_into_stages,
    sync_tied_embedding_grads,
)
from am_pipelining.schedule_picture import schedule_timeline

REL_TOL = 1e-5
"""fp32 parity bound (norm-wise relative error). Pipeline and reference run the same microbatch shapes, so only the
order of fp32 gradient accumulation differs (~1e-7)."""

SINGLE_STAGE = ("GPipe", "1F1B")
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
ALL_SCHEDULES = SINGLE_STAGE + MULTI_STAGE
MODELS = ("llama", "llama_tied", "qwen3", "mistral", "gemma4", "gemma4_vlm", "mistral3_vlm")

_MESH: dict[int, Any] = {}


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world not in _MESH:
        _MESH[world] = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    return _MESH[world]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _reference(model: nn.Module, name: str, data: dict[str, torch.Tensor], microbatch: int) -> list[torch.Tensor]:
    """The unsplit HF model (its own forward) on the same microbatches; gradients accumulate over them.

    Running the reference per microbatch keeps matmul shapes equal to the pipeline's, so the comparison measures
    the pipeline, not fp32 batch-size rounding (which reaches ~2e-5 on Gemma 4's small norm gradients).
    """
    model.zero_grad(set_to_none=True)
    losses = []
    for i in range(0, len(data["labels"]), microbatch):
        chunk = {k: v[i : i + microbatch] for k, v in data.items()}
        loss = M.mean_ce(M.reference_forward(model, name, chunk), chunk["labels"])
        loss.backward()
        losses.append(loss.detach())
    return losses


def _compare(
    ref_model: nn.Module,
    parts: list[nn.Module],
    losses: list[torch.Tensor],
    ref_losses: list[torch.Tensor],
    has_last: bool,
) -> None:
    if has_last:
        assert len(losses) == len(ref_losses), f"{len(losses)} pipeline losses vs {len(ref_losses)} microbatches"
        for i, (loss, ref) in enumerate(zip(losses, ref_losses, strict=True)):
            assert _rel(loss.detach(), ref) <= REL_TOL, f"microbatch {i} loss {loss.item()} vs reference {ref.item()}"
    ref_params = dict(ref_model.named_parameters(remove_duplicate=False))
    checked = 0
    for part in parts:
        for param_name, param in part.named_parameters():
            ref = ref_params[param_name]
            assert param.grad is not None, f"{param_name} has no gradient on this stage"
            assert ref.grad is not None, f"{param_name} has no gradient in the reference"
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            rel = _rel(grad, ref.grad)
            assert rel <= REL_TOL, f"{param_name}: gradient relative error {rel:.2e} > {REL_TOL}"
            checked += 1
    assert checked > 0, "no parameters on this rank"


def parity_case(
    name: str,
    schedule: str,
    *,
    layers: int,
    batch_size: int = 4,
    microbatch: int = 1,
    stages_per_rank: int | None = None,
    expected_layers: dict[int, list[list[int]]] | None = None,
) -> None:
    """Pipelined loss and gradients equal the unsplit model's; with `expected_layers` ({rank: layers per local
    stage}) the split is checked too. Planned once; stages and schedule are built from the plan (the core path)."""
    ref_model = M.FACTORIES[name](layers)
    model = copy.deepcopy(ref_model)
    data = M.batch(name, batch_size)
    ref_losses = _reference(ref_model, name, data, microbatch)
    plan = plan_for_model(
        model,
        dist.get_world_size(),
        schedule,
        stages_per_rank=stages_per_rank,
        local_batch_size=batch_size,
        microbatch_size=microbatch,
    )
    stages, parts = build_stages(model, _mesh(), plan, device="cpu", seq_len=M.SEQ)
    if expected_layers is not None:
        got = [[int(k) for k in part.model.layers] for part in parts]
        want = expected_layers[dist.get_rank()]
        assert got == want, f"rank {dist.get_rank()} runs layers {got}, expected {want}"
    sched = build_schedule(stages, plan, loss_fn=M.mean_ce)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    losses: list[torch.Tensor] = []
    args = (data["input_ids"],) if has_first else ()
    sched.step(*args, target=data["labels"], losses=losses, **M.media_kwargs(name, data))
    sync_tied_embedding_grads(parts)
    _compare(ref_model, parts, losses, ref_losses, has_last)


def padded_moe_case(name: str) -> None:
    """Gemma 4 MoE (transformers' text model or VLM) with right-padded rows, 1F1B on 2 ranks: `attention_mask` and
    `padding_mask` given to `schedule.step` on every rank reach every stage. Loss and gradients equal the unsplit
    model's (its own forward with the attention mask), and every decoder layer of every stage is called with its
    micro-batch's padding mask, the input MoE layers keep padding out of routing with (transformers' layers accept
    and ignore it; am_models_gemma4's route on it, checked in integration_tests/tests/test_moe_pipeline.py)."""
    ref_model = M.FACTORIES[name](4, moe=True)
    model = copy.deepcopy(ref_model)
    data = M.batch(name, 4)
    pads = torch.zeros_like(data["input_ids"], dtype=torch.bool)
    for row, count in enumerate((0, 3, 2, 1)):  # right padding after the image tokens (positions 1-4)
        if count:
            pads[row, -count:] = True
    data["input_ids"] = data["input_ids"].masked_fill(pads, 0)
    data["labels"] = data["labels"].masked_fill(pads, -100)
    data["attention_mask"] = (~pads).long()
    ref_model.zero_grad(set_to_none=True)
    ref_losses = []
    for i in range(4):
        chunk = {k: v[i : i + 1] for k, v in data.items()}
        logits = ref_model(
            input_ids=chunk["input_ids"], attention_mask=chunk["attention_mask"], **M.media_kwargs(name, chunk)
        ).logits
        loss = M.mean_ce(logits, chunk["labels"])
        loss.backward()
        ref_losses.append(loss.detach())
    stages, parts = split_model_into_stages(model, _mesh(), "pp", "1F1B", "cpu", microbatch_size=1, seq_len=M.SEQ)
    seen: list[tuple[int, torch.Tensor | None]] = []
    for part in parts:
        text = part.model.language_model if name == "gemma4_vlm" else part.model
        for key, layer in text.layers.items():
            layer.register_forward_pre_hook(
                lambda _m, _a, kwargs, key=int(key): seen.append((key, kwargs.get("padding_mask"))), with_kwargs=True
            )
    sched = build_pipeline_schedule(None, "1F1B", 1, 4, stages, M.mean_ce)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    losses: list[torch.Tensor] = []
    args = (data["input_ids"],) if has_first else ()
    masks = {"attention_mask": data["attention_mask"], "padding_mask": pads}
    sched.step(*args, target=data["labels"], losses=losses, **masks, **M.media_kwargs(name, data))
    sync_tied_embedding_grads(parts)
    _compare(ref_model, parts, losses, ref_losses, has_last)
    keys = [
        int(k) for part in parts for k in (part.model.language_model if name == "gemma4_vlm" else part.model).layers
    ]
    assert len(seen) == 4 * len(keys), f"{len(seen)} layer calls, expected 4 micro-batches x {len(keys)} layers"
    for call, (key, mask) in enumerate(seen):
        microbatch = call // len(keys)  # 1F1B runs the forwards of one stage in micro-batch order
        assert mask is not None, f"layer {key} got no padding_mask (micro-batch {microbatch})"
        assert torch.equal(mask, pads[microbatch : microbatch + 1]), f"layer {key}: wrong padding mask"


def csv_case(schedule: str = "Interleaved1F1B") -> None:
    """A compute-only CSV schedule (written from `schedule`'s action list: Interleaved1F1B, 2 stages per rank, or
    1F1B, 1 stage per rank) runs through `build_pipeline_schedule(csv, None, ...)` and matches the reference."""
    world = dist.get_world_size()
    per_rank = 2 if schedule == "Interleaved1F1B" else 1
    timeline = schedule_timeline(schedule, pp_size=world, n_microbatches=4, stages_per_rank=per_rank)
    rows = {r: [a for a in timeline.actions if a.rank == r] for r in range(world)}
    path = os.path.join(tempfile.gettempdir(), f"am_pp_schedule_{schedule}_{os.getppid()}.csv")
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            for r in range(world):
                f.write(",".join(f"{a.stage}{a.kind}{a.microbatch}" for a in rows[r]) + "\n")
    dist.barrier()
    ref_model = M.llama(4)
    model = copy.deepcopy(ref_model)
    data = M.batch("llama", 4)
    ref_losses = _reference(ref_model, "llama", data, 1)
    stages, parts = split_model_into_stages(model, _mesh(), "pp", schedule, "cpu")
    sched = build_pipeline_schedule(path, None, 1, 4, stages, M.mean_ce)
    losses: list[torch.Tensor] = []
    has_first = any(s.is_first for s in stages)
    sched.step(*((data["input_ids"],) if has_first else ()), target=data["labels"], losses=losses)
    _compare(ref_model, parts, losses, ref_losses, any(s.is_last for s in stages))


def mask_cache_case(*, with_mask: bool) -> None:
    """Causal-mask builds per stage: 1 over all steps/microbatches without a mask; one per forward with one."""
    model = M.mistral(4)  # sliding + full kinds exercise the mapping
    stages, parts = split_model_into_stages(model, _mesh(), "pp", "1F1B", "cpu", microbatch_size=1, seq_len=M.SEQ)
    sched = build_pipeline_schedule(None, "1F1B", 1, 4, stages, M.mean_ce)
    data = M.batch("mistral", 4)
    steps = 3
    kwargs = {"attention_mask": torch.ones_like(data["input_ids"])} if with_mask else {}
    for _ in range(steps):
        args = (data["input_ids"],) if stages[0].is_first else ()
        sched.step(*args, target=data["labels"], **kwargs)
    builds = parts[0].model.__dict__.get("_pp_mask_builds", 0)
    expected = steps * 4 if with_mask else 1
    assert builds == expected, f"stage {stages[0].stage_index}: {builds} mask builds, expected {expected}"


def tied_training_case() -> None:
    """Tied embeddings split across stages: loss, grads (embedding grad = sum of both uses) and 3 AdamW steps
    match the unsplit tied model."""
    ref_model = M.llama(4, tied=True)
    assert ref_model.lm_head.weight is ref_model.model.embed_tokens.weight
    model = copy.deepcopy(ref_model)
    stages, parts = split_model_into_stages(model, _mesh(), "pp", "1F1B", "cpu", microbatch_size=1, seq_len=M.SEQ)
    sched = build_pipeline_schedule(None, "1F1B", 1, 4, stages, M.mean_ce)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-2)
    has_first, has_last = stages[0].is_first, stages[-1].is_last
    for step in range(3):
        data = M.batch("llama", 4, seed=200 + step)
        ref_losses = _reference(ref_model, "llama", data, 1)
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        sched.step(*((data["input_ids"],) if has_first else ()), target=data["labels"], losses=losses)
        synced = sync_tied_embedding_grads(parts)
        assert synced == (1 if (has_first or has_last) else 0)
        _compare(ref_model, parts, losses, ref_losses, has_last)
        ref_opt.step()
        opt.step()
    ref_params = dict(ref_model.named_parameters(remove_duplicate=False))
    for part in parts:
        for param_name, param in part.named_parameters():
            assert _rel(param.detach(), ref_params[param_name].detach()) <= REL_TOL, f"{param_name} diverged"


def hooked_mtp_case(model_class: type = M.HookedMTPModel) -> None:
    """A non-HF model's hooks are honoured (stage list, stage metas, kwargs chunk dims, own forward), and the
    MTP loss through PipelineCausalLMLoss matches the single-process loss and gradients (with a declared
    `pipeline_output_names` tuple, its seq_idx travels to the loss by name)."""
    ref_model = model_class(4)
    model = copy.deepcopy(ref_model)
    batch_size, seq = 4, M.SEQ
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, M.VOCAB, (batch_size, seq + 1), generator=generator)
    x, labels = ids[:, :-1], ids[:, 1:]
    pos = torch.randint(0, 5, (3, batch_size, seq), generator=generator)
    loss_fn = PipelineCausalLMLoss(M.mean_ce, ref_model, scaling_factor=0.3)
    ref_losses = []
    ref_model.zero_grad()
    for i in range(batch_size):
        ref_losses.append(loss_fn(ref_model(x[i : i + 1], pos=pos[:, i : i + 1]), labels[i : i + 1]))
    torch.stack(ref_losses).sum().backward()

    pipe = AutoPipeline(
        world_mesh=_mesh(), pp_schedule="1f1b", pp_microbatch_size=1, pp_batch_size=batch_size, pp_seq_len=seq
    )
    pipe_loss = PipelineCausalLMLoss(M.mean_ce, None, scaling_factor=0.3)
    pipe.build(model, loss_fn=pipe_loss)
    pipe_loss.__dict__["model"] = pipe.parts[-1]
    assert model.hook_calls
    assert model.hook_calls[0].startswith("customize:model.:")
    has_last = pipe.info.has_last_stage
    if has_last:
        assert pipe.parts[-1].mtp is not None, "customize_pipeline_stage_modules did not add mtp to the last stage"
    else:
        assert pipe.parts[0].mtp is None
    losses: list[torch.Tensor] = []
    pipe.step(x, target=labels, losses=losses, pos=pos)
    _compare(ref_model, pipe.parts, losses, [loss.detach() for loss in ref_losses], has_last)


def autopipeline_case() -> None:
    """AutoPipeline: build, step, per-stage parameter counts, debug summary, update_seq_len to a shorter batch."""
    ref_model = M.qwen3(4)
    model = copy.deepcopy(ref_model)
    pipe = AutoPipeline(world_mesh=_mesh(), pp_schedule="1f1b", pp_microbatch_size=1, pp_batch_size=4, pp_seq_len=8)
    assert pipe.pretty_print_stages() == "<no stages>"
    pipe.build(model, loss_fn=M.mean_ce)
    counts = torch.tensor(float(sum(pipe.get_stage_param_counts())))
    dist.all_reduce(counts)
    assert int(counts.item()) == sum(p.numel() for p in ref_model.parameters()), "stage params do not add up"
    summary = pipe.debug_summary()
    assert f"PP degree: {dist.get_world_size()}" in summary
    assert "Schedule: Schedule1F1B" in summary
    assert "Stage " in pipe.pretty_print_stages()
    for seq in (8, 5):
        pipe.update_seq_len(seq)
        data = M.batch("qwen3", 4, seed=300 + seq)
        data = {k: v[:, :seq] for k, v in data.items()}
        ref_losses = _reference(ref_model, "qwen3", data, 1)
        for part in pipe.parts:
            part.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        pipe.step(data["input_ids"], target=data["labels"], losses=losses)
        _compare(ref_model, pipe.parts, losses, ref_losses, pipe.info.has_last_stage)
    # Upstream's free functions, called as upstream documents them: back to seq 8 through `reset_pp_stage_shapes`
    # (positional schedule, stages, config, microbatch_size, seq_len), then `scale_grads_by_divisor`.
    reset_pp_stage_shapes(pipe.info.schedule, pipe.info.stages, model.config, 1, 8)
    data = M.batch("qwen3", 4, seed=308)
    ref_losses = _reference(ref_model, "qwen3", data, 1)
    for part in pipe.parts:
        part.zero_grad(set_to_none=True)
    losses = []
    pipe.step(data["input_ids"], target=data["labels"], losses=losses)
    _compare(ref_model, pipe.parts, losses, ref_losses, pipe.info.has_last_stage)
    before = [p.grad.clone() for part in pipe.parts for p in part.parameters() if p.grad is not None]
    scale_grads_by_divisor(pipe.info.stages, 2)
    after = [p.grad for part in pipe.parts for p in part.parameters() if p.grad is not None]
    assert before, "no gradients to scale"
    for old, new in zip(before, after, strict=True):
        torch.testing.assert_close(new, old / 2)


def split_names_case(*, meta: bool) -> None:
    """split_model_into_stages: ModuleDict keyed by global index, embed/norm/head placement, own params only,
    and no allocation for a meta-device model."""
    world = dist.get_world_size()
    if meta:
        with torch.device("meta"):
            model = _meta_llama(4)
    else:
        model = M.llama(4)
    full = {n: p for n, p in model.named_parameters()}
    _stages, parts = split_model_into_stages(model, _mesh(), "pp", "1F1B", "cpu")
    (part,) = parts
    rank = dist.get_rank()
    per = 4 // world
    expected_layers = [str(i) for i in range(rank * per, (rank + 1) * per)]
    assert isinstance(part.model.layers, nn.ModuleDict)
    assert list(part.model.layers.keys()) == expected_layers
    assert (part.model.embed_tokens is not None) == (rank == 0)
    assert (part.model.norm is not None) == (rank == world - 1)
    assert (part.lm_head is not None) == (rank == world - 1)
    names = {n for n, _ in part.named_parameters()}
    expected = {
        n
        for n in full
        if any(n.startswith(f"model.layers.{i}.") for i in expected_layers)
        or (rank == 0 and n.startswith("model.embed_tokens."))
        or (rank == world - 1 and (n.startswith("model.norm.") or n.startswith("lm_head.")))
    }
    assert names == expected, f"stage params {sorted(names ^ expected)} differ from the expected subset"
    for n, p in part.named_parameters():
        assert p.is_meta == meta
        if not meta:
            assert p.data_ptr() != full[n].data_ptr(), f"{n} shares storage with the original model"
            assert torch.equal(p, full[n])
    assert isinstance(model.model.layers, nn.ModuleList), "original was modified"
    assert len(model.model.layers) == 4, "original was modified"


def _meta_llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=M.VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def too_few_microbatches_case() -> None:
    world = dist.get_world_size()
    stages, _ = split_model_into_stages(M.llama(4), _mesh(), "pp", "1F1B", "cpu")
    with pytest.raises(ValueError, match=r"needs at least \d+ microbatches"):
        build_pipeline_schedule(None, "1F1B", 1, world - 1, stages, M.mean_ce)
    with pytest.raises(ValueError, match=r"local_batch_size=5 is not divisible by microbatch_size=2"):
        build_pipeline_schedule(None, "1F1B", 2, 5, stages, M.mean_ce)
    with pytest.raises(ValueError, match=r"Single stage schedule .* requires exactly 1 stage per rank"):
        split_model_into_stages(M.llama(4), _mesh(), "pp", "1F1B", "cpu", stages_per_rank=2)
    # A schedule of another kind than the split's is refused before it runs.
    with pytest.raises(ValueError, match=r"at least 2 stages per rank"):
        build_pipeline_schedule(None, "Interleaved1F1B", 1, 2 * world, stages, M.mean_ce)


def static_shape_mismatch_case() -> None:
    """Static-shape stages fed another sequence length or batch: every rank refuses the step before any send
    (it used to wait on a message of the wrong size, then time out or abort); the schedule stays usable, and
    AutoPipeline.update_seq_len makes the new length run."""
    import time

    started = time.perf_counter()
    stages, _ = split_model_into_stages(M.llama(4), _mesh(), "pp", "1F1B", "cpu", microbatch_size=1, seq_len=M.SEQ)
    sched = build_pipeline_schedule(None, "1F1B", 1, 4, stages, M.mean_ce)
    data = M.batch("llama", 4)
    first = stages[0].is_first

    def step(batch: dict[str, torch.Tensor]) -> None:
        sched.step(*((batch["input_ids"],) if first else ()), target=batch["labels"])

    short = {k: v[:, :6] for k, v in data.items()}
    with pytest.raises(ValueError, match=r"seq_len 8 .*update_seq_len\(6\)"):
        step(short)
    with pytest.raises(ValueError, match=r"shape \[3, 8\] .*give 4 rows per step"):
        step({k: v[:3] for k, v in data.items()})
    step(data)  # nothing was sent by the refused steps: the pipeline is intact
    pipe = AutoPipeline(world_mesh=_mesh(), pp_schedule="1f1b", pp_microbatch_size=1, pp_batch_size=4, pp_seq_len=8)
    pipe.build(M.llama(4), loss_fn=M.mean_ce)
    with pytest.raises(ValueError, match=r"update_seq_len\(6\)"):
        pipe.step(short["input_ids"])  # the model input is checked on every rank, even without a target
    pipe.update_seq_len(6)
    pipe.step(short["input_ids"], target=short["labels"])
    assert time.perf_counter() - started < 60, "refusals must not wait on a peer"


def cases_2ranks() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for model in MODELS:
        for schedule in ALL_SCHEDULES:
            cases[f"parity-{model}-{schedule}"] = functools.partial(parity_case, model, schedule, layers=4)
    # 8 layers, 2 ranks, 3 stages per rank: exactly 6 stages (2, 2, 1, 1, 1, 1 layers), placed in a loop.
    cases["parity-llama-Interleaved1F1B-3-stages-per-rank"] = functools.partial(
        parity_case,
        "llama",
        "Interleaved1F1B",
        layers=8,
        stages_per_rank=3,
        expected_layers={0: [[0, 1], [4], [6]], 1: [[2, 3], [5], [7]]},
    )
    cases["parity-qwen3-1F1B-uneven-5-layers"] = functools.partial(
        parity_case, "qwen3", "1F1B", layers=5, expected_layers={0: [[0, 1, 2]], 1: [[3, 4]]}
    )
    cases["csv-schedule"] = csv_case
    cases["csv-schedule-one-stage-per-rank"] = functools.partial(csv_case, "1F1B")
    cases["padded-moe-gemma4"] = functools.partial(padded_moe_case, "gemma4")
    cases["padded-moe-gemma4_vlm"] = functools.partial(padded_moe_case, "gemma4_vlm")
    cases["mask-cache-no-mask"] = functools.partial(mask_cache_case, with_mask=False)
    cases["mask-cache-with-mask"] = functools.partial(mask_cache_case, with_mask=True)
    cases["tied-training"] = tied_training_case
    cases["hooked-mtp"] = hooked_mtp_case
    cases["hooked-mtp-declared-outputs"] = functools.partial(hooked_mtp_case, M.DeclaredMTPModel)
    cases["autopipeline"] = autopipeline_case
    cases["split-materialized"] = functools.partial(split_names_case, meta=False)
    cases["split-meta"] = functools.partial(split_names_case, meta=True)
    cases["too-few-microbatches"] = too_few_microbatches_case
    cases["static-shape-mismatch-refused-on-every-rank"] = static_shape_mismatch_case
    return cases


def fsdp_case(name: str) -> None:
    """pp=2 × dp=2 mesh: each stage module wrapped with FSDP2 by `parallelize_fn`; both dp replicas see the same
    batch, so the averaged sharded gradients must equal the unsplit model's (tied copies synced per dp shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    ref_model = M.FACTORIES[name](4)
    model = copy.deepcopy(ref_model)
    data = M.batch(name, 4)
    ref_losses = _reference(ref_model, name, data, 1)

    def parallelize(part: nn.Module, *, world_mesh: Any, dp_axis_names: tuple[str, ...], **_: Any) -> nn.Module:
        fully_shard(part, mesh=world_mesh[dp_axis_names[0]])
        return part

    schedule, parts, has_first, has_last, _ = pipeline_model(
        model,
        mesh,
        pp_axis_name="pp",
        dp_axis_names=("dp",),
        pipeline_parallel_schedule="1F1B",
        microbatch_size=1,
        local_batch_size=4,
        device="cpu",
        loss_fn=M.mean_ce,
        parallelize_fn=parallelize,
        seq_len=M.SEQ,
    )
    losses: list[torch.Tensor] = []
    schedule.step(*((data["input_ids"],) if has_first else ()), target=data["labels"], losses=losses)
    sync_tied_embedding_grads(parts)
    _compare(ref_model, parts, losses, ref_losses, has_last)


def fsdp_update_seq_len_case() -> None:
    """pp=2 × dp=2 with FSDP2 through AutoPipeline: gradients accumulate over two steps of different sequence
    lengths (`update_seq_len` between them, no zero_grad) exactly as in the unsplit model. torch's stage
    re-initialisation after a shape change clears FSDP parameters' grads; the accumulated ones must survive."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    ref_model = M.llama(4)
    model = copy.deepcopy(ref_model)

    def parallelize(part: nn.Module, *, world_mesh: Any, dp_axis_names: tuple[str, ...], **_: Any) -> nn.Module:
        fully_shard(part, mesh=world_mesh[dp_axis_names[0]])
        return part

    pipe = AutoPipeline(world_mesh=mesh, pp_schedule="1f1b", pp_microbatch_size=1, pp_batch_size=4, pp_seq_len=8)
    pipe.build(model, loss_fn=M.mean_ce, parallelize_fn=parallelize)
    ref_model.zero_grad(set_to_none=True)
    ref_losses: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    for seq in (8, 5):
        data = {k: v[:, :seq] for k, v in M.batch("llama", 4, seed=400 + seq).items()}
        for i in range(4):  # the reference accumulates too: no zero_grad between the two batches
            logits = M.reference_forward(ref_model, "llama", {"input_ids": data["input_ids"][i : i + 1]})
            loss = M.mean_ce(logits, data["labels"][i : i + 1])
            loss.backward()
            ref_losses.append(loss.detach())
        pipe.update_seq_len(seq)
        step_losses: list[torch.Tensor] = []  # the schedule clears the list it is given
        pipe.step(data["input_ids"], target=data["labels"], losses=step_losses)
        losses.extend(step_losses)
    _compare(ref_model, pipe.parts, losses, ref_losses, pipe.info.has_last_stage)


class _CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter (`set_custom_reduce_scatter`), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().__call__(*args, **kwargs)


def _count_reduce_scatters(modules: list[Any]) -> list[_CountingReduceScatter]:
    counters = []
    for module in modules:
        counters.append(_CountingReduceScatter())
        module.set_custom_reduce_scatter(counters[-1])
    return counters


def fsdp_reduce_per_microbatch_case() -> None:
    """pp=2 × dp=2, FSDP2 on each stage module, `AutoPipeline(defer_fsdp_grad_sync=False)`: every one of the 4
    microbatches reduce-scatters (torch's stage would reduce once), and the gradients equal the unsplit model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    ref_model = M.llama(4)
    data = M.batch("llama", 4)
    ref_losses = _reference(ref_model, "llama", data, 1)

    def parallelize(part: nn.Module, *, world_mesh: Any, dp_axis_names: tuple[str, ...], **_: Any) -> nn.Module:
        fully_shard(part, mesh=world_mesh[dp_axis_names[0]])
        return part

    pipe = AutoPipeline(world_mesh=mesh, pp_batch_size=4, pp_seq_len=M.SEQ, defer_fsdp_grad_sync=False)
    if (why := _compat.fsdp_finalization_problem()) is not None:  # an older torch (the declared floor, 2.13)
        with pytest.raises(ValueError, match=re.escape(why)):
            pipe.build(copy.deepcopy(ref_model), loss_fn=M.mean_ce, parallelize_fn=parallelize)
        return
    pipe.build(copy.deepcopy(ref_model), loss_fn=M.mean_ce, parallelize_fn=parallelize)
    counters = _count_reduce_scatters(pipe.parts)
    for step in (1, 2):  # the second step shows that the first left FSDP2's state ready for the next
        pipe.parts[0].zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        pipe.step(data["input_ids"], target=data["labels"], losses=losses)
        assert [c.calls for c in counters] == [4 * step], f"reduce-scatters per stage: {[c.calls for c in counters]}"
        _compare(ref_model, pipe.parts, losses, ref_losses, pipe.info.has_last_stage)


def fsdp_nested_deferred_case() -> None:
    """pp=2 × dp=2, FSDP2 on each decoder layer only (the stage module is plain), with
    `patch_stage_backward_maybe_with_nosync=True`: each layer reduce-scatters once per step (torch's stage leaves
    nested FSDP2 modules reducing every microbatch: 4 times), and the gradients equal the unsplit model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    ref_model = M.llama(4)
    data = M.batch("llama", 4)
    ref_losses = _reference(ref_model, "llama", data, 1)
    sharded: list[Any] = []

    def parallelize(part: nn.Module, *, world_mesh: Any, dp_axis_names: tuple[str, ...], **_: Any) -> nn.Module:
        for name, module in list(part.named_modules()):
            if name.rsplit(".", 1)[0].endswith("layers") and name.rsplit(".", 1)[-1].isdigit():
                sharded.append(fully_shard(module, mesh=world_mesh[dp_axis_names[0]]))
        return part

    build = functools.partial(
        pipeline_model,
        copy.deepcopy(ref_model),
        mesh,
        pipeline_parallel_schedule="1F1B",
        local_batch_size=4,
        loss_fn=M.mean_ce,
        parallelize_fn=parallelize,
        seq_len=M.SEQ,
        patch_stage_backward_maybe_with_nosync=True,
    )
    if (why := _compat.fsdp_finalization_problem()) is not None:  # an older torch (the declared floor, 2.13)
        with pytest.raises(ValueError, match=re.escape(why)):
            build()
        return
    schedule, parts, has_first, has_last, _ = build()
    assert len(sharded) == 2, f"{len(sharded)} sharded layers on this rank"
    counters = _count_reduce_scatters(sharded)
    for step in (1, 2):  # the second step shows that the first left FSDP2's state ready for the next
        parts[0].zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(*((data["input_ids"],) if has_first else ()), target=data["labels"], losses=losses)
        assert [c.calls for c in counters] == [step, step], f"reduce-scatters per layer: {[c.calls for c in counters]}"
        _compare(ref_model, parts, losses, ref_losses, has_last)


def reduce_per_microbatch_split_backward_refused_case() -> None:
    """A zero-bubble schedule splits each backward into input and weight parts: per-microbatch reduction is
    refused on every rank when the schedule is built, before any step."""
    why = _compat.fsdp_finalization_problem()  # an older torch refuses the option itself first
    with pytest.raises(ValueError, match=re.escape(why) if why else "splits backward into input and weight parts"):
        pipeline_model(
            M.llama(8),
            _mesh(),
            pipeline_parallel_schedule="ZBVZeroBubble",
            local_batch_size=8,
            loss_fn=M.mean_ce,
            reduce_grad_per_microbatch=True,
        )


def cases_4ranks() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for model in MODELS:
        for schedule in SINGLE_STAGE:
            cases[f"parity-{model}-{schedule}"] = functools.partial(parity_case, model, schedule, layers=4)
    for model in ("llama_tied", "qwen3", "gemma4_vlm"):
        for schedule in MULTI_STAGE:
            batch = 8 if schedule == "DualPipeV" else 4
            cases[f"parity-{model}-{schedule}"] = functools.partial(
                parity_case, model, schedule, layers=8, batch_size=batch
            )
    cases["split-materialized"] = functools.partial(split_names_case, meta=False)
    cases["too-few-microbatches"] = too_few_microbatches_case
    cases["fsdp2-pp2xdp2-llama"] = functools.partial(fsdp_case, "llama")
    cases["fsdp2-pp2xdp2-llama_tied"] = functools.partial(fsdp_case, "llama_tied")
    cases["fsdp2-pp2xdp2-update-seq-len-accumulates"] = fsdp_update_seq_len_case
    cases["fsdp2-pp2xdp2-reduce-per-microbatch"] = fsdp_reduce_per_microbatch_case
    cases["fsdp2-pp2xdp2-nested-fsdp-reduces-once"] = fsdp_nested_deferred_case
    cases["reduce-per-microbatch-split-backward-refused"] = reduce_per_microbatch_split_backward_refused_case
    return cases
