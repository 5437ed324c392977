"""The reference training loop: validate, build, parallelize, train, checkpoint, report — top to bottom.

What it is for: `run(cfg)` is the whole job, in the order a reader expects (torchtitan's train loop is the model):
    1. validate everything that can be checked without a process group (trainer/validation.py: arguments, --out,
       the model and its folder, the pipeline plan against its layers, the mesh against its capabilities, data,
       checkpoint): ONE message, exit code 2
    2. process group (gloo on the CPU, NCCL on GPUs) and one DeviceMesh ("pp", "dp", "cp")
    3. model: fp32, seeded, identical on every rank -> attach_capabilities_and_validate(model, mesh)
       -> storage dtype (fp32; bf16 only for --dtype bf16-pure, fp32-pinned tensors kept) -> pipeline stages
       (pp > 1) -> experts sharded over ep (ep > 1, carved out of dp x cp; trainer/expert_parallel.py) -> per-layer
       activation checkpointing / torch.compile (trainer/layer_wrappers.py) -> FSDP2 over dp x cp (also over one
       rank for mixed precision: bf16 compute, fp32 master weights; experts over the ranks left after ep)
    4. optimizer per model part and LR schedule (trainer/optim.py; default AdamW, warm-up + cosine), global
       gradient-norm clipping across stages and shards (trainer/step_parts.py, with the loss and the HF export)
    5. steps: the global batch is the same on every rank; each rank takes its dp slice, then its CP shard
       (`run_batch`); every --val-every steps the held-out loss through the same `run_batch`, backward off
       (trainer/evaluation.py)
    6. checkpoints (atomic, exact resume), progress bar (MoE models: expert load imbalance), TensorBoard, loss curve
       and a one-line summary on rank 0
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

Fault injection (tests only): AM_TRAIN_FAIL_AT_STEP=<step> AM_TRAIN_FAIL_RANK=<rank> AM_TRAIN_FAIL_MODE=raise|sigkill
makes that rank raise (or SIGKILL itself) when the step starts. AM_TRAIN_FP32_REPORT=<folder> makes every rank write
its fp32-pinned tensors after the FSDP2 wrap (`fp32_rank<r>.pt`), to check the fp32 contract.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer import checkpoint as ckpt
from trainer.config import RunConfig, mesh_context
from trainer.data import BatchStream
from trainer.evaluation import evaluate, validation_batches
from trainer.expert_parallel import (
    apply_expert_parallel,
    build_ep_meshes,
    has_experts,
    reset_expert_counts,
    step_expert_imbalance,
)
from trainer.guards import EXIT_RUN_STOPPED, RunStopped, StepGuard
from trainer.layer_wrappers import apply_activation_checkpointing, apply_compile
from trainer.models import attn_implementation
from trainer.optim import build_optimizers, lr_at, set_lr
from trainer.parallel import (
    PRECISIONS,
    CPPipelineTargets,
    apply_fsdp,
    apply_precision,
    build_mesh,
    cp_layout_name,
    cp_local_seq_len,
    decoder_layers,
    fsdp_grouping,
    init_distributed,
    layer_notes,
    shard_batch_for_cp,
    shard_pipeline_batch_for_cp,
    split_cp_targets,
    split_pipeline,
    uses_fsdp,
)
from trainer.progress import Progress, save_loss_curve
from trainer.step_parts import RouterAuxLoss, TokenSumLoss, clip_grad_norm, make_hf_exporter
from trainer.tb_logging import TensorBoardLog
from trainer.validation import EXIT_BAD_INPUT, BadInput, resume_changes, validate

# ------------------------------------------------------------------------------------------------------------------
# The job
# ------------------------------------------------------------------------------------------------------------------


def _maybe_inject_fault(step: int, rank: int) -> None:
    if os.environ.get("AM_TRAIN_FAIL_AT_STEP") != str(step) or os.environ.get("AM_TRAIN_FAIL_RANK", "0") != str(rank):
        return
    print(f"[rank {rank}] injecting a fault at step {step}, time {time.time():.3f}", file=sys.stderr, flush=True)
    if os.environ.get("AM_TRAIN_FAIL_MODE", "raise") == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault on rank {rank} at step {step} (AM_TRAIN_FAIL_AT_STEP)")


def _dump_fp32_tensors(parts: list[nn.Module], folder: str, rank: int, *, storage_dtype: torch.dtype) -> None:
    """Write this rank's fp32-pinned tensors (full values, gathered from their FSDP2 shards), their dtypes, and the
    fp32 contract's violations (am-precision's report, unpinned tensors checked against `storage_dtype`)."""
    from torch.distributed.tensor import DTensor

    from am_precision import fp32_report

    facts: dict[str, Any] = {"_violations": []}
    for part in parts:
        report = fp32_report(part, storage_dtype=storage_dtype)
        tensors = dict(part.named_parameters()) | dict(part.named_buffers())
        for entry in report.entries:
            if entry.rule is None:
                continue
            tensor = tensors[entry.name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            facts[entry.name] = {
                "dtype": str(tensor.dtype),
                "dtensor": isinstance(tensor, DTensor),
                "value": full.detach().cpu().clone(),
            }
        facts["_violations"] += [str(v.name) for v in report.violations]
    Path(folder).mkdir(parents=True, exist_ok=True)
    torch.save(facts, Path(folder) / f"fp32_rank{rank}.pt")


def run(cfg: RunConfig) -> dict[str, Any]:
    """The training job (see the module docstring). Returns the summary on rank 0, {} elsewhere."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    # A negative --threads is refused by validate(); meanwhile use the default.
    torch.set_num_threads(cfg.threads if cfg.threads > 0 else max(1, (os.cpu_count() or 1) // local_world))

    # 1. Validate before any collective.
    spec, model, corpus, resume_dir, plan = validate(cfg, world_size=world_size)
    precision = PRECISIONS[cfg.dtype]
    warnings = [precision.warning] if precision.warning else []
    if resume_dir is not None:
        warnings += resume_changes(cfg, ckpt.read_trainer_state(resume_dir))
    warnings += layer_notes(model)  # a model trained without findable decoder layers: how FSDP2 groups it
    if int(os.environ.get("RANK", "0")) == 0:
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)

    # 2. Process group and mesh.
    device = init_distributed(timeout_s=cfg.timeout)
    rank = dist.get_rank()
    if cfg.overwrite:  # validated: a fresh run, asked to replace old checkpoints. Every rank waits on the same
        # condition (the flag, not the folder, which rank 0 may already have deleted when another rank looks).
        if rank == 0 and ckpt.existing_checkpoints(cfg.out):
            shutil.rmtree(ckpt.checkpoint_root(cfg.out))
            print(f"--overwrite: deleted the checkpoints under {cfg.out}", file=sys.stderr, flush=True)
        dist.barrier()
    mesh, dp_cp_mesh = build_mesh(pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, device=device)
    ep_mesh, expert_dp_mesh = build_ep_meshes(dp_cp_mesh, ep=cfg.ep)  # (None, None) at ep = 1
    dp_rank = mesh["dp"].get_local_rank()
    shard_rank = dp_cp_mesh.get_local_rank()

    num_layers = getattr(decoder_layers(model), "num_layers", None)  # None: found no layers (pp = 1 only)
    attention, grouping = attn_implementation(model), fsdp_grouping(model)
    cp_layout = cp_layout_name(model) if cfg.cp > 1 else None
    # 3. Model -> capabilities -> precision -> pipeline -> FSDP2.
    from am_capabilities import attach_capabilities_and_validate

    attach_capabilities_and_validate(model, mesh_context(cfg))
    moe = has_experts(model)
    # A transformers MoE model (router logits): its load-balancing loss (when its config adds it to the objective)
    # and its expert imbalance, over the global batch (dp x cp). pp = 1 only: validation refuses --pp > 1 when the
    # term is in the objective; otherwise a pipelined run trains on cross-entropy alone, its imbalance not counted.
    router = RouterAuxLoss.for_model(model, group=dp_cp_mesh.get_group()) if cfg.pp == 1 else None
    model.to(device)
    apply_precision(model, dtype=cfg.dtype)
    loss_fn = TokenSumLoss()
    from am_pipelining import PipelineCausalLMLoss, build_schedule, sync_tied_embedding_grads

    if cfg.pp > 1:
        local_seq_len = cp_local_seq_len(model, seq_len=cfg.seq_len, cp=cfg.cp)
        stages, parts = split_pipeline(model, mesh=mesh, plan=plan, cfg=cfg, device=device, seq_len=local_seq_len)
        del model  # each rank keeps only its stages
    else:
        stages, parts = [], [model]
    if ep_mesh is not None:
        apply_expert_parallel(parts, ep_mesh=ep_mesh)
    for part in parts:  # after the split (each stage wraps its own layers), before FSDP2
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(part)
        if cfg.compile:
            apply_compile(part)
    if uses_fsdp(dtype=cfg.dtype, dp=cfg.dp, cp=cfg.cp):
        parts = [apply_fsdp(part, shard_mesh=dp_cp_mesh, dtype=cfg.dtype, expert_mesh=expert_dp_mesh) for part in parts]
    if os.environ.get("AM_TRAIN_FP32_REPORT"):
        _dump_fp32_tensors(parts, os.environ["AM_TRAIN_FP32_REPORT"], rank, storage_dtype=precision.storage)
    # Every rank passes a loss: torch's schedules run backward only when they have one. Only the last stage calls it.
    last_part = next((s.submod for s in stages if s.is_last), parts[-1])
    pipeline_loss = PipelineCausalLMLoss(loss_fn, model=last_part)
    schedule = None
    if stages:
        schedule = build_schedule(
            stages, plan, loss_fn=CPPipelineTargets(pipeline_loss) if cfg.cp > 1 else pipeline_loss
        )
    has_first = not stages or any(s.is_first for s in stages)

    # 4. Optimizer (one per part: identical math to one over all parameters), LR schedule (trainer/optim.py).
    optimizers = build_optimizers(parts, cfg)
    stream = BatchStream(corpus.train, seq_len=cfg.seq_len, global_batch=cfg.global_batch)
    start_step, history, val_history = 0, [], []
    imbalances: list[float] = []  # per step, MoE models only: the worst layer's busiest expert / mean (global batch)
    aux_losses: list[float] = []  # per applied step (as `history`), router models only: the load-balancing loss
    guard = StepGuard(max_skips=cfg.skip_nonfinite_steps)
    if resume_dir is not None:
        state = ckpt.load_checkpoint(resume_dir, model_parts=parts, optimizers=optimizers)
        start_step, history = int(state["step"]), [tuple(x) for x in state["losses"]]
        val_history = [tuple(x) for x in state.get("val_losses", [])]
        imbalances = list(state.get("expert_imbalance") or [])
        aux_losses = list(state.get("aux_losses") or [])
        guard = StepGuard(max_skips=cfg.skip_nonfinite_steps, skipped=state.get("skipped_steps", []))
        stream.load_state_dict(state["data"])
    val_batches = validation_batches(corpus.val, cfg) if corpus.val is not None else []
    export_hf = make_hf_exporter(spec, parts, dtype=cfg.dtype, shard_rank=shard_rank)
    pp_group = mesh["pp"].get_group()
    progress = Progress(
        total_steps=cfg.steps,
        start_step=start_step,
        tokens_per_step=cfg.global_batch * cfg.seq_len,
        enabled=cfg.progress and rank == 0,
    )
    tensorboard = TensorBoardLog(cfg, enabled=rank == 0)

    def save(step: int) -> Path:
        trainer_state = {
            "args": json.loads(json.dumps(asdict(cfg), default=str)),
            "data": stream.state_dict(),
            "losses": history,
            "val_losses": val_history,
            "expert_imbalance": imbalances if moe or router else None,
            "aux_losses": aux_losses if router else None,
            "skipped_steps": guard.skipped,
        }
        return ckpt.save_checkpoint(
            cfg.out,
            step=step,
            model_parts=parts,
            optimizers=optimizers,
            trainer_state=trainer_state,
            export_hf=export_hf,
        )

    def run_batch(input_ids: torch.Tensor, labels: torch.Tensor, *, train: bool) -> torch.Tensor:
        """One global batch through this rank's parts: its dp rows, CP shards and pipeline microbatches; forward and
        backward (`train`) or forward only (validation, under no_grad). Returns this rank's share of the loss."""
        rows = slice(dp_rank * cfg.local_batch, (dp_rank + 1) * cfg.local_batch)
        input_ids, labels = input_ids[rows].to(device), labels[rows].to(device)
        if schedule is None:
            return _forward_backward(
                parts[0], pipeline_loss, input_ids, labels, cfg=cfg, mesh=mesh, backward=train,
                router=router if train else None,  # validation: the held-out cross-entropy alone
            )  # fmt: skip
        losses: list[torch.Tensor] = []
        step_ctx: Any = contextlib.nullcontext
        first_inputs: dict[str, torch.Tensor] = {"input_ids": input_ids}
        if cfg.cp > 1:  # every rank shards (the first stage needs the inputs, the last the targets)
            step_ctx, first_inputs, labels = shard_pipeline_batch_for_cp(
                parts[0], input_ids, labels, mesh=mesh, microbatch_size=cfg.microbatch_size
            )
        run = schedule.step if train else schedule.eval  # eval: the same schedule, forward only
        with step_ctx():  # ring p2p (cp group) inside the schedule's p2p (pp group): see parallel.py
            if has_first:
                run(first_inputs.pop("input_ids"), target=labels, losses=losses, **first_inputs)
            else:
                run(target=labels, losses=losses)
        if train:
            sync_tied_embedding_grads(parts)
        return torch.stack(losses).sum().detach().float() if losses else torch.zeros((), device=device)

    # 5. Steps.
    started = time.perf_counter()
    last_ckpt = None
    for step in range(start_step + 1, cfg.steps + 1):
        _maybe_inject_fault(step, rank)
        input_ids, labels = stream.next_batch()
        loss_fn.denominator = float((labels != -100).sum())
        local = run_batch(input_ids, labels, train=True)
        aux_loss = None
        if router is not None and router.last_aux_share is not None:  # one all-reduce for both shares
            both = torch.stack([local, router.last_aux_share.to(local)])
            dist.all_reduce(both)
            local, aux_loss = both[0], float(both[1])
        else:
            dist.all_reduce(local)  # the sum of every rank's share is the global token mean
        grad_norm = clip_grad_norm(parts, max_norm=cfg.grad_clip, pp_group=pp_group)
        lr = lr_at(step, cfg)
        # The loss is all-reduced and the norm is global, so every rank takes the same decision here (no rank is
        # left waiting in a collective); RunStopped when the value is not finite and no skip is left.
        apply = guard.check(step, loss=float(local), grad_norm=float(grad_norm))
        set_lr(optimizers, lr)
        for optimizer in optimizers:
            if apply:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if apply:
            history.append((step, float(local), float(grad_norm)))
            if aux_loss is not None:
                aux_losses.append(aux_loss)
        elif rank == 0:
            print(
                f"warning: {guard.last_problem}; update skipped ({len(guard.skipped)} of --skip-nonfinite-steps "
                f"{cfg.skip_nonfinite_steps})",
                file=sys.stderr,
                flush=True,
            )
        imbalance = None
        if moe:  # before any validation forward, which the counters would see too
            imbalance = step_expert_imbalance(
                parts, data_group=dp_cp_mesh.get_group(), pp_group=pp_group, device=device
            )
            imbalances.append(imbalance)
        elif router is not None:  # counted in the step's forwards, over the global batch
            imbalance = router.last_imbalance if router.last_imbalance is not None else math.nan
            imbalances.append(imbalance)
        val_loss = None
        if val_batches and (step % cfg.val_every == 0 or step == cfg.steps):
            val_loss = evaluate(val_batches, run_batch=run_batch, loss_fn=loss_fn, model_parts=parts)
            val_history.append((step, val_loss))
            if moe:
                reset_expert_counts(parts)  # the next step's load counts training tokens only
        progress.update(
            step=step,
            loss=float(local),
            lr=lr,
            val_loss=val_loss,
            expert_imbalance=imbalance,
            aux_loss=aux_loss,
            skipped=len(guard.skipped) if cfg.skip_nonfinite_steps else None,
        )
        tensorboard.scalars(
            step,
            {"train/loss": float(local), "train/lr": lr, "train/grad_norm": float(grad_norm)}
            | {"train/tokens_per_s": progress.tokens_per_second()}
            | ({"train/expert_imbalance": imbalance} if imbalance is not None else {})
            | ({"train/aux_loss": aux_loss} if aux_loss is not None else {})
            | ({"val/loss": val_loss} if val_loss is not None else {}),
        )
        if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps:
            last_ckpt = save(step)
    progress.close()
    tensorboard.close()
    wall = time.perf_counter() - started

    # 6. Report.
    summary: dict[str, Any] = {}
    if rank == 0:
        steps_run = cfg.steps - start_step
        summary = {
            "model": spec.family,
            "mesh": {"pp": cfg.pp, "dp": cfg.dp, "cp": cfg.cp, "ep": cfg.ep},
            "layout": run_layout(cfg, plan, num_layers=num_layers, cp_layout=cp_layout),
            "schedule": cfg.schedule if cfg.pp > 1 else None,
            "dtype": cfg.dtype,
            "precision": {  # what --dtype meant: parameters / grads / AdamW state, forward-backward, FSDP2 reduction
                key: str(getattr(precision, key)).removeprefix("torch.") for key in ("storage", "compute", "reduce")
            },
            "steps": cfg.steps,
            "resumed_from": start_step or None,
            "losses": [loss for _, loss, _ in history],
            "grad_norms": [norm for _, _, norm in history],
            "expert_imbalance": imbalances if moe or router else None,
            # router models (pp = 1): the load-balancing loss per applied step, unscaled (as transformers' aux_loss);
            # `losses` include router_aux_loss_coef x it when the model's config adds it (`aux_loss_coef`)
            "aux_losses": aux_losses if router else None,
            "final_aux_loss": aux_losses[-1] if router and aux_losses else None,
            "aux_loss_coef": router.coef if router else None,
            "first_loss": history[0][1] if history else None,
            "final_loss": history[-1][1] if history else None,
            "val_losses": [list(entry) for entry in val_history],  # [step, validation loss]
            "final_val_loss": val_history[-1][1] if val_history else None,
            # steps whose update was dropped for a non-finite loss or gradient norm (--skip-nonfinite-steps)
            "skipped_steps": guard.skipped,
            "skip_nonfinite_steps": cfg.skip_nonfinite_steps,
            "optimizer": cfg.optimizer,
            "lr_schedule": cfg.lr_schedule,
            "activation_checkpointing": cfg.activation_checkpointing,
            "compile": cfg.compile,
            "attn_implementation": attention,  # "sdpa" where the model supports it, else e.g. "eager"
            "fsdp_groups": grouping if uses_fsdp(dtype=cfg.dtype, dp=cfg.dp, cp=cfg.cp) else None,
            "tensorboard": str(tensorboard.folder) if tensorboard.folder else None,
            "tokens_per_s": steps_run * cfg.global_batch * cfg.seq_len / max(wall, 1e-9),
            "wall_s": wall,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
        }
        cfg.out.mkdir(parents=True, exist_ok=True)
        curve = save_loss_curve(
            [(s, loss) for s, loss, _ in history],
            cfg.out / "loss_curve.png",
            title=f"{spec.family}  pp={cfg.pp} dp={cfg.dp} cp={cfg.cp} ep={cfg.ep}  {cfg.dtype}",
            val_losses=list(val_history),
        )
        summary["loss_curve"] = str(curve) if curve else None
        (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1))
        val_text = f", validation loss {summary['final_val_loss']:.4f}" if val_history else ""
        loss_text = f"loss {history[0][1]:.4f} -> {history[-1][1]:.4f}" if history else "no step applied"
        skip_text = f", {len(guard.skipped)} step(s) skipped (non-finite)" if guard.skipped else ""
        print(
            f"done: {spec.family} pp={cfg.pp} dp={cfg.dp} cp={cfg.cp} ep={cfg.ep} {cfg.dtype}, {cfg.steps} steps, "
            f"{loss_text}{skip_text}{val_text}, "
            f"{summary['tokens_per_s']:,.0f} tokens/s, "
            f"{wall:.1f} s; curve {summary['loss_curve']}, checkpoint {summary['checkpoint']}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    return summary


def run_layout(cfg: RunConfig, plan: Any, *, num_layers: int | None, cp_layout: str | None = None) -> dict[str, Any]:
    """The layout that ran: mesh sizes (`ep`: expert parallelism, carved out of dp x cp), the CP layout
    (`cp_layout`: "contiguous" or "load_balanced", None at cp = 1), and the pipeline plan's stages, placement, layer
    split and microbatches (for pp = 1: one stage holding every layer, microbatches = gradient-accumulation steps)."""
    layout: dict[str, Any] = {"pp": cfg.pp, "dp": cfg.dp, "cp": cfg.cp, "ep": cfg.ep, "cp_layout": cp_layout}
    if plan is not None:
        layout.update({k: v for k, v in plan.layout().items() if k != "pp"})
    else:
        layout.update(
            schedule=None,
            placement=None,
            stages=1,
            stages_per_rank=1,
            layers=num_layers,
            layers_per_stage=[num_layers] if num_layers is not None else None,
            rank_stages=[[0]],
            microbatch_size=cfg.microbatch_size,
            microbatches=cfg.local_batch // cfg.microbatch_size,
        )
    return layout


def _forward_backward(
    model: nn.Module,
    loss_module: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    cfg: RunConfig,
    mesh: Any,
    backward: bool = True,
    router: RouterAuxLoss | None = None,
) -> torch.Tensor:
    """pp = 1: forward and backward (forward only without `backward`: validation) over the microbatches of this
    rank's batch, each CP-sharded when cp > 1 (the ring context describes one microbatch's shard; MTP targets
    computed before sharding go to the loss); returns this rank's share of the global loss (detached).

    With `router` (a transformers MoE model): every microbatch's forward first (graphs kept), then the top-k counts
    summed over the microbatches and the dp x cp ranks, then each microbatch's backward of cross-entropy + coef x its
    aux share (see RouterAuxLoss: the global counts must be known before any backward). NOTE: this holds the
    activations of all of the rank's microbatches at once, as a run with one microbatch per rank does. A model whose
    config leaves the term out (coef 0) runs each backward right after its forward, counting only (imbalance, aux).
    `router.last_aux_share` is then this rank's share of the step's aux (the returned loss includes coef x it)."""
    n_micro = input_ids.shape[0] // cfg.microbatch_size
    total = torch.zeros((), device=input_ids.device)
    sync = getattr(model, "set_requires_gradient_sync", None)
    pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # router: (ring context, CE loss, router prob sums)
    counts: torch.Tensor | None = None
    deferred = router is not None and router.coef != 0.0  # the aux term is in the objective: backward after counts
    for i in range(n_micro):
        rows = slice(i * cfg.microbatch_size, (i + 1) * cfg.microbatch_size)
        batch: dict[str, torch.Tensor] = {"input_ids": input_ids[rows], "labels": labels[rows]}
        ctx: Any = contextlib.nullcontext
        mtp_targets = None
        if cfg.cp > 1:
            ctx, batch = shard_batch_for_cp(model, batch, mesh=mesh)
            mb_labels, mtp_targets = split_cp_targets(batch)
        else:
            mb_labels = batch.pop("labels")
        if callable(sync) and backward and not deferred:
            sync(i == n_micro - 1)  # FSDP2: reduce gradients once, after the last microbatch
        with ctx():
            output = model(**batch, **({"output_router_logits": True} if router is not None else {}))
            # The pipeline's loss module, as at pp > 1: a model that owns its training loss (Nemotron-H: next-token
            # + scaled MTP, its `combined_loss` hook) computes it there with our loss_fn.
            loss = loss_module(output, mb_labels, **({"mtp_per_depth_targets": mtp_targets} if mtp_targets else {}))
            if router is not None:
                mb_counts, prob_sum = router.layer_stats(output.router_logits)
                counts = mb_counts if counts is None else counts + mb_counts
                pending.append((ctx, loss, prob_sum if deferred else prob_sum.detach()))
            if backward and not deferred:
                loss.backward()
        total += loss.detach().float()
    if router is None or counts is None:
        return total
    global_counts = router.reduce(counts)  # collective over dp x cp, after every microbatch's forward
    aux_share = torch.zeros((), device=input_ids.device)
    for i, (ctx, loss, prob_sum) in enumerate(pending):
        share = router.share(global_counts, prob_sum)
        aux_share += share.detach().float()
        if backward and deferred:
            if callable(sync):
                sync(i == n_micro - 1)
            with ctx():  # the ring context again: CP attention's backward runs in it, as its forward did
                (loss + router.coef * share).backward()
    router.last_aux_share = aux_share
    return total + router.coef * aux_share


def main(argv: list[str] | None = None) -> int:
    """CLI entry: run the job; bad input -> exit 2 on every rank with one message (printed by rank 0)."""
    from trainer.config import parse_args

    cfg = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        run(cfg)
    except BadInput as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except RunStopped as exc:  # raised on every rank at the same point: each one says so and exits
        print(f"[rank {rank}] error: {exc}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return EXIT_RUN_STOPPED
    return 0


__all__ = ["BadInput", "TokenSumLoss", "clip_grad_norm", "lr_at", "main", "run", "validate"]
