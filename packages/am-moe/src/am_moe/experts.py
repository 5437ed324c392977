"""`GroupedExperts`: E expert MLPs (gated or plain) computed with one grouped GEMM per projection, dropless.

What it is for: the routed experts of a mixture-of-experts layer. The model's router gives
`(top_k_index [T, K], top_k_weights [T, K])`; this module sorts the (token, k) pairs by expert, runs
    gated:  down( act(x @ gate^T) * (x @ up^T) )    (SwiGLU with act="silu", GeGLU with act="gelu_tanh")
    plain:  down( act(x @ up^T) )                    (Nemotron-H: act="relu2")
for every expert over its contiguous rows, and returns `sum_k weight[t, k] * expert_{index[t, k]}(x[t])` in `[T, H]`.
Tokens with `token_mask` False (padding) reach no expert and get 0. After `apply_expert_parallel` the same module
sends rows to the experts' owners with all-to-all (dispatch.py); nothing else changes for the caller.
What it must not do: route (routers, their scores and biases stay in the model packages; balancing is `balance`),
drop a token, or sync the host per layer for its load statistics.

Parameter layout (transformers' in-memory layout, `[E, out, in]`, i.e. a stack of `nn.Linear` weights):
    gated: gate_up_proj [E, 2I, H] (gate rows first, then up), down_proj [E, H, I]
    plain: up_proj      [E, I, H],                             down_proj [E, H, I]
so an HF checkpoint's per-expert key `experts.{e}.up_proj.weight` is `up_proj[e]` and its stacked `gate_up_proj` is
the tensor itself; `torch._grouped_mm` reads `weight.transpose(-2, -1)` (column-major) without a copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .dispatch import Dispatcher, LocalDispatcher
from .grouped_mm import GROUPED_MM_BACKENDS, GroupedMMChoice, GroupLayout, grouped_linear, select_grouped_mm_backend
from .routing import routing_problems
from .tuning import TuningKey, can_measure, measure_grouped_mm, measured_choice

__all__ = ["EXPERT_ACTIVATIONS", "GroupedExperts"]


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


EXPERT_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": _relu2,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
}


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight sharded over the ep mesh (a DTensor, Shard(0)); a plain tensor as it is."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if callable(to_local) else weight


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class GroupedExperts(nn.Module):
    """E experts of width `hidden_size` -> `intermediate_size` -> `hidden_size`, stacked `[E, out, in]`.

    Args:
        num_experts: E (all experts, also after expert parallelism shards them).
        hidden_size: H, the width of the tokens the experts see (the latent size for latent MoE).
        intermediate_size: I, each expert's inner width (the gate and up halves each have I rows when gated).
        gated: gate+up projection (`gate_up_proj`) vs a single up projection (`up_proj`).
        activation: a name in `EXPERT_ACTIVATIONS` or a callable applied elementwise.
        grouped_mm: "auto" (where both `torch._grouped_mm` and the per-expert loop can run, the faster one as
            measured once per process on the first forward's rows, `am_moe.tuning`; else the one that runs),
            "grouped_mm" (refused where it cannot run), "loop", "gmm" (the `grouped_gemm` package; bf16 on CUDA) or
            "te" (Transformer Engine's `GroupedLinear`; CUDA) or "mxfp8" (MXFP8 forward, bf16 backward, `am_moe.mxfp8`;
            bf16 on a Blackwell GPU, H and I multiples of 32); a library or hardware backend is refused where it
            cannot run, naming what is missing (package, CUDA, GPU, dtype, sizes). The choice is reported by
            `grouped_mm_choice`.
        combine_dtype: dtype of the weighted sum over the top-k experts (fp32 default: the routing weights are not
            rounded to bf16); None sums in the experts' output dtype.

    Parameters are allocated uninitialized; call `init_weights(std=...)` or load a checkpoint.
    `tokens_per_expert` ([E] int64, not saved) accumulates this rank's routed (token, k) pairs per expert; see
    `am_moe.expert_load`.
    """

    tokens_per_expert: torch.Tensor

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        gated: bool,
        activation: str | Callable[[torch.Tensor], torch.Tensor],
        grouped_mm: str = "auto",
        combine_dtype: torch.dtype | None = torch.float32,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        problems = []
        for name, value in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive int, got {value!r}")
        if isinstance(activation, str) and activation not in EXPERT_ACTIVATIONS:
            problems.append(
                f"activation {activation!r} is unknown; use one of {sorted(EXPERT_ACTIVATIONS)} or a callable"
            )
        elif not isinstance(activation, str) and not callable(activation):
            problems.append(f"activation must be a name or a callable, got {activation!r}")
        if grouped_mm not in GROUPED_MM_BACKENDS:
            problems.append(f"grouped_mm must be one of {GROUPED_MM_BACKENDS}, got {grouped_mm!r}")
        if combine_dtype is not None and not combine_dtype.is_floating_point:
            problems.append(f"combine_dtype must be a floating dtype or None, got {combine_dtype}")
        if problems:
            raise ValueError("GroupedExperts: " + "; ".join(problems))
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gated = gated
        self.activation_name = activation if isinstance(activation, str) else getattr(activation, "__name__", "fn")
        self.activation = EXPERT_ACTIVATIONS[activation] if isinstance(activation, str) else activation
        self.grouped_mm = grouped_mm
        self.combine_dtype = combine_dtype
        factory = {"device": device, "dtype": dtype}
        first = 2 * intermediate_size if gated else intermediate_size
        first_weight = nn.Parameter(torch.empty(num_experts, first, hidden_size, **factory))  # type: ignore[arg-type]
        if gated:
            self.gate_up_proj = first_weight
        else:
            self.up_proj = first_weight
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))  # type: ignore[arg-type]
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.long, device=device), persistent=False
        )
        self.dispatcher: Dispatcher = LocalDispatcher()
        self._choices: dict[tuple[str, torch.dtype], GroupedMMChoice] = {}
        self._last_choice: GroupedMMChoice | None = None

    @property
    def first_proj(self) -> torch.Tensor:
        """`gate_up_proj` (gated) or `up_proj` (plain)."""
        return self.gate_up_proj if self.gated else self.up_proj

    @property
    def ep_size(self) -> int:
        return getattr(self.dispatcher, "ep_size", 1)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def grouped_mm_choice(self) -> GroupedMMChoice | None:
        """The grouped-GEMM backend of the most recent forward (None before the first one)."""
        return self._last_choice

    def choose_grouped_mm(self, device: torch.device, dtype: torch.dtype) -> GroupedMMChoice:
        """The backend for inputs on `device` in `dtype`: the rule's (decided once per pair), or, for "auto" where
        both `torch._grouped_mm` and the loop can run, the faster one as measured in this process (`am_moe.tuning`;
        until the first measurement, the rule's)."""
        key = (str(device), dtype)
        if key not in self._choices:
            sizes = (self.hidden_size, self.intermediate_size, 2 * self.intermediate_size if self.gated else 0)
            self._choices[key] = select_grouped_mm_backend(
                device=device, dtype=dtype, sizes=tuple(s for s in sizes if s), requested=self.grouped_mm
            )
        choice = self._choices[key]
        if self._measurable(choice):
            choice = measured_choice(self._tuning_key(device, dtype)) or choice
        self._last_choice = choice
        return choice

    def _measurable(self, rule: GroupedMMChoice) -> bool:
        return self.grouped_mm == "auto" and rule.backend == "grouped_mm" and not rule.seconds

    def _tuning_key(self, device: torch.device, dtype: torch.dtype) -> TuningKey:
        capability = ""
        if device.type == "cuda" and torch.cuda.is_available():
            capability = "sm{}{}".format(*torch.cuda.get_device_capability(device))
        return TuningKey(
            str(device),
            dtype,
            self.num_local_experts,
            self.hidden_size,
            self.intermediate_size,
            self.gated,
            self.activation_name,
            capability=capability,
        )

    def _measure(
        self, rows: torch.Tensor, layout: GroupLayout, first: torch.Tensor, down: torch.Tensor, rule: GroupedMMChoice
    ) -> GroupedMMChoice:
        """Time both backends on these rows and weights (detached copies: nothing of the module changes)."""
        rows, first, down = rows.detach(), first.detach(), down.detach()

        def run(backend: str, backward: bool) -> None:
            # Plain saving for this private graph: inside an activation-checkpointed layer the checkpoint's
            # saved-tensor hooks are active, and a graph of their own backward-ed here would break them.
            with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                x, w1, w2 = (t.clone().requires_grad_(backward) for t in (rows, first, down))
                out = self._experts(x, layout, w1, w2, backend)
                leaves = [x, w1, w2]
                if backward:
                    torch.autograd.grad(out, leaves, torch.ones_like(out))

        key = self._tuning_key(rows.device, rows.dtype)
        self._last_choice = measure_grouped_mm(key, run, num_rows=sum(layout.sizes or ()), rule=rule)
        return self._last_choice

    @torch.no_grad()
    def init_weights(self, *, std: float, down_std: float | None = None) -> None:
        """Normal(0, std) weights (`down_std` for `down_proj` when given); zero the load counters."""
        nn.init.normal_(self.first_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std if down_std is None else down_std)
        self.tokens_per_expert.zero_()

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states `[T, H]`, top_k_index `[T, K]` int (expert ids in [0, E)), top_k_weights `[T, K]` float,
        token_mask `[T]` bool (True = route; False = padding, output 0) -> `[T, H]` in hidden_states' dtype.

        Raises `RoutingError` listing every problem of the inputs; under expert parallelism every rank raises (the
        ranks exchange a validity flag before any token moves).
        """
        problems = routing_problems(
            hidden_states,
            top_k_index,
            top_k_weights,
            token_mask,
            num_experts=self.num_experts,
            hidden_size=self.hidden_size,
        )
        first, down = _local(self.first_proj), _local(self.down_proj)
        if not problems and first.dtype != hidden_states.dtype:
            problems.append(
                f"hidden_states are {hidden_states.dtype} but the expert weights are {first.dtype}; cast one of them"
            )
        choice = self.choose_grouped_mm(hidden_states.device, hidden_states.dtype)
        # "auto", both can run, not measured yet in this process; never inside a graph being compiled (no timing of
        # fake tensors, and no host sync forced into the graph: the rule's choice runs there)
        measure = self._measurable(choice) and not torch.compiler.is_compiling()
        host_sizes = measure or choice.backend in ("loop", "gmm", "te", "mxfp8") or hidden_states.device.type == "cpu"
        rows, layout, state = self.dispatcher.dispatch(
            hidden_states,
            top_k_index,
            token_mask,
            num_experts=self.num_experts,
            problems=problems,
            host_sizes=host_sizes,
            top_k_weights=top_k_weights,
        )
        self._record_load(state.counts)
        if measure and can_measure(rows, sum(layout.sizes or ())):
            choice = self._measure(rows, layout, first, down, choice)
        out = self._experts(rows, layout, first, down, choice.backend)
        return self.dispatcher.combine(
            out, state, top_k_weights, out_dtype=hidden_states.dtype, combine_dtype=self.combine_dtype
        )

    def _experts(
        self, rows: torch.Tensor, layout: GroupLayout, first: torch.Tensor, down: torch.Tensor, backend: str
    ) -> torch.Tensor:
        """`[N, H]` rows grouped by local expert -> `[N, H]` expert outputs (unweighted)."""
        h = grouped_linear(rows, first, layout, backend=backend)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.activation(gate) * up
        else:
            h = self.activation(h)
        return grouped_linear(h, down, layout, backend=backend)

    @torch.no_grad()
    def _record_load(self, counts: torch.Tensor) -> None:
        # Activation checkpointing re-runs the forward inside backward (a graph task is running then): count once.
        if torch._C._current_graph_task_id() != -1:
            return
        self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.device))

    def extra_repr(self) -> str:
        kind = "gated" if self.gated else "plain"
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, {kind}, activation={self.activation_name}, "
            f"ep_size={self.ep_size}"
        )
