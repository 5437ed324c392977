"""Gemma 4 mixture-of-experts block: fp32 router on the raw residual, GeGLU experts from am-moe.

What it is for: `Gemma4Router` (RMSNorm without scale · `scale` · H^-0.5 → linear to E → softmax over all experts →
top-k → renormalize → per-expert scale, all in fp32), `Gemma4Experts` (`am_moe.GroupedExperts` with GeGLU,
transformers' layout `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`, one grouped GEMM per projection) and
`Gemma4MoE`, which routes on the un-normalized residual, computes the experts on the pre-normalized input and keeps
padding tokens out of the experts (their output is 0, they count in no expert's load).
Expert parallelism of these experts is am-moe's (`Gemma4PreTrainedModel.apply_expert_parallel`).
What it must not do: change routing with the storage dtype (the router casts its input and weights to fp32, or to
`BackendConfig.gate_precision` when one is applied, and its parameters are pinned fp32 by the model's
`_keep_in_fp32_modules_strict`), or compute experts itself (dispatch,
grouped GEMMs, expert parallelism and load statistics are am-moe's).

Names versus transformers: HF keeps `router.*` and `experts.*` directly in the decoder layer; ours live under
`moe.router.*` / `moe.experts.*` with the same tensors and layouts (`state_dict_adapter.py` renames, nothing else).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from am_moe import GroupedExperts, RouterBalancer, balanced_routing
from am_precision import BackendConfig

from .backend import LIBRARY_DISPATCHERS, experts_grouped_mm
from .config import moe_intermediate_size
from .layers import Gemma4RMSNorm, rms_norm
from .tp_plan import MOE_TP_PLAN

__all__ = ["Gemma4Experts", "Gemma4MoE", "Gemma4Router", "apply_routing_backend"]


class Gemma4Router(nn.Module):
    """Top-k routing of `[T, H]` tokens over E experts, computed in fp32 whatever the input dtype.

    Returns `(weights [T, K] fp32, indices [T, K] int64)`: the top-k softmax probabilities renormalized to sum to
    1, times `per_expert_scale[index]`.

    Routing options (set from a `BackendConfig` by `apply_routing_backend`): `gate_precision` (the router math's
    dtype, fp32 by default), `fake_balanced_gate` / `fake_gate_noise` (`am_moe.balanced_routing` replaces the
    probabilities: weights 1/K times `per_expert_scale`, no gradient to `proj`).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.top_k = int(config.top_k_experts)
        self.num_experts = int(config.num_experts)
        self.scalar_root_size = hidden**-0.5  # a Python float: never rounded to a storage dtype
        self.norm = Gemma4RMSNorm(hidden, eps=float(config.rms_norm_eps), with_scale=False)
        self.proj = nn.Linear(hidden, self.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(self.num_experts))
        self.gate_precision = torch.float32
        self.fake_balanced_gate = False
        self.fake_gate_noise = 0.0

    def forward(self, hidden_states: torch.Tensor, *, return_scores: bool = False) -> tuple[torch.Tensor, ...]:
        """`[T, H]` → (weights `[T, K]`, indices `[T, K]`); with `return_scores` also the logits `[T, E]` and the
        probabilities `[T, E]`, which feed the balancing terms (`am_moe.RouterBalancer`). The MoE block calls the
        module, so forward hooks (transformers' router-logit recorders) see every routing."""
        weights, indices, logits, probabilities = self.route(hidden_states)
        return (weights, indices, logits, probabilities) if return_scores else (weights, indices)

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward(hidden_states, return_scores=True)` without module hooks (zeros for logits and probabilities
        under the fake gate)."""
        dtype = self.gate_precision
        if self.fake_balanced_gate:
            weights, indices = balanced_routing(
                hidden_states.shape[0],
                self.num_experts,
                self.top_k,
                device=hidden_states.device,
                noise=self.fake_gate_noise,
            )
            zeros = hidden_states.new_zeros(hidden_states.shape[0], self.num_experts, dtype=dtype)
            return weights.to(dtype) * self.per_expert_scale.to(dtype)[indices], indices, zeros, zeros
        # scale · H^-0.5 folded into the norm's weight: one [H] multiply instead of two [T, H] passes (and backward)
        normed = rms_norm(hidden_states.to(dtype), self.scale.to(dtype) * self.scalar_root_size, self.norm.eps)
        logits = F.linear(normed, self.proj.weight.to(dtype))
        probabilities = torch.softmax(logits, dim=-1, dtype=dtype)
        weights, indices = torch.topk(probabilities, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale.to(dtype)[indices], indices, logits, probabilities


class Gemma4Experts(GroupedExperts):
    """The E GeGLU experts of a Gemma 4 config: `am_moe.GroupedExperts(num_experts, hidden_size,
    moe_intermediate_size, gated=True, activation="gelu_tanh")`, initialized normal(0, initializer_range).

    gate_up_proj: `[E, 2I, H]` (gate rows first), down_proj: `[E, H, I]` — transformers' `Gemma4TextExperts`
    layout. forward(hidden_states `[T, H]`, top_k_index `[T, K]`, top_k_weights `[T, K]`, *, token_mask `[T]`).
    """

    def __init__(self, config: Any, *, grouped_mm: str = "auto") -> None:
        intermediate = moe_intermediate_size(config)
        assert intermediate is not None
        super().__init__(
            int(config.num_experts),
            int(config.hidden_size),
            intermediate,
            gated=True,
            activation="gelu_tanh",
            grouped_mm=grouped_mm,
        )
        self.init_weights(std=float(getattr(config, "initializer_range", 0.02)))


class Gemma4MoE(nn.Module):
    """Router + experts of one decoder layer (no shared experts; the dense MLP runs beside it in the layer)."""

    _tp_plan: ClassVar[Any] = MOE_TP_PLAN  # am-tensor-parallel: whole, on whole sequences (tp_plan.py)

    def __init__(self, config: Any, *, backend: BackendConfig | None = None) -> None:
        super().__init__()
        self.router = Gemma4Router(config)
        # BackendConfig.experts: "torch" = am-moe's per-expert loop, "torch_mm" = its grouped GEMM, "te" / "gmm" the
        # libraries' grouped GEMMs (None: "auto").
        self.experts = Gemma4Experts(config, grouped_mm=experts_grouped_mm(backend))
        # The dispatcher fields are applied by apply_expert_parallel (Gemma4PreTrainedModel reads them here).
        self.backend = backend
        # Balancing terms (all off until am_moe.configure_load_balancing). No selection bias: the softmax router
        # has none, so only the aux losses and the z-loss apply.
        self.balancer = RouterBalancer(bias_name=None, experts_name="experts")
        # BackendConfig's routing fields (gate_precision, fake_balanced_gate, fake_gate_noise) on this router.
        apply_routing_backend(self, backend)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        router_input: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states (normalized) and router_input (raw residual) `[B, S, H]` → `[B, S, H]`.

        padding_mask: `[B, S]`, True = padding; those tokens are not dispatched and get 0.
        """
        dispatcher = self.backend.dispatcher if self.backend is not None else "torch"
        if dispatcher in LIBRARY_DISPATCHERS and self.experts.ep_size == 1:
            raise ValueError(
                f"Gemma4MoE: BackendConfig.dispatcher={dispatcher!r} moves tokens between expert-parallel ranks, but "
                "these experts are not expert parallel (call model.apply_expert_parallel(ep_mesh) with ep > 1 "
                "first); without expert parallelism use dispatcher='torch'"
            )
        shape = hidden_states.shape
        weights, indices, logits, probabilities = self.router(router_input.reshape(-1, shape[-1]), return_scores=True)
        token_mask = None if padding_mask is None else ~padding_mask.reshape(-1).bool()
        out = self.experts(hidden_states.reshape(-1, shape[-1]), indices, weights, token_mask=token_mask)
        if self.balancer.needs_router_terms and not self.router.fake_balanced_gate:
            rows = torch.arange(shape[0], device=out.device).repeat_interleave(out.shape[0] // max(shape[0], 1))
            out = self.balancer(
                out,
                probs=probabilities,
                logits=logits,
                top_k_index=indices,
                sequence_ids=rows,
                num_sequences=shape[0],
                token_mask=token_mask,
            )
        return out.reshape(shape)


def apply_routing_backend(model: nn.Module, backend: Any) -> int:
    """Set the routing fields of an upstream `BackendConfig` (`gate_precision`, None = fp32; `fake_balanced_gate`;
    `fake_gate_noise`) on every `Gemma4Router` in `model`; returns how many routers. Other fields do not change
    Gemma 4's kernels. `backend` None leaves the routers as they are.

    Raises:
        ValueError: a fake_gate_noise that is negative or not finite, or a gate_precision that is not a floating
            dtype.
    """
    if backend is None:
        return 0
    precision = getattr(backend, "gate_precision", None)
    precision = torch.float32 if precision is None else precision
    noise = getattr(backend, "fake_gate_noise", 0.0)
    problems = []
    if not isinstance(precision, torch.dtype) or not precision.is_floating_point:
        problems.append(f"gate_precision={precision!r} must be a floating-point torch dtype")
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not noise >= 0 or noise == float("inf"):
        problems.append(f"fake_gate_noise={noise!r} must be a finite number >= 0")
    if problems:
        raise ValueError("Gemma 4 routing backend: " + "; ".join(problems))
    routers = [m for m in model.modules() if isinstance(m, Gemma4Router)]
    for router in routers:
        router.gate_precision = precision
        router.fake_balanced_gate = bool(getattr(backend, "fake_balanced_gate", False))
        router.fake_gate_noise = float(noise)
    return len(routers)
