"""ReLU² MLP, the sigmoid group-limited top-k router and the Nemotron-H MoE block around am-moe's experts.

What it is for: `NemotronMLP` (dense blocks and the shared expert), `NemotronRouter` (router math in fp32:
sigmoid scores, `e_score_correction_bias` for selection only, group-limited top-k over the sum of each group's top-2
scores, normalized top-k weights × `routed_scaling_factor`) and `NemotronMoE`: the router, the routed ReLU² experts
(`am_moe.GroupedExperts`, stacked `up_proj [E, I, D]` / `down_proj [E, D, I]`, one grouped GEMM per projection; expert
parallel after `NemotronHForCausalLM.apply_expert_parallel`), latent projections when `moe_latent_size` is set, and
the shared expert.
What it must not do: let padding take part in routing — padded tokens (`padding_mask` True) are removed before the
router (their output is the shared expert alone) and never change another token's routing or the expert load — or
store `e_score_correction_bias` in anything but fp32 (a buffer pinned by `_keep_in_fp32_modules_strict`). It
computes no expert itself: the expert MLPs, dispatch and load statistics are am-moe's.

Dropped groups are excluded with -inf before the top-k, as transformers' NemotronH router does (5.23, our parity
reference). NeMo AutoModel multiplies them by 0 instead, which lets a dropped expert outrank a kept one whose
biased score is negative.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from am_moe import GroupedExperts, RouterBalancer, balanced_routing
from am_precision import BackendConfig, initialize_linear_module

from ._init import reset_linear_
from .backend import EXPERTS_GROUPED_MM, LIBRARY_DISPATCHERS, moe_backend_problems
from .config import NemotronConfig
from .tp_plan import MLP_TP_PLAN, MOE_TP_PLAN

__all__ = ["NemotronMLP", "NemotronMoE", "NemotronRouter", "relu2"]


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU."""
    return torch.square(F.relu(x))


