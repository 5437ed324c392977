"""Expert load balancing for top-k routers: the auxiliary-loss-free bias update and the auxiliary losses.

What it is for:
- `LoadBalancing`: the four knobs (bias update rate, batch-level aux loss, sequence-level aux loss, router z-loss
  coefficients), validated once (negative or non-finite values are refused in one ValueError).
- `switch_aux_loss`, `sequence_aux_loss`, `router_z_loss`: the terms themselves, differentiable in the router's
  probabilities / logits (the expert counts they use carry no gradient, as in Switch and DeepSeek-V3).
- `RouterBalancer`: a parameter-free module a model's MoE block owns. In forward it computes the enabled terms of
  one call and attaches their gradient to the block's output (Megatron's `MoEAuxLossAutoScaler` idea: an identity
  whose backward also sends `scale x coefficient` into the router), so the terms reach the router under pipeline
  parallelism, gradient accumulation and activation checkpointing without the loss function knowing about them.
- `configure_load_balancing`, `set_aux_loss_scale`, `aux_loss_values`, `update_expert_bias`: what a trainer calls.
What it must not do: change the combine weights (the bias changes expert SELECTION only; the model adds it to its
scores before top-k and gathers the weights from the unbiased scores), count padding, or issue a collective except
in `aux_loss_values(group=...)` (the bias update reads an `ExpertLoad` that the caller already summed).

Normalisation: every term is computed as a SUM over the call's real tokens (a per-sequence term is weighted by the
sequence's real-token count), and its gradient is multiplied by the balancer's `aux_loss_scale`. A trainer that
divides its token-summed loss by the step's global token count sets the same number with `set_aux_loss_scale` and
gets, summed over micro-batches and data-parallel ranks, the token-weighted mean of each term over the step: the
same value and router gradient as a single process running the same micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .load import ExpertLoad

__all__ = [
    "AUX_LOSS_TERMS",
    "LoadBalancing",
    "RouterBalancer",
    "aux_loss_values",
    "configure_load_balancing",
    "router_z_loss",
    "sequence_aux_loss",
    "set_aux_loss_scale",
    "switch_aux_loss",
    "update_expert_bias",
]

# The reported names of the three loss terms, in the order `RouterBalancer` keeps their running sums.
AUX_LOSS_TERMS: tuple[str, ...] = ("aux_loss", "seq_aux_loss", "z_loss")


@dataclass(frozen=True, kw_only=True)
class LoadBalancing:
    """How a router is balanced; every value >= 0 and finite, 0 turns the mechanism off.

    Args:
        bias_update_rate: DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step
            `bias += rate * sign(mean_load - load)` per layer from the step's global load (Megatron's
            `moe_router_bias_update_rate`, 1e-3 in Nemotron-H's recipe).
        aux_loss_coeff: batch-level (Switch) auxiliary loss over each micro-batch's tokens on a rank.
        seq_aux_loss_coeff: DeepSeek's sequence-level auxiliary loss (1e-4 in Nemotron-H's recipe).
        z_loss_coeff: router z-loss (ST-MoE): mean of logsumexp(logits)^2.

    Raises:
        ValueError: listing every field that is not a finite number >= 0.
    """

    bias_update_rate: float = 0.0
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                problems.append(f"{f.name}={value!r} must be a number")
            elif not math.isfinite(value) or value < 0:
                problems.append(f"{f.name}={value!r} must be finite and >= 0 (0 turns it off)")
            else:
                object.__setattr__(self, f.name, float(value))
        if problems:
            raise ValueError("LoadBalancing: " + "; ".join(problems))

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(aux_loss_coeff, seq_aux_loss_coeff, z_loss_coeff), in the order of `AUX_LOSS_TERMS`."""
        return (self.aux_loss_coeff, self.seq_aux_loss_coeff, self.z_loss_coeff)

    @property
    def has_loss_terms(self) -> bool:
        return any(c > 0 for c in self.coefficients)


