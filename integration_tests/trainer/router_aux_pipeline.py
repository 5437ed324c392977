"""The router load-balancing loss of transformers MoE models under pipeline parallelism (issue 22, item 2).

What it is for: at pp > 1 each stage holds only its own layers, and transformers' `load_balancing_loss_func` is a
product over ALL layers and the whole batch, `aux = E x sum_e (C_e / R) x (P_e / R)` (C: top-k counts, P: summed
router probabilities, R: routed rows, each summed over every layer and token; see step_parts.RouterAuxLoss). Its
gradient reaches a layer's router probabilities as `E x C_e / R^2` per row, so every stage needs the GLOBAL counts C
and rows R (all layers of every stage, all microbatches, all dp x cp ranks) before any backward, which a pipeline
schedule (1F1B: a stage's first backward runs before the last microbatch's forward) does not provide. Hence:
    1. counting pass (only when the term is in the objective): the step's global batch forward-only through the
       same schedule (`schedule.eval`, no grad, the RNG state restored afterwards), each stage's router hooks adding
       the top-k counts and rows of its layers; one all-reduce over every rank gives C and R, and the worst layer's
       imbalance (per-layer rows of a [num_layers, E + 1] table: each layer lives in one stage)
    2. the training step: each router call computes its share `E x sum_e C_e x P_e(local) / R^2` (differentiable in
       its probabilities) and its decoder layer's output carries it into backward (an identity whose backward also
       gives the share the gradient `coef`: am_moe.RouterBalancer's idea). The shares of every call on every rank
       sum to aux, and their gradients to aux's, so the step equals the single process's CE + coef x aux.
Cost: one extra forward of the global batch per step. A model whose config leaves the term out (coef 0) runs no
counting pass: its training forward's counts and probabilities give the expert imbalance and aux for the record.
What it must not do: decide whether a model qualifies (step_parts.router_aux_spec and validation do), or count a
forward twice (a validation pass, or an activation-checkpoint recomputation inside backward, is not counted).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.step_parts import RouterAuxLoss

_LAYER = re.compile(r"^(.*?\blayers\.(\d+))\.")


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """`(name, module, output index of the router logits)` of every router of a transformers MoE model, found as
    transformers itself records them (`_can_record_outputs["router_logits"]`, an `OutputRecorder` naming the router
    class and the index of the logits in its output); [] for a model that declares none."""
    recorder = getattr(type(model), "_can_record_outputs", {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    if target is None:
        return []
    index = int(getattr(recorder, "index", 0))
    return [(name, module, index) for name, module in model.named_modules() if type(module) is target]


class _CarryShare(torch.autograd.Function):
    """Identity on a decoder layer's output; its backward also gives the layer's aux shares the gradient `coef`."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, share: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef = coef
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad_output, torch.full((), ctx.coef, dtype=torch.float32, device=grad_output.device), None


def _in_backward() -> bool:
    """Inside autograd's backward (an activation-checkpoint recomputation): not a forward of its own."""
    return torch._C._current_graph_task_id() != -1


