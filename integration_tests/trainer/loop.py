"""The reference training loop: validate, build, parallelize, train, checkpoint, report — top to bottom.

What it is for: `run(cfg)` is the whole job, in the order a reader expects (torchtitan's train loop is the model):
    1. `validate`: everything that can be checked without a process group (trainer/validation.py: arguments,
       --out, the model (a preset on the meta device) and its folder, the pipeline plan against its layers, the mesh
       against its capabilities, data, checkpoint): ONE message, exit code 2. Otherwise the frozen run plan
       (trainer/plan.py: mesh, pipeline plan, EP plan, CP layout, precision, FSDP2, microbatches): the only layout
       the phases below read
    2. `setup_mesh`: process group (gloo on the CPU, NCCL on GPUs) and one DeviceMesh ("pp", "dp", "cp"), with
       "tp" innermost at --tp > 1; with N ranks, the NaN / inf check of a --model-path folder, each rank reading 1 / N
       of its tensors (`refuse_nonfinite_weights`: exit code 2 on every rank, the same message)
    3. `build`: the model validation built on the meta device (no weights anywhere yet)
       -> storage dtype (fp32; bf16 only for --dtype bf16-pure, fp32-pinned tensors kept) -> pipeline stages
       (pp > 1) -> tensor parallelism (tp > 1: the plan's modules of each part over tp; trainer/tensor_parallel.py)
       -> experts sharded over ep (ep > 1, carved out of dp x cp; trainer/expert_parallel.py) -> per-layer
       activation checkpointing / torch.compile (trainer/layer_wrappers.py) -> FSDP2 over dp x cp (also over one
       rank for mixed precision: bf16 compute, fp32 master weights; experts over the ranks left after ep)
       -> each rank materializes its own blocks only, TP shards included (trainer/build.py: seeded per-unit init,
       or the folder's slices), with the single process's values whatever the layout
    4. (`build`, too) optimizer per model part and LR schedule (trainer/optim.py; default AdamW, warm-up + cosine),
       global gradient-norm clipping across stages and shards (trainer/step_parts.py, with the loss); the streamed
       HF export of each checkpoint, one writer per stage (trainer/export.py)
    5. `restore`: the checkpoint to resume, if any (exact: weights, optimizer, data position, histories)
    6. `train`: steps: the global batch is the same on every rank; each rank takes its dp slice, then its CP shard
       (trainer/batch_step.py); every --val-every steps the held-out loss through the same step, backward off
       (trainer/evaluation.py); checkpoints (atomic), progress bar (MoE models: expert load imbalance), TensorBoard
    7. `finish`: loss curve, summary.json (with the plan) and a one-line summary on rank 0
What it must not do: hide a failure. Any exception ends this rank with a non-zero exit code; torchrun then stops the
other ranks, and every collective has a timeout, so no run hangs. A non-finite loss or gradient norm stops the run
on every rank at once (exit code 3, the step and the value named; trainer/guards.py), unless
`--skip-nonfinite-steps N` lets it drop up to N such updates (counted in the progress bar and summary.json); a
checkpoint is never written from non-finite weights, nor onto a disk without room (exit code 3 as well).

Loss: the model's own training objective, the GLOBAL token mean of the cross-entropy (plus, for a transformers MoE
model whose config asks for it, `router_aux_loss_coef` x its router load-balancing loss over the global batch:
trainer/step_parts.py's `RouterAuxLoss`, at pp = 1; reported apart as `aux_loss`). Every rank divides the token SUM
of its own tokens by the number of label tokens in the whole global batch (known on every rank, no collective);
microbatch gradients add up (pipeline `scale_grads=False`, or the pp = 1 accumulation loop), FSDP2 sums over dp x cp,
and the logged loss is the sum of the last stages' losses over all ranks. Hence every parallel layout computes
exactly the single-process loss and gradient.

Test-only hooks (fault injection, the fp32 contract's report): trainer/debug_hooks.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from am_moe import build_expert_meshes, reset_expert_load
from am_precision import cast_model_to_dtype
from trainer import checkpoint as ckpt
from trainer.batch_step import BatchStep
from trainer.build import materialize_parts
from trainer.config import RunConfig
from trainer.data import BatchStream, Corpus
from trainer.debug_hooks import BuildMemory, dump_fp32_tensors, maybe_inject_fault
from trainer.evaluation import evaluate, validation_batches
from trainer.expert_parallel import apply_expert_parallel, step_expert_imbalance
from trainer.export import make_hf_exporter, shard_bytes
from trainer.guards import EXIT_RUN_STOPPED, RunStopped, StepGuard, model_path_nonfinite_problems
from trainer.layer_wrappers import apply_activation_checkpointing, apply_compile
from trainer.moe_balance import MoEBalance
from trainer.optim import build_optimizers, lr_at, set_lr
from trainer.parallel import (
    CPPipelineTargets,
    apply_fsdp,
    build_mesh,
    init_distributed,
    layer_notes,
)
from trainer.plan import RunPlan, ValidatedRun
from trainer.progress import Progress, run_summary, save_loss_curve
from trainer.router_aux_pipeline import PipelineRouterAux
from trainer.step_memory import measured_step, state_bytes
from trainer.step_parts import RouterAuxLoss, TokenSumLoss, clip_grad_norm
from trainer.tb_logging import TensorBoardLog
from trainer.tensor_parallel import apply_tensor_parallel_to_parts
from trainer.validation import (
    EXIT_BAD_INPUT,
    BadInput,
    refusal,
    resume_changes,
    validate,
)


def run(cfg: RunConfig) -> dict[str, Any]:
    """The training job (see the module docstring). Returns the summary on rank 0, {} elsewhere."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    # A negative --threads is refused by validate(); meanwhile use the default.
    torch.set_num_threads(cfg.threads if cfg.threads > 0 else max(1, (os.cpu_count() or 1) // local_world))
    validated = validate(cfg, world_size=world_size)  # before any collective: BadInput, exit code 2
    _print_warnings(cfg, validated)
    plan, family, corpus, resume_dir = validated.plan, validated.spec.family, validated.corpus, validated.resume_dir
    meshes = setup_mesh(cfg, plan)
    if world_size > 1:  # the NaN / inf check of --model-path, split over the ranks: BadInput, exit code 2
        refuse_nonfinite_weights(cfg)
    built = build(cfg, validated, meshes)
    # A --model-path model that validation loaded lives on only as this rank's parts from here (a pipeline stage is a
    # pruned copy of it), so nothing may keep the whole model referenced.
    del validated
    history = restore(cfg, built, corpus=corpus, resume_dir=resume_dir)
    last_ckpt = train(cfg, plan, meshes, built, history, corpus=corpus)
    return finish(cfg, plan, meshes, history, family=family, last_ckpt=last_ckpt)


# ------------------------------------------------------------------------------------------------------------------
# The phases, in order
# ------------------------------------------------------------------------------------------------------------------


def _print_warnings(cfg: RunConfig, validated: ValidatedRun) -> None:
    """Rank 0 prints what the run does that the user may not expect (bf16-pure storage, options a resume changes, a
    model trained without findable decoder layers), before the process group starts."""
    plan = validated.plan
    warnings = [plan.precision.warning] if plan.precision.warning else []
    if validated.resume_dir is not None:
        warnings += resume_changes(cfg, ckpt.read_trainer_state(validated.resume_dir))
    warnings += layer_notes(validated.model, grouping=plan.fsdp_grouping)
    if int(os.environ.get("RANK", "0")) == 0:
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Meshes:
    """This rank's process-group facts: its device and global rank, the ("pp", "dp", "cp") mesh, its flattened
    "dp_cp" axis (FSDP2), and the ep / expert_dp meshes carved out of it (None at ep 1)."""

    device: torch.device
    rank: int
    mesh: DeviceMesh
    dp_cp: DeviceMesh
    ep: DeviceMesh | None
    expert_dp: DeviceMesh | None
    tp: DeviceMesh | None = None  # the "tp" axis (innermost; None at tp 1: trainer/tensor_parallel.py)


def setup_mesh(cfg: RunConfig, plan: RunPlan) -> Meshes:
    """Phase 2: the process group (gloo on the CPU, NCCL on GPUs), `--overwrite`'s deletion, and the plan's meshes."""
    device = init_distributed(timeout_s=cfg.timeout)
    rank = dist.get_rank()
    if cfg.overwrite:  # validated: a fresh run, asked to replace old checkpoints. Every rank waits on the same
        # condition (the flag, not the folder, which rank 0 may already have deleted when another rank looks).
        if rank == 0 and ckpt.existing_checkpoints(cfg.out):
            shutil.rmtree(ckpt.checkpoint_root(cfg.out))
            print(f"--overwrite: deleted the checkpoints under {cfg.out}", file=sys.stderr, flush=True)
        dist.barrier()
    return make_meshes(plan, device=device, rank=rank)


def make_meshes(plan: RunPlan, *, device: torch.device, rank: int) -> Meshes:
    """The plan's meshes over the started process group (a real one, or the dry run's fake one)."""
    mesh, dp_cp = build_mesh(plan, device=device)
    # ep > 1: the ep and expert_dp meshes carved out of dp_cp, ep innermost (trainer/expert_parallel.py)
    ep_mesh, expert_dp = build_expert_meshes(dp_cp, plan.expert_parallel) if plan.expert_parallel else (None, None)
    tp = mesh["tp"] if plan.tp > 1 else None
    return Meshes(device=device, rank=rank, mesh=mesh, dp_cp=dp_cp, ep=ep_mesh, expert_dp=expert_dp, tp=tp)


def refuse_nonfinite_weights(cfg: RunConfig) -> None:
    """Phase 2b (`--model-path`, N ranks; one process checks every tensor in `validate`): the NaN / inf check of the
    folder's tensors, each rank reading its 1 / N share (guards.py's `model_path_nonfinite_problems`), the lines of
    every rank gathered so that every rank refuses with the same message (BadInput, exit code 2) before anything is
    built. Collective over the world."""
    if cfg.model_path is None:
        return
    world_size = dist.get_world_size()
    mine = model_path_nonfinite_problems(cfg.model_path, part=dist.get_rank(), parts=world_size)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    problems = sorted(line for lines in gathered for line in lines)  # the same order on every rank
    if problems:
        raise refusal(problems)


@dataclass
class Built:
    """This rank's model parts (pipeline stage modules, or the whole model), their optimizers, the step that runs a
    global batch through them (`run_batch`), the loss whose denominator each step sets, the HF exporter."""

    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    run_batch: BatchStep
    loss_fn: TokenSumLoss
    export_hf: Any
    balance: MoEBalance | None = None  # the am-moe routers' load balancing (None: a model without them)


def build(cfg: RunConfig, validated: ValidatedRun, meshes: Meshes) -> Built:
    """Phase 3 and 4: the model as the plan lays it out (storage dtype -> pipeline stages -> experts over ep ->
    per-layer wrappers -> FSDP2), the pipeline schedule, the optimizers and the exporter."""
    from am_pipelining import PipelineCausalLMLoss, build_schedule, build_stages

    plan, device = validated.plan, meshes.device
    memory = BuildMemory()  # test-only (AM_TRAIN_MEMORY_REPORT): this rank's peak host memory while building
    memory.start()
    # Built once, on the meta device, by validation (a folder's names and shapes checked on its headers): no rank
    # holds a weight until the plan's layout is applied; then each rank materializes only its own blocks.
    model = validated.model
    # A transformers MoE model (router logits): its load-balancing loss (when its config adds it to the objective)
    # and its expert imbalance, over the global batch (dp x cp); the plan has it at pp = 1 only.
    router = RouterAuxLoss.from_plan(plan.router_aux, group=meshes.dp_cp.get_group()) if plan.router_aux else None
    # The storage dtype: bf16 (--dtype bf16-pure) with the model's fp32-pinned tensors kept bit-exactly (am-precision),
    # or nothing (fp32 storage: fp32, and the mixed-precision default bf16)
    if plan.precision.storage != torch.float32:
        cast_model_to_dtype(model, plan.precision.storage)
    stages: list[Any] = []
    parts = [model]
    pipeline_router = None
    if plan.is_pipeline:  # each rank keeps only its stages, as the plan lays them out (am-pipelining; the model's
        # hooks honoured), with static shapes [microbatch, local_seq_len] (the CP shard's) in the compute dtype
        stages, parts = build_stages(
            model, meshes.mesh, plan.pipeline, device=device, seq_len=plan.local_seq_len, dtype=plan.precision.compute
        )
        if router is not None:  # the router loss over the global batch, from each stage's own layers
            assert plan.num_layers is not None  # a pipeline needs the layers (validated)
            pipeline_router = PipelineRouterAux(parts, router, num_layers=plan.num_layers, device=device)
    if meshes.tp is not None:  # after the split (each stage shards what it holds), before EP and FSDP2
        apply_tensor_parallel_to_parts(parts, plan=plan.tensor_parallel, tp_mesh=meshes.tp)
    if meshes.ep is not None:
        apply_expert_parallel(parts, ep_mesh=meshes.ep)
    balance = None
    if plan.moe_balancing is not None:  # on each stage's own module (a stage copy would not share the settings)
        cp_group = meshes.mesh["cp"].get_group() if plan.cp > 1 else None
        balance = MoEBalance(parts, balancing=plan.moe_balancing, sequence_group=cp_group)
    for part in parts:  # after the split (each stage wraps its own layers), before FSDP2
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(part)
        if cfg.compile:
            apply_compile(part)
    if plan.fsdp:
        parts = [
            apply_fsdp(part, shard_mesh=meshes.dp_cp, precision=plan.precision, expert_mesh=meshes.expert_dp)
            for part in parts
        ]
    # This rank's blocks only (TP shards included: DTensor blocks, and the plain-tensor shards of modules that shard
    # themselves through their `tensor_parallel_shard_state`): the seeded per-unit init of a preset, the folder's
    # slices of a --model-path (trainer/build.py); values do not depend on the layout, so every layout equals the
    # single process. Every tensor is still on the meta device here (materialize_sharded_ refuses any that is not).
    read = materialize_parts(parts, materialize=validated.spec.materialize, seed=cfg.seed, device=device)
    if meshes.tp is not None:  # the replicated TP parameters' gradient sums, on the materialized parameters
        from am_tensor_parallel import reduce_partial_grads

        for part in parts:  # (materializing swaps the parameters' storage, dropping hooks)
            reduce_partial_grads(part)
    memory.finish(parts, meshes.rank, checkpoint_bytes_read=read)
    if os.environ.get("AM_TRAIN_FP32_REPORT"):
        dump_fp32_tensors(parts, os.environ["AM_TRAIN_FP32_REPORT"], meshes.rank, storage_dtype=plan.precision.storage)
    # --loss-parallel: the head keeps its vocabulary shard; the loss is vocabulary-parallel over the tp group
    loss_parallel = plan.tensor_parallel is not None and plan.tensor_parallel.loss_parallel
    loss_fn = TokenSumLoss(vocab_mesh=meshes.tp if loss_parallel else None)
    # Every rank passes a loss: torch's schedules run backward only when they have one. Only the last stage calls it.
    last_part = next((s.submod for s in stages if s.is_last), parts[-1])
    pipeline_loss = PipelineCausalLMLoss(loss_fn, model=last_part)
    schedule = None
    if plan.is_pipeline:
        target_loss = CPPipelineTargets(pipeline_loss) if plan.cp > 1 else pipeline_loss
        schedule = build_schedule(stages, plan.pipeline, loss_fn=target_loss)
    run_batch = BatchStep(
        plan=plan,
        parts=parts,
        schedule=schedule,
        loss_module=pipeline_loss,
        mesh=meshes.mesh,
        device=device,
        dp_rank=meshes.mesh["dp"].get_local_rank(),
        router=router,
        has_first=not stages or any(s.is_first for s in stages),
        counts_loss=meshes.tp is None or meshes.tp.get_local_rank() == 0,
        pipeline_router=pipeline_router,
    )
    # One optimizer per part: identical math to one over all parameters (trainer/optim.py).
    optimizers = build_optimizers(parts, cfg)
    # The HF export streams: one writer per stage (its first rank, dp_cp 0 of tp 0), each tensor gathered to it alone.
    stage_ranks = meshes.mesh.mesh[meshes.mesh.get_local_rank("pp")].flatten().tolist()
    export_hf = make_hf_exporter(
        parts,
        file_layout=validated.spec.file_layout,
        stage_ranks=stage_ranks,
        tp_group=meshes.tp.get_group() if meshes.tp is not None else None,
        max_shard_bytes=shard_bytes(cfg.hf_shard_size),
    )
    return Built(
        parts=parts, optimizers=optimizers, run_batch=run_batch, loss_fn=loss_fn, export_hf=export_hf, balance=balance
    )


@dataclass
class History:
    """What a run accumulates step by step (and a checkpoint restores): the data stream's position, the applied steps
    `(step, loss, grad norm)`, the validation losses `(step, loss)`, the expert imbalance per step (MoE models), the
    router aux loss per applied step (router models), and the guard's skipped steps."""

    stream: BatchStream
    guard: StepGuard
    start_step: int = 0
    losses: list[tuple[int, float, float]] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    imbalances: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    moe_terms: list[dict[str, float]] = field(default_factory=list)  # am-moe balancing terms per applied step
    # this rank's memory in the first step of this process (trainer/step_memory.py; summary.json's "memory", the
    # numbers the dry run estimates): parameter / gradient / optimizer bytes of its shards, saved-activation peak
    memory: dict[str, int] = field(default_factory=dict)


def restore(cfg: RunConfig, built: Built, *, corpus: Corpus, resume_dir: Path | None) -> History:
    """Phase 5: a fresh history, or the checkpoint's (weights, optimizer state, data position, histories) under
    `--resume`; exact, so a resumed run equals the uninterrupted one."""
    stream = BatchStream(corpus.train, seq_len=cfg.seq_len, global_batch=cfg.global_batch)
    history = History(stream=stream, guard=StepGuard(max_skips=cfg.skip_nonfinite_steps))
    if resume_dir is None:
        return history
    state = ckpt.load_checkpoint(resume_dir, model_parts=built.parts, optimizers=built.optimizers)
    stream.load_state_dict(state["data"])
    history.start_step = int(state["step"])
    history.losses = [tuple(x) for x in state["losses"]]
    history.val_losses = [tuple(x) for x in state.get("val_losses", [])]
    history.imbalances = list(state.get("expert_imbalance") or [])
    history.aux_losses = list(state.get("aux_losses") or [])
    history.moe_terms = list(state.get("moe_aux_losses") or [])
    history.guard = StepGuard(max_skips=cfg.skip_nonfinite_steps, skipped=state.get("skipped_steps", []))
    return history


def train(
    cfg: RunConfig, plan: RunPlan, meshes: Meshes, built: Built, history: History, *, corpus: Corpus
) -> Path | None:
    """Phase 6: the steps from `history.start_step + 1` to `--steps`, with validation, progress, TensorBoard and
    checkpoints; returns the last checkpoint written. Fills `history` (and its `wall_s`)."""
    rank, parts = meshes.rank, built.parts
    router, balance = built.run_batch.router, built.balance
    counts_load = plan.moe or router is not None
    val_batches = validation_batches(corpus.val, cfg) if corpus.val is not None else []
    pp_group = meshes.mesh["pp"].get_group()
    tp_group = meshes.tp.get_group() if meshes.tp is not None else None
    progress = Progress(
        total_steps=cfg.steps,
        start_step=history.start_step,
        tokens_per_step=plan.global_batch * plan.seq_len,
        enabled=cfg.progress and rank == 0,
    )
    tensorboard = TensorBoardLog(cfg, enabled=rank == 0)
    started = time.perf_counter()
    last_ckpt = None
    for step in range(history.start_step + 1, cfg.steps + 1):
        maybe_inject_fault(step, rank)
        input_ids, labels = history.stream.next_batch()
        built.loss_fn.denominator = float((labels != -100).sum())
        if balance is not None:
            balance.before_step(input_ids.numel())
        record = history.memory if step == history.start_step + 1 else None
        with measured_step(record, recomputation=cfg.activation_checkpointing):
            local = built.run_batch(input_ids, labels, train=True)
        aux_loss = None
        if router is not None and router.last_aux_share is not None:  # one all-reduce for both shares
            both = torch.stack([local, router.last_aux_share.to(local)])
            dist.all_reduce(both)
            local, aux_loss = both[0], float(both[1])
        else:
            dist.all_reduce(local)  # the sum of every rank's share is the global token mean
        moe_terms = balance.step_terms(meshes.device) if balance is not None else None
        grad_norm = clip_grad_norm(parts, max_norm=cfg.grad_clip, pp_group=pp_group, tp_group=tp_group)
        if record is not None:  # the gradients exist until zero_grad below
            record["gradient_bytes"] = state_bytes(parts, [])["gradient_bytes"]
        lr = lr_at(step, cfg)
        # The loss is all-reduced and the norm is global, so every rank takes the same decision here (no rank is
        # left waiting in a collective); RunStopped when the value is not finite and no skip is left.
        apply = history.guard.check(step, loss=float(local), grad_norm=float(grad_norm))
        set_lr(built.optimizers, lr)
        for optimizer in built.optimizers:
            if apply:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if record is not None:  # the optimizer state exists after its first step
            record |= {k: v for k, v in state_bytes(parts, built.optimizers).items() if k != "gradient_bytes"}
        if apply:
            history.losses.append((step, float(local), float(grad_norm)))
            if aux_loss is not None:
                history.aux_losses.append(aux_loss)
            if moe_terms is not None:
                history.moe_terms.append(moe_terms)
        elif rank == 0:
            print(
                f"warning: {history.guard.last_problem}; update skipped ({len(history.guard.skipped)} of "
                f"--skip-nonfinite-steps {cfg.skip_nonfinite_steps})",
                file=sys.stderr,
                flush=True,
            )
        imbalance = None
        if plan.moe:  # before any validation forward, which the counters would see too
            data_group = meshes.dp_cp.get_group()
            # the same global counts move the routers' biases (after the optimizer step; not for a skipped step)
            on_load = balance.update_bias if balance is not None and apply else None
            imbalance = step_expert_imbalance(
                parts, data_group=data_group, pp_group=pp_group, device=meshes.device, on_load=on_load
            )
        elif router is not None:  # counted in the step's forwards, over the global batch
            imbalance = router.last_imbalance if router.last_imbalance is not None else math.nan
        if counts_load:
            history.imbalances.append(imbalance)  # type: ignore[arg-type]
        val_loss = None
        if val_batches and (step % cfg.val_every == 0 or step == cfg.steps):
            val_loss = evaluate(val_batches, run_batch=built.run_batch, loss_fn=built.loss_fn, model_parts=parts)
            history.val_losses.append((step, val_loss))
            if plan.moe:
                for part in parts:  # the next step's load counts training tokens only
                    reset_expert_load(part)
            if balance is not None:
                balance.reset()  # and its balancing terms too
        skipped = len(history.guard.skipped) if cfg.skip_nonfinite_steps else None
        progress.update(
            step=step, loss=float(local), lr=lr, val_loss=val_loss, expert_imbalance=imbalance, aux_loss=aux_loss,
            skipped=skipped, moe_terms=moe_terms,
        )  # fmt: skip
        tensorboard.scalars(
            step,
            {"train/loss": float(local), "train/lr": lr, "train/grad_norm": float(grad_norm)}
            | {"train/tokens_per_s": progress.tokens_per_second()}
            | ({"train/expert_imbalance": imbalance} if imbalance is not None else {})
            | ({"train/aux_loss": aux_loss} if aux_loss is not None else {})
            | {f"train/{name}": value for name, value in (moe_terms or {}).items()}
            | ({"val/loss": val_loss} if val_loss is not None else {}),
        )
        if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps:
            last_ckpt = _save(cfg, step, plan, built, history)
    progress.close()
    tensorboard.close()
    history.wall_s = time.perf_counter() - started
    return last_ckpt


def _save(cfg: RunConfig, step: int, plan: RunPlan, built: Built, history: History) -> Path:
    """A checkpoint of this step (collective): the parts, the optimizers, and the trainer state a resume needs."""
    router, balancing = plan.router_aux, plan.moe_balancing
    trainer_state = {
        "args": json.loads(json.dumps(asdict(cfg), default=str)),
        "data": history.stream.state_dict(),
        "losses": history.losses,
        "val_losses": history.val_losses,
        "expert_imbalance": history.imbalances if plan.moe or router else None,
        "aux_losses": history.aux_losses if router else None,
        "moe_aux_losses": history.moe_terms if balancing is not None and balancing.has_loss_terms else None,
        "skipped_steps": history.guard.skipped,
    }
    return ckpt.save_checkpoint(
        cfg.out,
        step=step,
        model_parts=built.parts,
        optimizers=built.optimizers,
        trainer_state=trainer_state,
        export_hf=built.export_hf,
    )


def finish(
    cfg: RunConfig, plan: RunPlan, meshes: Meshes, history: History, *, family: str, last_ckpt: Path | None
) -> dict[str, Any]:
    """Phase 7: rank 0 writes the loss curve and summary.json (with `"plan": plan.to_json()`) and prints one line;
    every rank then leaves the process group. Returns the summary on rank 0, {} elsewhere."""
    summary: dict[str, Any] = {}
    memory: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(memory, history.memory)  # every rank's first-step memory, for summary.json
    if meshes.rank == 0:
        summary = run_summary(cfg, plan, history, family=family, last_ckpt=last_ckpt)
        summary["memory"] = {"ranks": memory}
        cfg.out.mkdir(parents=True, exist_ok=True)
        where = f"pp={plan.pp} dp={plan.dp} cp={plan.cp} ep={plan.ep}" + (f" tp={plan.tp}" if plan.tp > 1 else "")
        curve = save_loss_curve(
            [(s, loss) for s, loss, _ in history.losses],
            cfg.out / "loss_curve.png",
            title=f"{family}  {where}  {plan.dtype}",
            val_losses=list(history.val_losses),
        )
        summary["loss_curve"] = str(curve) if curve else None
        (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1))
        losses, skipped = history.losses, history.guard.skipped
        val_text = f", validation loss {summary['final_val_loss']:.4f}" if history.val_losses else ""
        loss_text = f"loss {losses[0][1]:.4f} -> {losses[-1][1]:.4f}" if losses else "no step applied"
        skip_text = f", {len(skipped)} step(s) skipped (non-finite)" if skipped else ""
        print(
            f"done: {family} {where} {plan.dtype}, {cfg.steps} steps, {loss_text}{skip_text}{val_text}, "
            f"{summary['tokens_per_s']:,.0f} tokens/s, {history.wall_s:.1f} s; curve {summary['loss_curve']}, "
            f"checkpoint {summary['checkpoint']}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    return summary


# ------------------------------------------------------------------------------------------------------------------
# The CLI entry
# ------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """CLI entry: run the job; bad input -> exit 2 on every rank with one message (printed by rank 0)."""
    from trainer.config import parse_args

    cfg = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        if cfg.dry_run:  # one process, fake tensors and process group (trainer/dry_run.py)
            from trainer.dry_run import main as dry_run_main

            return dry_run_main(cfg)
        run(cfg)
    except BadInput as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        if dist.is_initialized():  # refused after the process group (the shared NaN / inf check of --model-path),
            dist.barrier()  # on every rank at the same point; a bare destroy lets gloo abort at exit now and then
            dist.destroy_process_group()
        return EXIT_BAD_INPUT
    except RunStopped as exc:  # raised on every rank at the same point: each one says so and exits
        print(f"[rank {rank}] error: {exc}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return EXIT_RUN_STOPPED
    return 0


__all__ = ["BadInput", "TokenSumLoss", "clip_grad_norm", "lr_at", "main", "run", "validate"]
