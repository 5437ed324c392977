"""One global batch through this rank's model parts: its dp rows, its CP shards, its microbatches, the pipeline.

What it is for: `BatchStep` (the loop's `run_batch`, also the evaluation's forward-only pass) runs one global batch
on this rank as the run plan lays it out: pp 1 through `forward_backward` (gradient accumulation over the
microbatches, each CP-sharded when cp > 1, the router's auxiliary loss over the global batch), pp > 1 through the
pipeline schedule (the batch CP-sharded first, the ring context around the whole schedule step: see parallel.py).
It returns this rank's share of the global loss; the loop sums the shares over every rank.
What it must not do: decide the layout (it reads the plan), all-reduce the loss, or touch the optimizer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.parallel import shard_batch_for_cp, shard_pipeline_batch_for_cp, split_cp_targets
from trainer.plan import RunPlan
from trainer.step_parts import RouterAuxLoss


@dataclass
class BatchStep:
    """`run_batch(input_ids [G, S], labels [G, S], *, train) -> this rank's loss share (fp32 scalar, detached)`.

    `parts`: this rank's model parts (pipeline stage modules, or the whole model at pp 1); `schedule`: the pipeline
    schedule (None at pp 1); `loss_module`: the loss every last stage (or the pp 1 model) calls; `router`: the router
    auxiliary loss (pp 1 only, training only); `has_first`: this rank holds the first stage (it feeds the inputs)."""

    plan: RunPlan
    parts: list[nn.Module]
    schedule: Any
    loss_module: Any
    mesh: Any
    device: torch.device
    dp_rank: int
    router: RouterAuxLoss | None
    has_first: bool
    counts_loss: bool = True  # False on tp ranks > 0: every tp rank computes the same loss, counted once
    # pp > 1 with a transformers MoE model's router loss: trainer/router_aux_pipeline.py's PipelineRouterAux
    pipeline_router: Any = None

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, *, train: bool) -> torch.Tensor:
        """One global batch forward and backward (`train`) or forward only (validation, under no_grad)."""
        share = self._run(input_ids, labels, train=train)
        if self.counts_loss:
            return share
        if self.router is not None and self.router.last_aux_share is not None:  # the same aux on every tp rank
            self.router.last_aux_share = torch.zeros_like(self.router.last_aux_share)
        return torch.zeros_like(share)

    def _run(self, input_ids: torch.Tensor, labels: torch.Tensor, *, train: bool) -> torch.Tensor:
        plan = self.plan
        rows = slice(self.dp_rank * plan.local_batch, (self.dp_rank + 1) * plan.local_batch)
        input_ids, labels = input_ids[rows].to(self.device), labels[rows].to(self.device)
        if not plan.is_pipeline:
            return forward_backward(
                self.parts[0], self.loss_module, input_ids, labels,
                microbatch_size=plan.microbatch_size, cp_mesh=self.mesh if plan.cp > 1 else None,
                cp_layout=plan.cp_layout, backward=train,
                router=self.router if train else None,  # validation: the held-out cross-entropy alone
                fsdp_hooks=plan.fsdp_optimizations,
            )  # fmt: skip
        router = self.pipeline_router if train else None  # validation: the held-out cross-entropy alone
        if router is None:
            return self._pipeline(input_ids, labels, train=train)
        if router.counts_first:  # the router loss needs the global top-k counts before any backward
            router.count(lambda: self._pipeline(input_ids, labels, train=False), device=self.device)
        return router.train_step(lambda: self._pipeline(input_ids, labels, train=True))

    def _pipeline(self, input_ids: torch.Tensor, labels: torch.Tensor, *, train: bool) -> torch.Tensor:
        """pp > 1: this rank's rows through the schedule (`step`, or `eval`: forward only); its loss share."""
        from am_pipelining import sync_tied_embedding_grads

        plan = self.plan
        losses: list[torch.Tensor] = []
        step_ctx: Any = contextlib.nullcontext
        first_inputs: dict[str, torch.Tensor] = {"input_ids": input_ids}
        if plan.cp > 1:  # every rank shards (the first stage needs the inputs, the last the targets)
            assert plan.cp_layout is not None, "a CP run's plan has a cp_layout"
            step_ctx, first_inputs, labels = shard_pipeline_batch_for_cp(
                self.parts[0],
                input_ids,
                labels,
                mesh=self.mesh,
                microbatch_size=plan.microbatch_size,
                layout=plan.cp_layout,
            )
        run = self.schedule.step if train else self.schedule.eval  # eval: the same schedule, forward only
        with step_ctx():  # ring p2p (cp group) inside the schedule's p2p (pp group): see parallel.py
            if self.has_first:
                run(first_inputs.pop("input_ids"), target=labels, losses=losses, **first_inputs)
            else:
                run(target=labels, losses=losses)
        if train:
            sync_tied_embedding_grads(self.parts)
        return torch.stack(losses).sum().detach().float() if losses else torch.zeros((), device=self.device)