def _mask_and_count(
    top_k_index: torch.Tensor, token_mask: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(real [T] float 0/1, per-token one-hot counts [T, E] float): pairs per expert of every real token."""
    tokens = top_k_index.shape[0]
    real = (
        torch.ones(tokens, device=top_k_index.device)
        if token_mask is None
        else token_mask.to(device=top_k_index.device, dtype=torch.float32)
    )
    hits = torch.zeros(tokens, num_experts, device=top_k_index.device)
    hits.scatter_add_(1, top_k_index.long(), torch.ones(top_k_index.shape, device=top_k_index.device))
    return real, hits * real[:, None]


def switch_aux_loss(
    probs: torch.Tensor, top_k_index: torch.Tensor, *, token_mask: torch.Tensor | None = None, reduction: str = "mean"
) -> torch.Tensor:
    """Batch-level load-balancing loss (Switch Transformer, top-k as Megatron): `E / K * sum_i f_i * P_i` with
    `f_i` = pairs routed to expert i / real tokens, `P_i` = mean router probability of expert i; 1.0 when balanced.

    probs `[T, E]` float (the router's probabilities over all experts; the gradient flows through them),
    top_k_index `[T, K]` int, token_mask `[T]` bool (False = padding, excluded). Returns a 0-d fp32 tensor: the
    loss (`reduction="mean"`) or the loss times the real-token count (`"sum"`, what `RouterBalancer` accumulates).
    transformers' `load_balancing_loss_func` is K times this value (it does not divide by K).
    """
    num_experts, top_k = probs.shape[-1], top_k_index.shape[-1]
    real, hits = _mask_and_count(top_k_index, token_mask, num_experts)
    count = real.sum()
    pairs = hits.sum(0)  # [E], no gradient
    prob_sum = (probs.float() * real[:, None]).sum(0)  # [E]
    total = num_experts / top_k * (pairs * prob_sum).sum() / count.clamp(min=1) ** 2
    if reduction == "mean":
        return total
    _check_reduction(reduction)
    return total * count


def sequence_aux_loss(
    probs: torch.Tensor,
    top_k_index: torch.Tensor,
    *,
    sequence_ids: torch.Tensor,
    num_sequences: int,
    token_mask: torch.Tensor | None = None,
    reduction: str = "mean",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-level balance loss: per sequence s, `sum_i f_si * P_si` with `f_si = E / (K * T_s) *
    pairs_si` and `P_si` the mean over the sequence of the normalized scores; 1.0 when balanced.

    probs `[T, E]` (normalized scores: a sigmoid router passes `scores / scores.sum(-1)`), top_k_index `[T, K]`,
    sequence_ids `[T]` int in `[0, num_sequences)` (the row each token came from), token_mask `[T]` bool.
    `reduction="mean"`: the mean over sequences weighted by their real-token counts (the plain mean when every
    sequence has the same length, as in Megatron); `"sum"`: that weighted sum, `sum_s T_s * L_s`.

    group: the context-parallel group when each rank holds a shard of the same sequences (row s on every rank is
    part of one sequence). The per-sequence counts and probability sums are all-reduced over it (the probability
    sums differentiably), so every rank sees whole sequences; "mean" is then the same on every rank and "sum" is
    this rank's 1/cp share, so summing the ranks' terms (and gradients) counts each sequence once. Collective.
    """
    num_experts, top_k = probs.shape[-1], top_k_index.shape[-1]
    real, hits = _mask_and_count(top_k_index, token_mask, num_experts)
    ids = sequence_ids.long().to(probs.device)
    pairs = probs.new_zeros(num_sequences, num_experts, dtype=torch.float32).index_add(0, ids, hits)
    prob_sum = probs.new_zeros(num_sequences, num_experts, dtype=torch.float32).index_add(
        0, ids, probs.float() * real[:, None]
    )
    lengths = probs.new_zeros(num_sequences, dtype=torch.float32).index_add(0, ids, real)
    share = 1.0
    if group is not None:
        counts = torch.cat([pairs, lengths[:, None]], dim=1)
        dist.all_reduce(counts, group=group)
        pairs, lengths = counts[:, :-1], counts[:, -1]
        prob_sum = _AllReduceSum.apply(prob_sum, group)
        share = 1.0 / dist.get_world_size(group)
    # T_s * L_s = E / K * sum_i pairs_si * prob_sum_si / T_s^2 * T_s
    weighted = num_experts / top_k * (pairs * prob_sum).sum(-1) / lengths.clamp(min=1)
    total = weighted.sum()
    if reduction == "sum":
        return total * share
    _check_reduction(reduction)
    return total / lengths.sum().clamp(min=1)


def router_z_loss(
    logits: torch.Tensor, *, token_mask: torch.Tensor | None = None, reduction: str = "mean"
) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over real tokens of `logsumexp(logits)^2` (fp32). logits `[T, E]`."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    real = torch.ones_like(lse) if token_mask is None else token_mask.to(lse.device, torch.float32)
    total = (lse.square() * real).sum()
    if reduction == "sum":
        return total
    _check_reduction(reduction)
    return total / real.sum().clamp(min=1)


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")


class _AllReduceSum(torch.autograd.Function):
    """Sum over `group` whose backward sums the gradients over `group` too (each rank's input feeds every rank's
    output). torch's own differentiable all_reduce (`torch.distributed.nn`) is deprecated."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on `output`; in backward also gives `aux` the gradient `balancer.aux_loss_scale` (read then, so a
    trainer may set the scale between forward and backward)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, balancer: RouterBalancer) -> torch.Tensor:
        ctx.balancer = balancer
        ctx.aux_shape = aux.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        scale = float(ctx.balancer.aux_loss_scale)
        grad_aux = torch.full(ctx.aux_shape, scale, dtype=torch.float32, device=grad_output.device)
        return grad_output, grad_aux, None


class RouterBalancer(nn.Module):
    """The balancing terms of one MoE layer: owned by the model's MoE block, called once per forward.

    Args:
        bias_name: dotted name, relative to the module that owns this balancer, of the router's `[E]` fp32 bias
            buffer that `update_expert_bias` moves (e.g. "gate.e_score_correction_bias"), or None (no bias).
        experts_name: name of the block's `GroupedExperts`, relative to the same module (its load counters feed
            the bias update).
        balancing: the initial `LoadBalancing` (all off by default; `configure_load_balancing` sets it later).

    `aux_loss_sums` (`[3]` fp32 on the router's device, or None before the first forward with a term; a plain
    attribute, not a buffer, so building on the meta device and loading checkpoints never see it) accumulates the
    coefficient-weighted, token-summed terms of every forward (activation-checkpoint recomputation excluded) until
    `aux_loss_values(..., reset=True)`.
    """

    def __init__(
        self, *, bias_name: str | None, experts_name: str = "experts", balancing: LoadBalancing | None = None
    ) -> None:
        super().__init__()
        self.bias_name = bias_name
        self.experts_name = experts_name
        self.balancing = balancing if balancing is not None else LoadBalancing()
        self.aux_loss_scale = 1.0
        # the context-parallel group when sequences are sharded over ranks (see `configure_load_balancing`)
        self.sequence_group: dist.ProcessGroup | None = None
        self.aux_loss_sums: torch.Tensor | None = None

    @property
    def needs_router_terms(self) -> bool:
        """Whether forward computes anything (a model skips building probabilities / sequence ids otherwise)."""
        return self.balancing.has_loss_terms

    def forward(
        self,
        output: torch.Tensor,
        *,
        probs: torch.Tensor,
        logits: torch.Tensor,
        top_k_index: torch.Tensor,
        sequence_ids: torch.Tensor | None = None,
        num_sequences: int | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return `output` (any shape; the block's output) carrying the gradient of the enabled terms.

        probs `[T, E]` (probabilities, normalized scores for a sigmoid router), logits `[T, E]` (pre-activation,
        for the z-loss), top_k_index `[T, K]`, token_mask `[T]` (False = padding), sequence_ids `[T]` and
        num_sequences (for the sequence-level term; without them every token is treated as one sequence).
        """
        aux_coeff, seq_coeff, z_coeff = self.balancing.coefficients
        if not self.balancing.has_loss_terms:
            return output
        zero = probs.new_zeros((), dtype=torch.float32)
        terms = [zero, zero, zero]
        if aux_coeff > 0:
            terms[0] = switch_aux_loss(probs, top_k_index, token_mask=token_mask, reduction="sum")
        if seq_coeff > 0:
            if sequence_ids is None or num_sequences is None:
                sequence_ids = torch.zeros(top_k_index.shape[0], dtype=torch.long, device=top_k_index.device)
                num_sequences = 1
            terms[1] = sequence_aux_loss(
                probs,
                top_k_index,
                sequence_ids=sequence_ids,
                num_sequences=num_sequences,
                token_mask=token_mask,
                reduction="sum",
                group=self.sequence_group,
            )
        if z_coeff > 0:
            terms[2] = router_z_loss(logits, token_mask=token_mask, reduction="sum")
        weighted = torch.stack([c * t for c, t in zip((aux_coeff, seq_coeff, z_coeff), terms, strict=True)])
        self._record(weighted.detach())
        return _InjectAuxGrad.apply(output, weighted.sum(), self)

    @torch.no_grad()
    def _record(self, weighted: torch.Tensor) -> None:
        # Activation checkpointing re-runs the forward inside backward: count each forward once.
        if torch._C._current_graph_task_id() != -1:
            return
        if self.aux_loss_sums is None:
            self.aux_loss_sums = torch.zeros_like(weighted)
        self.aux_loss_sums.add_(weighted)

    def extra_repr(self) -> str:
        return f"bias_name={self.bias_name!r}, experts_name={self.experts_name!r}, {self.balancing}"


def _balancers(model: nn.Module) -> list[tuple[str, RouterBalancer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, RouterBalancer)]


def configure_load_balancing(
    model: nn.Module, balancing: LoadBalancing, *, sequence_group: dist.ProcessGroup | None = None
) -> int:
    """Set `balancing` on every `RouterBalancer` in `model`; returns how many (0: a dense model).

    sequence_group: under context parallelism, the cp group (each rank holds a shard of the same rows), so the
    sequence-level term sees whole sequences (`sequence_aux_loss(group=)`); None otherwise.

    A trainer calls it once after building the model (with the model's recipe, e.g.
    `NemotronHForCausalLM.moe_load_balancing`, or its flags), on every pipeline stage's model part.

    Raises:
        ValueError: balancing asked for (any value > 0) on a model without a `RouterBalancer` (a dense model, or a
            pipeline stage without MoE layers: pass `LoadBalancing()` there), or a bias update for routers that
            have no selection bias.
    """
    if not isinstance(balancing, LoadBalancing):
        raise TypeError(f"balancing must be a LoadBalancing, got {type(balancing).__name__}")
    found = _balancers(model)
    enabled = balancing.bias_update_rate > 0 or balancing.has_loss_terms
    if enabled and not found:
        raise ValueError(
            f"configure_load_balancing: {type(model).__name__} has no MoE router to balance (no RouterBalancer), "
            f"but {balancing} asks for balancing; pass LoadBalancing() (all 0) for a dense model"
        )
    no_bias = [name for name, b in found if b.bias_name is None]
    if balancing.bias_update_rate > 0 and no_bias:
        raise ValueError(
            f"configure_load_balancing: bias_update_rate={balancing.bias_update_rate} needs a router selection bias, "
            f"which these routers do not have: {no_bias}; set bias_update_rate=0 (use the aux losses instead)"
        )
    for _, balancer in found:
        balancer.balancing = balancing
        balancer.sequence_group = sequence_group
    return len(found)


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The factor every aux term's gradient is multiplied by: the trainer's loss normalisation (e.g. 1 / the step's
    global real-token count when the main loss is a token sum divided by it). Read at backward time."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"aux loss scale={scale!r} must be a finite number >= 0")
    for _, balancer in _balancers(model):
        balancer.aux_loss_scale = float(scale)


def aux_loss_values(
    model: nn.Module, *, group: dist.ProcessGroup | None = None, normalizer: float = 1.0, reset: bool = False
) -> dict[str, float]:
    """The step's coefficient-weighted aux terms summed over every layer of `model` (and over `group` when given,
    a collective then), divided by `normalizer` (the same number the loss is divided by): `{name: value}` for
    `AUX_LOSS_TERMS`. One concatenation, at most one all-reduce and one device-to-host copy."""
    found = _balancers(model)
    recorded = [b.aux_loss_sums for _, b in found if b.aux_loss_sums is not None]
    # a rank whose layers saw no term yet still joins the all-reduce (with zeros on the others' device type)
    sums = torch.stack(recorded).sum(0) if recorded else torch.zeros(len(AUX_LOSS_TERMS), device=_device(model))
    if group is not None:
        dist.all_reduce(sums, group=group)
    host = (sums.double().cpu() / normalizer).tolist()
    if reset:
        with torch.no_grad():
            for tensor in recorded:
                tensor.zero_()
    return dict(zip(AUX_LOSS_TERMS, host, strict=True))


def _device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


@torch.no_grad()
def update_expert_bias(model: nn.Module, load: ExpertLoad) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's auxiliary-loss-free step: for every `RouterBalancer` with `bias_update_rate > 0`,
    `bias += rate * sign(mean(load) - load)` (fp32, in place) from its layer's counts in `load`.

    `load` must be the step's GLOBAL load: `expert_load(model, group=<dp x cp group, ep included>, reset=True)`
    called after the optimizer step (counts of every micro-batch, padding excluded). Under pipeline parallelism
    call it with each stage's model part (a layer lives in one stage). Every rank then applies the same update.
    Returns the applied deltas `{bias name: [E] fp32}`.

    Raises:
        KeyError: a balancer's experts have no entry in `load` (it was read from another module).
    """
    deltas: dict[str, torch.Tensor] = {}
    for name, balancer in _balancers(model):
        rate = balancer.balancing.bias_update_rate
        if rate == 0 or balancer.bias_name is None:
            continue
        owner_name = name.rpartition(".")[0]
        owner = model.get_submodule(owner_name)
        prefix = f"{owner_name}." if owner_name else ""
        key = prefix + balancer.experts_name
        if key not in load.tokens_per_expert:
            raise KeyError(
                f"update_expert_bias: no load for {key!r} (have {sorted(load.tokens_per_expert)}); read the load "
                "with expert_load(model, ...) on the same module you pass here"
            )
        bias = owner.get_buffer(balancer.bias_name)
        counts = load.tokens_per_expert[key].to(device=bias.device, dtype=torch.float64)
        delta = (rate * torch.sign(counts.mean() - counts)).to(torch.float32)
        bias.add_(delta.to(bias.dtype))
        deltas[prefix + balancer.bias_name] = delta
    return deltas