class PipelineRouterAux:
    """Hooks on this rank's stage modules (see the module docstring). `router`: the run's `RouterAuxLoss` (its
    `last_aux_share` and `last_imbalance` are set after each step, as at pp 1); `num_layers`: the model's decoder
    layers (the rows of the count table).

    Raises:
        ValueError: a router outside a `layers.<i>` container (its layer cannot be named).
    """

    def __init__(self, parts: list[nn.Module], router: RouterAuxLoss, *, num_layers: int, device: torch.device):
        self.router = router
        self.mode: str | None = None  # None: not counted (validation), "count": counting pass, "train": the step
        self.counts = torch.zeros(num_layers, router.num_experts + 1, dtype=torch.float64, device=device)
        self.totals: torch.Tensor | None = None  # [1, E + 1]: the step's global counts and rows, all layers
        self.pending: dict[int, list[torch.Tensor]] = {}  # decoder layer (id) -> shares of its router calls
        self.aux_share = torch.zeros((), device=device)
        self.prob_sum = torch.zeros(router.num_experts, device=device)  # this rank's, over the step's router calls
        self._handles = []
        for part in parts:
            for name, module, index in router_modules(part):
                found = _LAYER.match(name)
                if found is None:
                    raise ValueError(f"router {name!r} is not inside a decoder layer `layers.<i>`: cannot place it")
                layer = part.get_submodule(found.group(1))
                self._handles.append(module.register_forward_hook(self._router_hook(int(found.group(2)), index, layer)))
                self._handles.append(layer.register_forward_hook(self._layer_hook))

    @property
    def counts_first(self) -> bool:
        """Whether a step needs the counting pass (the term is in the objective: its gradient needs C and R)."""
        return self.router.coef != 0.0

    def _router_hook(self, layer_index: int, index: int, layer: nn.Module) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.mode is None:
                return
            logits = output[index] if isinstance(output, tuple | list) else output
            # An activation-checkpoint recomputation (inside backward) runs the same ops, so that it saves the same
            # tensors as the forward did, but counts nothing.
            counted = not _in_backward()
            counts, prob_sum = self.router.layer_stats((logits.reshape(-1, logits.shape[-1]),))
            if counted:
                self.counts[layer_index] += counts[0]
            if self.mode == "train" and counted:
                self.prob_sum += prob_sum.detach()
            if self.mode == "train" and self.counts_first:
                assert self.totals is not None
                share = self.router.share(self.totals, prob_sum)
                if counted:  # (a recomputation's share has no consumer: the forward's share carries the gradient)
                    self.aux_share += share.detach().float()
                    self.pending.setdefault(id(layer), []).append(share)

        return hook

    def _layer_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        shares = self.pending.pop(id(module), None)
        if not shares:
            return None
        share = torch.stack(shares).sum()
        if isinstance(output, torch.Tensor):
            return _CarryShare.apply(output, share, self.router.coef)
        first = _CarryShare.apply(output[0], share, self.router.coef)
        return (first, *output[1:]) if isinstance(output, tuple) else [first, *output[1:]]

    def _reduce(self) -> torch.Tensor:
        """The count table summed over every rank (each stage's layers, each data rank's tokens); resets it."""
        table = self.counts.clone()
        dist.all_reduce(table)
        self.counts.zero_()
        self.router.last_imbalance = self.router.imbalance(table)
        return table

    def count(self, forward_only: Callable[[], Any], *, device: torch.device) -> None:
        """Step 1: run `forward_only` (the schedule's eval of this step's batch) counting, then the global C, R."""
        self.mode = "count"
        devices = [device] if device.type == "cuda" else []
        try:  # the training forward must see the same dropout masks, if any: the RNG is restored
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                forward_only()
        finally:
            self.mode = None
        self.totals = self._reduce().sum(dim=0, keepdim=True)

    def train_step(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Step 2: run `step` (the schedule's training step, returning this rank's CE share) with the shares
        injected; returns the loss share incl. coef x this rank's aux share, and sets `router.last_aux_share`."""
        self.mode = "train"
        self.aux_share = torch.zeros_like(self.aux_share)
        self.prob_sum = torch.zeros_like(self.prob_sum)
        try:
            loss = step()
        finally:
            self.mode = None
            self.pending.clear()
        if self.counts_first:
            self.counts.zero_()  # the counting pass counted the same routing
            self.router.last_aux_share = self.aux_share
            return loss + self.router.coef * self.aux_share.to(loss)
        # coef 0 (not in the objective): the imbalance and aux, for the record, from the training forward's counts
        totals = self._reduce().sum(dim=0, keepdim=True)
        self.router.last_aux_share = self.router.share(totals, self.prob_sum).detach().float()
        return loss


__all__ = ["PipelineRouterAux", "router_modules"]