def forward_backward(
    model: nn.Module,
    loss_module: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    microbatch_size: int,
    cp_mesh: Any = None,
    cp_layout: str | None = None,
    backward: bool = True,
    router: RouterAuxLoss | None = None,
    fsdp_hooks: bool = False,
) -> torch.Tensor:
    """pp = 1: forward and backward (forward only without `backward`: validation) over the microbatches of
    `microbatch_size` rows of this rank's batch (input_ids, labels: [B, S]), each CP-sharded over `cp_mesh` (the
    mesh with a "cp" axis; None: no CP; the ring context describes one microbatch's shard; MTP targets computed
    before sharding go to the loss); returns this rank's share of the global loss (detached).

    With `router` (a transformers MoE model): every microbatch's forward first (graphs kept), then the top-k counts
    summed over the microbatches and the dp x cp ranks, then each microbatch's backward of cross-entropy + coef x its
    aux share (see RouterAuxLoss: the global counts must be known before any backward). NOTE: this holds the
    activations of all of the rank's microbatches at once, as a run with one microbatch per rank does. A model whose
    config leaves the term out (coef 0) runs each backward right after its forward, counting only (imbalance, aux).
    `router.last_aux_share` is then this rank's share of the step's aux (the returned loss includes coef x it).

    `fsdp_hooks` (the plan's `fsdp_optimizations`): the model's own hooks drive FSDP2's sync, as upstream's training
    loop calls them: `prepare_for_grad_accumulation` before the first microbatch's backward (no reduce-scatter, no
    resharding), `prepare_for_final_backward` before the last (one reduce-scatter of the accumulated gradients).
    Without it the root's `set_requires_gradient_sync` reduces once, after the last microbatch, as well."""
    n_micro = input_ids.shape[0] // microbatch_size
    total = torch.zeros((), device=input_ids.device)
    set_sync = getattr(model, "set_requires_gradient_sync", None)

    def sync(i: int) -> None:
        """Before microbatch i's backward."""
        if fsdp_hooks:
            if i == 0:
                model.prepare_for_grad_accumulation(pp_enabled=False)  # type: ignore[operator]
            if i == n_micro - 1:
                model.prepare_for_final_backward(pp_enabled=False)  # type: ignore[operator]
        elif callable(set_sync):
            set_sync(i == n_micro - 1)  # FSDP2: reduce gradients once, after the last microbatch

    pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # router: (ring context, CE loss, router prob sums)
    counts: torch.Tensor | None = None
    deferred = router is not None and router.coef != 0.0  # the aux term is in the objective: backward after counts
    for i in range(n_micro):
        rows = slice(i * microbatch_size, (i + 1) * microbatch_size)
        batch: dict[str, torch.Tensor] = {"input_ids": input_ids[rows], "labels": labels[rows]}
        ctx: Any = contextlib.nullcontext
        mtp_targets = None
        if cp_mesh is not None:
            assert cp_layout is not None, "a CP run's plan has a cp_layout"
            ctx, batch = shard_batch_for_cp(model, batch, mesh=cp_mesh, layout=cp_layout)
            mb_labels, mtp_targets = split_cp_targets(batch)
        else:
            mb_labels = batch.pop("labels")
        if backward and not deferred:
            sync(i)
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
            sync(i)
            with ctx():  # the ring context again: CP attention's backward runs in it, as its forward did
                (loss + router.coef * share).backward()
    router.last_aux_share = aux_share
    return total + router.coef * aux_share


__all__ = ["BatchStep", "forward_backward"]
