"""The pieces of a training step the loop composes: the loss over label tokens and gradient clipping by the global
norm.

What it is for: `TokenSumLoss` (fp32 cross-entropy sum over the global batch's label tokens), `RouterAuxLoss` (the
router load-balancing loss of a transformers MoE model over the global batch, and its expert imbalance),
`clip_grad_norm` (one norm over every pipeline stage, FSDP2 shard and expert mesh; a tied embedding's output copy
counted once). The HF-format export is trainer/export.py's (streamed: no rank holds the whole model).
What it must not do: decide the layout (parallel.py) or run the loop (loop.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.plan import RouterAuxPlan


class TokenSumLoss:
    """`(logits [B, S, V], labels [B, S]) -> scalar`: fp32 cross-entropy SUM over non-ignored labels divided by
    `denominator` (the label-token count of the whole global batch, set before each step).

    `vocab_mesh` (the tp mesh, `--loss-parallel`): the logits are this tp rank's vocabulary shard `[B, S, V/tp]`
    (a `colwise` head) and the sum is am-tensor-parallel's `vocab_parallel_cross_entropy` (the same value on every
    tp rank; the full logits are never gathered)."""

    def __init__(self, *, vocab_mesh: Any = None) -> None:
        self.denominator = 1.0
        self.vocab_mesh = vocab_mesh

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.vocab_mesh is not None:
            from am_tensor_parallel import vocab_parallel_cross_entropy

            total = vocab_parallel_cross_entropy(logits, labels, mesh=self.vocab_mesh, reduction="sum")
            return total / self.denominator
        total = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return total / self.denominator


# ------------------------------------------------------------------------------------------------------------------
# The router load-balancing loss of transformers MoE models (Mixtral, Qwen2-MoE, OLMoE, ...)
# ------------------------------------------------------------------------------------------------------------------


def _declares_router_loss(model: nn.Module) -> bool:
    """The model reports router logits: its config has `router_aux_loss_coef`, its forward `output_router_logits`."""
    import inspect

    coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", None)
    return coef is not None and "output_router_logits" in inspect.signature(model.forward).parameters


def _same_code(a: Any, b: Any) -> bool:
    """Two functions with the same bytecode, names and constants (their docstrings aside)."""
    ca, cb = a.__code__, b.__code__
    return (ca.co_code, ca.co_names, ca.co_varnames, ca.co_consts[1:]) == (
        cb.co_code, cb.co_names, cb.co_varnames, cb.co_consts[1:]
    )  # fmt: skip


def _reproducible(model: nn.Module) -> bool:
    """The model's modeling module computes its aux with transformers' Switch-Transformer `load_balancing_loss_func`
    (the very code of Mixtral's, which `RouterAuxLoss` reproduces), called with the model's own `num_experts` and
    `num_experts_per_tok`. Structural, not a list of architectures: Qwen2-MoE, OLMoE, Qwen3-MoE, PhiMoE, GPT-OSS,
    Jamba, ... qualify; a model with another rule (e.g. Doge) does not."""
    import sys

    from transformers.models.mixtral import modeling_mixtral

    theirs = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    has_sizes = bool(getattr(model, "num_experts", None)) and bool(getattr(model, "num_experts_per_tok", None))
    return callable(theirs) and has_sizes and _same_code(theirs, modeling_mixtral.load_balancing_loss_func)


def router_aux_spec(model: nn.Module) -> tuple[int, int, float, bool] | None:
    """`(num_experts, top_k, coef, in_objective)` of a transformers MoE model whose router loss `RouterAuxLoss`
    reproduces (see `_reproducible`); None for any other model (`router_aux_problems` names the ones that train
    with a router loss this trainer cannot reproduce).

    `in_objective`: the model's own training loss adds `coef x aux` (transformers does so exactly when
    `config.output_router_logits` is true); otherwise the router logits serve the expert-imbalance statistics only.
    """
    if not _declares_router_loss(model) or not _reproducible(model):
        return None
    config: Any = model.config
    return (
        int(model.num_experts),  # type: ignore[arg-type]
        int(model.num_experts_per_tok),  # type: ignore[arg-type]
        float(config.router_aux_loss_coef),
        bool(getattr(config, "output_router_logits", False)),
    )


def router_aux_problems(model: nn.Module) -> list[str]:
    """A model whose training objective includes a router loss that `RouterAuxLoss` does not reproduce: refused
    (in validation, before any process group) rather than trained on cross-entropy alone."""
    config = getattr(model, "config", None)
    if not _declares_router_loss(model) or not getattr(config, "output_router_logits", False):
        return []
    if _reproducible(model):
        return []
    return [
        f"{type(model).__name__} trains with a router auxiliary loss (config output_router_logits=true, "
        f"router_aux_loss_coef={config.router_aux_loss_coef}) that is not transformers' Switch-Transformer "  # type: ignore[union-attr]
        "load_balancing_loss_func with the model's num_experts / num_experts_per_tok, which this trainer reproduces "
        'over the global batch; set "output_router_logits": false in the config.json of --model-path to train on '
        "cross-entropy alone"
    ]


class RouterAuxLoss:
    """The router load-balancing loss exactly as transformers' `load_balancing_loss_func` computes it (Switch
    Transformer eqs. 4-6, no attention mask), but over the GLOBAL batch of every dp x cp rank and microbatch.

    transformers' value, over MoE layers l and rows t (tokens) of one forward, E experts, top-k routing:
        C_e = sum_{l,t} [e in topk(softmax(logits_lt))]   P_e = sum_{l,t} softmax(logits_lt)_e   R = sum_l rows_l
        aux = E x sum_e (C_e / R) x (P_e / R)
    It is NOT a sum over tokens (a product of two sums), so the mean of per-rank or per-microbatch values is not the
    global value. The exact rule used here: the integer counts C and the rows R are summed over every microbatch and
    rank first (`reduce`, one all-reduce of [L, E + 1] over the data group); each microbatch then contributes
    `share = E x sum_e C_e x P_e(local) / R^2`. The shares sum (over microbatches and ranks) to aux, and since C is
    piecewise constant their gradients sum to aux's gradient, so FSDP2's gradient sum reproduces the single-process
    `model(input_ids, labels, output_router_logits=True).loss` exactly (cross-entropy + coef x aux).

    `coef` is the weight in the objective: the model's `router_aux_loss_coef`, 0 when its config does not add the
    term (`output_router_logits` false); the statistics and the imbalance are computed either way.
    """

    def __init__(self, *, num_experts: int, top_k: int, coef: float, group: Any = None) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.coef = coef
        self.group = group
        self.last_aux_share: torch.Tensor | None = None  # this rank's share of the last step's aux (sums to aux)
        self.last_imbalance: float | None = None  # the last step's worst layer max / mean tokens per expert

    @classmethod
    def from_plan(cls, plan: RouterAuxPlan, *, group: Any = None) -> RouterAuxLoss:
        """The loss the run plan's `router_aux` describes, reduced over `group` (dp x cp)."""
        return cls(num_experts=plan.num_experts, top_k=plan.top_k, coef=plan.coef, group=group)

    @classmethod
    def for_model(cls, model: nn.Module, *, group: Any = None) -> RouterAuxLoss | None:
        spec = router_aux_spec(model)
        if spec is None:
            return None
        experts, top_k, coef, in_objective = spec
        return cls(num_experts=experts, top_k=top_k, coef=coef if in_objective else 0.0, group=group)

    def layer_stats(self, router_logits: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """One microbatch's statistics: (counts float64 [L, E + 1]: top-k assignments per expert and, last, the rows;
        no grad) and the router probabilities summed over layers and rows (fp32 [E], differentiable).
        router_logits: one [rows, E] tensor per MoE layer (the model's `output_router_logits=True` output)."""
        rows = []
        probs = torch.zeros(self.num_experts, dtype=torch.float32, device=router_logits[0].device)
        for logits in router_logits:
            weights = F.softmax(logits, dim=-1)  # transformers' order: softmax in the logits' dtype, then fp32 sums
            selected = torch.topk(weights.detach(), self.top_k, dim=-1).indices
            counts = torch.bincount(selected.reshape(-1), minlength=self.num_experts).to(torch.float64)
            rows.append(torch.cat([counts, counts.new_tensor([weights.shape[0]])]))
            probs = probs + weights.float().sum(dim=0)
        return torch.stack(rows), probs

    def reduce(self, counts: torch.Tensor) -> torch.Tensor:
        """Sum [L, E + 1] counts over the data group (collective on every rank of it; integers in float64: exact)."""
        if self.group is not None and dist.get_world_size(self.group) > 1:
            counts = counts.clone()
            dist.all_reduce(counts, group=self.group)
        self.last_imbalance = self.imbalance(counts)
        return counts

    def share(self, global_counts: torch.Tensor, prob_sum: torch.Tensor) -> torch.Tensor:
        """This microbatch's share of aux (differentiable through `prob_sum`; see the class docstring)."""
        assigned = global_counts[:, : self.num_experts].sum(dim=0).to(prob_sum.dtype)
        total_rows = float(global_counts[:, self.num_experts].sum())
        return self.num_experts * (assigned * prob_sum).sum() / (total_rows * total_rows)

    def imbalance(self, global_counts: torch.Tensor) -> float:
        """The worst layer's (tokens of its busiest expert) / (mean tokens per expert); NaN if no token was routed."""
        assigned = global_counts[:, : self.num_experts]
        mean = assigned.sum(dim=1) / self.num_experts
        seen = mean > 0
        if not bool(seen.any()):
            return math.nan
        return float((assigned.max(dim=1).values[seen] / mean[seen]).max())


# ------------------------------------------------------------------------------------------------------------------
# Gradient clipping over pipeline stages and FSDP2 shards
# ------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def clip_grad_norm(parts: list[nn.Module], *, max_norm: float, pp_group: Any, tp_group: Any = None) -> torch.Tensor:
    """Clip all gradients of this rank's parts by the GLOBAL norm (all stages, all shards); returns that norm.

    The output copy of a tied embedding (a pipeline duplicate holding the same summed gradient) is left out of the
    norm, so the norm equals the unsplit model's; it is still scaled like every other gradient. Under TP
    (`tp_group`), DTensor shards count through their mesh, parameters TP leaves whole once (their gradients are the
    same on every tp rank), and plain-tensor TP shards (trainer/tensor_parallel.py) are summed over tp.
    """
    from torch.distributed.tensor import DTensor

    from am_pipelining.tied import tied_embedding_copies
    from trainer.tensor_parallel import tp_local_parameters

    duplicates = {
        id(dict(model.named_parameters())[copy.param_name])
        for model, copy in tied_embedding_copies(parts)
        if copy.role == "output"
    }
    # Under EP the experts' gradients are DTensors on (expert_dp, ep) and the others on dp_cp; DTensor ops do not mix
    # meshes, so norms and scaling run per mesh, in parameter order (shared by every rank of a stage, so the
    # full_tensor collectives line up).
    tp_local = tp_local_parameters(parts) if tp_group is not None else set()
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for part in parts:
        for p in part.parameters():
            if p.grad is not None:
                mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
                by_mesh.setdefault((mesh, id(p) in tp_local), []).append(p)
    norms = []
    for (_, local), params in by_mesh.items():
        grads = [p.grad for p in params if id(p) not in duplicates and p.grad is not None]
        if grads:
            mesh_norm = torch.nn.utils.get_total_norm(grads, 2.0)
            mesh_norm = (mesh_norm.full_tensor() if isinstance(mesh_norm, DTensor) else mesh_norm).float()
            if local:  # this tp rank's shard of a plain-tensor TP parameter: the squares add up over tp
                squared = mesh_norm**2
                dist.all_reduce(squared, group=tp_group)
                mesh_norm = squared.sqrt()
            norms.append(mesh_norm)
    norm = norms[0] if norms else torch.zeros(())  # one mesh: exactly the norm computed without EP
    if len(norms) > 1:
        norm = torch.stack(norms).square().sum().sqrt()
    if dist.get_world_size(pp_group) > 1:
        squared = norm**2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


__all__ = [
    "RouterAuxLoss",
    "TokenSumLoss",
    "clip_grad_norm",
    "router_aux_problems",
    "router_aux_spec",
]