class NemotronMLP(nn.Module):
    """down(relu(up(x))²), no gate projection. x: [..., H] -> [..., H]."""

    _tp_plan: ClassVar[Any] = MLP_TP_PLAN  # am-tensor-parallel: intermediate features split over tp (tp_plan.py)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool,
        activation: str,
        backend: BackendConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if activation != "relu2":
            raise ValueError(f"activation {activation!r} is not supported; Nemotron-H uses 'relu2'.")
        self.up_proj = initialize_linear_module(
            backend.linear, hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype
        )
        self.down_proj = initialize_linear_module(
            backend.linear, intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype
        )

    @torch.no_grad()
    def init_weights(self) -> None:
        reset_linear_(self.up_proj)
        reset_linear_(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(relu2(self.up_proj(x)))
        return out


class NemotronRouter(nn.Module):
    """Sigmoid top-k router with group-limited selection. x: [T, H] -> (weights [T, K] fp32, indices [T, K]).

    `weight`: [E, H] in the model dtype; `e_score_correction_bias`: [E] fp32 buffer (selection only).
    """

    e_score_correction_bias: torch.Tensor

    def __init__(
        self,
        config: NemotronConfig,
        *,
        gate_precision: torch.dtype,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.initializer_range = config.initializer_range
        self.gate_precision = gate_precision
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, device=device, dtype=dtype))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(self.num_experts, device=device, dtype=torch.float32)
        )

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.initializer_range)
        self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor, *, return_scores: bool = False) -> tuple[torch.Tensor, ...]:
        """x `[T, H]` -> (weights `[T, K]`, indices `[T, K]`); with `return_scores` also the logits `[T, E]` and the
        sigmoid scores `[T, E]` (all in `gate_precision`), which feed the balancing terms (`am_moe.RouterBalancer`).
        The MoE block calls the module (so forward hooks see every routing)."""
        weights, indices, logits, scores = self.route(x)
        return (weights, indices, logits, scores) if return_scores else (weights, indices)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward(x, return_scores=True)` without module hooks: (weights, indices, logits, scores)."""
        logits = F.linear(x.to(self.gate_precision), self.weight.to(self.gate_precision))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.to(scores.dtype)
        if self.n_group > 1:
            per_group = self.num_experts // self.n_group
            grouped = choice.view(choice.shape[0], self.n_group, per_group)  # not -1: a rank may route 0 tokens
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            kept = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(choice.shape)
        indices = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices, logits, scores


class NemotronMoE(nn.Module):
    """Routed ReLU² experts (optionally in a latent space) plus a shared expert. x: [B, S, H] -> [B, S, H].

    `experts` is an `am_moe.GroupedExperts(n_routed_experts, D, moe_intermediate_size, gated=False,
    activation="relu2")` with D the hidden or latent size; `backend.experts` picks its grouped-GEMM backend.
    """

    _tp_plan: ClassVar[Any] = MOE_TP_PLAN  # am-tensor-parallel: whole on every tp rank, whole sequences (tp_plan.py)

    def __init__(
        self,
        config: NemotronConfig,
        *,
        backend: BackendConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        problems = moe_backend_problems(backend)  # experts / dispatcher: unsupported, or missing CUDA / a library
        if problems:
            raise ValueError("NemotronMoE: BackendConfig cannot run as asked:\n  - " + "\n  - ".join(problems))
        # A library dispatcher moves tokens between ep ranks: forward refuses it until apply_expert_parallel ran.
        self.dispatcher_backend = backend.dispatcher
        gate_precision = backend.gate_precision if backend.gate_precision is not None else torch.float32
        self.gate = NemotronRouter(config, gate_precision=gate_precision, device=device, dtype=dtype)
        # BackendConfig.fake_balanced_gate: am_moe.balanced_routing replaces the router (benchmarks; no router grad)
        self.fake_balanced_gate = backend.fake_balanced_gate
        self.fake_gate_noise = float(backend.fake_gate_noise)
        # Balancing terms (all off until am_moe.configure_load_balancing; the recipe is
        # NemotronHForCausalLM.moe_load_balancing): the bias update moves gate.e_score_correction_bias.
        self.balancer = RouterBalancer(bias_name="gate.e_score_correction_bias", experts_name="experts")
        latent = config.moe_latent_size
        expert_dim = latent if latent is not None else config.hidden_size
        self.initializer_range = config.initializer_range
        self.experts = GroupedExperts(
            config.n_routed_experts,
            expert_dim,
            config.moe_intermediate_size,
            gated=False,
            activation="relu2",
            grouped_mm=EXPERTS_GROUPED_MM[backend.experts],
            device=device,
            dtype=dtype,
        )
        self.shared_experts = NemotronMLP(
            config.hidden_size,
            config.moe_shared_expert_intermediate_size,
            bias=config.mlp_bias,
            activation=config.mlp_hidden_act,
            backend=backend,
            device=device,
            dtype=dtype,
        )
        self.fc1_latent_proj: nn.Module | None = None
        self.fc2_latent_proj: nn.Module | None = None
        if latent is not None:
            self.fc1_latent_proj = initialize_linear_module(
                backend.linear, config.hidden_size, latent, bias=config.mlp_bias, device=device, dtype=dtype
            )
            self.fc2_latent_proj = initialize_linear_module(
                backend.linear, latent, config.hidden_size, bias=config.mlp_bias, device=device, dtype=dtype
            )

    @torch.no_grad()
    def init_weights(self) -> None:
        self.gate.init_weights()
        self.experts.init_weights(std=self.initializer_range)
        self.shared_experts.init_weights()
        reset_linear_(self.fc1_latent_proj)
        reset_linear_(self.fc2_latent_proj)

    def forward(self, hidden_states: torch.Tensor, *, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """padding_mask: [B, S] bool, True for padding tokens (removed before routing: no expert, no load)."""
        if self.dispatcher_backend in LIBRARY_DISPATCHERS and self.experts.ep_size == 1:
            raise ValueError(
                f"NemotronMoE: BackendConfig.dispatcher={self.dispatcher_backend!r} moves tokens between "
                "expert-parallel ranks, but these experts are not expert parallel (call "
                "model.apply_expert_parallel(ep_mesh) with ep > 1 first); without expert parallelism use "
                "dispatcher='torch'"
            )
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        real = None
        tokens = flat
        if padding_mask is not None:
            real = (~padding_mask.reshape(-1).to(torch.bool)).nonzero().squeeze(-1)
            tokens = flat.index_select(0, real)
        balance = self.balancer.needs_router_terms and not self.fake_balanced_gate
        if self.fake_balanced_gate:
            weights, indices = balanced_routing(
                tokens.shape[0],
                self.gate.num_experts,
                self.gate.top_k,
                device=tokens.device,
                noise=self.fake_gate_noise,
            )
        else:
            weights, indices, logits, scores = self.gate(tokens, return_scores=True)
        expert_in = self.fc1_latent_proj(tokens) if self.fc1_latent_proj is not None else tokens
        # Called even with no token left: under expert parallelism every rank of the ep group joins the all-to-all.
        expert_out = self.experts(expert_in, indices, weights)
        if balance:
            # DeepSeek's sequence term runs per batch row; padding was removed above, so ids follow `real`
            rows = torch.arange(shape[0], device=flat.device).repeat_interleave(flat.shape[0] // max(shape[0], 1))
            expert_out = self.balancer(
                expert_out,
                probs=scores / (scores.sum(dim=-1, keepdim=True) + 1e-20),
                logits=logits,
                top_k_index=indices,
                sequence_ids=rows if real is None else rows.index_select(0, real),
                num_sequences=shape[0],
            )
        if self.fc2_latent_proj is not None:
            expert_out = self.fc2_latent_proj(expert_out)
        routed_out = expert_out if real is None else flat.new_zeros(flat.shape).index_copy(0, real, expert_out)
        return routed_out.view(shape) + self.shared_experts(hidden_states)
