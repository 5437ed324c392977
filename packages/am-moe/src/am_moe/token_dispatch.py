"""Token-level expert-parallel dispatch shared by DeepEP, UCCL-EP and HybridEP, and which dispatcher runs.

What it is for: upstream's `BackendConfig.dispatcher` values "deepep", "uccl_ep" and "hybridep". These libraries send
each TOKEN once to every rank that hosts at least one of its top-k experts (not once per (token, k) pair, as the
torch all-to-all of `dispatch.py` does), with its top-k indices (local expert ids, -1 elsewhere) and weights; the
receiving rank multiplies each expert output by its routing weight and sums a token's local experts before the
combine sends one row back per (token, rank), which the combine sums. This module holds what does not depend on the
library, and runs on plain torch:
  - `dispatcher_problems` / `make_dispatcher`: which dispatcher runs, refused before any collective naming what is
    missing (package, CUDA, ep > 1), and the object `apply_expert_parallel` gives the experts;
  - `prepare_token_routing`: every rank raises on any rank's bad router outputs before any token moves (as
    `dispatch.py`); padding tokens get index -1 everywhere (the libraries' "no selection"), so they reach no rank;
  - `_permute` / `_unpermute`: the received (token, local expert) pairs sorted by expert for the grouped GEMM, the
    outputs weighted (in `combine_dtype`, fp32 by default) and summed per received token;
  - `_Dispatch` / `_Combine`: the autograd rule of every exchange — dispatch's backward is a combine of the
    gradients (with the weights' gradients, so the router is trained), combine's backward a dispatch with the
    cached layout (Megatron's fused_a2a does the same around DeepEP);
  - `TokenDispatcher`: the `GroupedExperts` dispatcher around a `TokenExchange` (dispatch, combine, cached dispatch).
One module per exchange: `torch_token.TorchTokenExchange` (`all_to_all_single`, any backend, gloo included: how the
shared logic is tested), `deepep.DeepEPExchange` (DeepEP's `Buffer`, or UCCL-EP's DeepEP-compatible one);
`hybridep.HybridEPDispatcher` (HybridEP permutes inside the library, so it skips `_permute` and keeps the rest).
What it must not do: import a library (its module does, on first use: they need CUDA), fall back to another
dispatcher, accept a knob it does not honour (`dispatcher_problems` refuses), or store per-call state on a module (it
travels in the returned state, as in `dispatch.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from .dispatch import _sort_pairs, agree_on_input
from .grouped_mm import GroupLayout, _installed
from .routing import RoutingError

__all__ = [
    "DISPATCHERS",
    "TokenDispatcher",
    "TokenExchange",
    "TokenState",
    "dispatcher_problems",
    "make_dispatcher",
    "prepare_token_routing",
]

# "torch": pairs over all_to_all_single (dispatch.py); "torch_token": the token-level protocol in plain torch;
# the others: the libraries. Upstream's BackendConfig names, plus "torch_token".
DISPATCHERS: tuple[str, ...] = ("torch", "torch_token", "deepep", "uccl_ep", "hybridep")
_State = TypeVar("_State")  # what a token-level dispatcher's `dispatch` hands to its `combine`
_LIBRARY = {"deepep": "deep_ep", "uccl_ep": "uccl_ep", "hybridep": "deep_ep"}
_INSTALL = {
    "deep_ep": "build DeepEP from source (https://github.com/deepseek-ai/DeepEP)",
    "uccl_ep": "`pip install uccl` (UCCL-EP)",
}


def dispatcher_problems(
    dispatcher: str,
    *,
    ep: int,
    device_type: str,
    num_sms: int = 20,
    async_dispatch: bool = False,
) -> list[str]:
    """Everything that keeps `dispatcher` from running as asked, as messages (empty: it runs). Pure: no collective.

    ep: the expert-parallel size; device_type: where the tokens live ("cuda", "cpu"); num_sms: SMs the library's
    communication kernels use (upstream's `dispatcher_num_sms`, default 20 as upstream and DeepEP);
    async_dispatch: overlap the dispatch with computation (upstream's `dispatcher_async_dispatch`).
    """
    if dispatcher not in DISPATCHERS:
        return [f"dispatcher={dispatcher!r} is unknown; choose one of {DISPATCHERS}"]
    problems = []
    if dispatcher in _LIBRARY:
        if ep < 2:
            problems.append(
                f"dispatcher={dispatcher!r} moves tokens between expert-parallel ranks, but ep={ep}: use "
                "dispatcher='torch' without expert parallelism, or ep > 1"
            )
        module = _LIBRARY[dispatcher]
        if not _installed(module):
            problems.append(
                f"dispatcher={dispatcher!r} needs the `{module}` package, not installed: {_INSTALL[module]}"
            )
        if device_type != "cuda" or not torch.cuda.is_available():
            where = "torch.cuda.is_available() is False" if not torch.cuda.is_available() else f"{device_type!r}"
            problems.append(f"dispatcher={dispatcher!r} needs tokens on a CUDA GPU ({where})")
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
            problems.append(f"dispatcher_num_sms={num_sms!r} must be a positive int")
        if async_dispatch and dispatcher == "hybridep":
            problems.append(
                "dispatcher_async_dispatch=True: HybridEP's dispatch_with_permute has no asynchronous mode; "
                "use dispatcher='deepep' or 'uccl_ep' for it, or leave it False"
            )
    else:
        knobs = [f"dispatcher_num_sms={num_sms}"] if num_sms != 20 else []
        knobs += ["dispatcher_async_dispatch=True"] if async_dispatch else []
        if knobs:
            problems.append(
                f"{', '.join(knobs)} tune the communication kernels of deepep / uccl_ep / hybridep; "
                f"dispatcher={dispatcher!r} (torch collectives) has none: leave them at their defaults (20, False)"
            )
    return problems


class TokenExchange(Protocol):
    """The library part of a token-level dispatcher (DeepEP's protocol). No autograd: `_Dispatch` / `_Combine` add it.

    dispatch: x `[T, H]`, topk_idx `[T, K]` int64 (GLOBAL expert ids, -1 = none), topk_weights `[T, K]` fp32 ->
        (recv_x `[N, H]`, recv_idx `[N, K]` LOCAL expert ids or -1, recv_weights `[N, K]` fp32, handle).
    combine: y `[N, H]` (and optionally weights `[N, K]`) -> the sums over ranks per original token `[T, H]`
        (`[T, K]`).
    dispatch_cached: x `[T, H]` sent with the layout of `handle` -> `[N, H]` (combine's backward).
    """

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]: ...

    def combine(
        self, y: torch.Tensor, handle: Any, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def dispatch_cached(self, x: torch.Tensor, handle: Any) -> torch.Tensor: ...


class _Dispatch(torch.autograd.Function):
    """exchange.dispatch, differentiable in the tokens and the weights (backward: combine of both gradients)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, exchange: TokenExchange, box: dict
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        recv_x, recv_idx, recv_w, handle = exchange.dispatch(x, idx, weights, box["num_experts"])
        ctx.exchange, ctx.handle, ctx.w_dtype = exchange, handle, weights.dtype
        box["handle"] = handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w

    @staticmethod
    def backward(ctx: Any, g_x: torch.Tensor, g_idx: Any, g_w: torch.Tensor | None) -> tuple[Any, ...]:
        g_x_out, g_w_out = ctx.exchange.combine(g_x.contiguous(), ctx.handle, None if g_w is None else g_w.float())
        if g_w_out is not None:
            g_w_out = g_w_out.to(ctx.w_dtype)
        return g_x_out, g_w_out, None, None, None


class _Combine(torch.autograd.Function):
    """exchange.combine of the weighted per-token sums (backward: dispatch of the gradient with the cached layout)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, exchange: TokenExchange, handle: Any) -> torch.Tensor:
        ctx.exchange, ctx.handle = exchange, handle
        out, _ = exchange.combine(y, handle)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.exchange.dispatch_cached(grad.contiguous(), ctx.handle), None, None


@dataclass
class TokenState:
    """What `TokenDispatcher.combine` needs from its dispatch (one per call, never stored on a module).

    counts: `[E]` int64, this rank's (token, k) pairs per GLOBAL expert, padding excluded (load statistics).
    """

    counts: torch.Tensor
    handle: Any
    num_received: int  # N: tokens this rank received
    top_k: int
    pair_rows: torch.Tensor  # [n]: received pair index (token * K + k) of each expert row, grouped by local expert
    row_weights: torch.Tensor  # [n]: its routing weight
    exchange: Any


def _library_dtype_problems(name: str, hidden_states: torch.Tensor) -> list[str]:
    """DeepEP's / UCCL-EP's normal kernels and HybridEP's (without FP8) move bf16 tokens only."""
    if name in _LIBRARY and hidden_states.dtype != torch.bfloat16:
        return [
            f"dispatcher {name!r} moves bf16 tokens only, got {hidden_states.dtype}: run the MoE layer in bf16 "
            "(mixed precision) or use dispatcher='torch'"
        ]
    return []


def _masked_routing(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, token_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding tokens select nothing (index -1, weight 0): they reach no rank and get 0 and no gradient."""
    idx = top_k_index.long()
    if token_mask is None:
        return idx, top_k_weights
    keep = token_mask.unsqueeze(-1)
    return torch.where(keep, idx, -1), torch.where(keep, top_k_weights, top_k_weights.new_zeros(()))


def _permute(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor, local: int) -> tuple[Any, ...]:
    """Received tokens -> rows grouped by local expert: (rows `[n, H]`, sizes, pair_rows `[n]`, weights `[n]`)."""
    top_k = recv_idx.shape[1]
    flat = recv_idx.reshape(-1)
    key = torch.where(flat < 0, local, flat)
    order = torch.argsort(key, stable=True)
    sizes = torch.bincount(key, minlength=local + 1)[:local].tolist()
    pair_rows = order[: sum(sizes)]
    return recv_x[pair_rows // top_k], sizes, pair_rows, recv_w.reshape(-1)[pair_rows]


def _unpermute(expert_out: torch.Tensor, state: TokenState, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Expert rows -> `[N, H]`: per received token, sum over its local experts of weight x output (in `dtype`)."""
    weighted = expert_out.to(dtype) * state.row_weights.to(dtype).unsqueeze(-1)
    summed = weighted.new_zeros(state.num_received, expert_out.shape[1])
    return summed.index_add(0, state.pair_rows // state.top_k, weighted).to(out_dtype)


def prepare_token_routing(
    name: str,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    token_mask: torch.Tensor | None,
    top_k_weights: torch.Tensor | None,
    *,
    num_experts: int,
    problems: list[str],
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every token-level dispatcher does before its library moves a token: check the router outputs on EVERY
    rank of `group` (`problems`: the caller's; plus the libraries' bf16 rule; any rank's problem raises on all of
    them, before any token moves) and mask padding. Collective (one small all-reduce over `group`).

    Returns (counts `[E]` int64: this rank's (token, k) pairs per global expert, padding excluded; idx `[T, K]` int64
    with -1 for padding; weights `[T, K]` with 0 for padding).

    Raises:
        RoutingError: no `top_k_weights` (the libraries weight on the experts' rank), or any rank's bad input.
    """
    if top_k_weights is None:
        raise RoutingError(f"dispatcher {name!r} applies the routing weights on the experts' rank: pass them")
    problems = problems + _library_dtype_problems(name, hidden_states)
    if problems:  # malformed shapes: still join the header exchange so every rank raises
        counts = torch.zeros(num_experts + 2, dtype=torch.long, device=hidden_states.device)
    else:
        counts = _sort_pairs(top_k_index, token_mask, num_experts)[2]
    agree_on_input(counts, problems, group, num_experts=num_experts)
    idx, weights = _masked_routing(top_k_index, top_k_weights, token_mask)
    return counts[:num_experts], idx, weights


class _TokenLevelDispatcher(Generic[_State]):
    """What the token-level dispatchers share: `prepare_token_routing` before the subclass's `_send` (checked, masked
    routing -> rows, layout, state); `_combine` weights in `combine_dtype` (the rows' dtype by default) -> `[T, H]`."""

    def __init__(self, group: dist.ProcessGroup, *, name: str) -> None:
        self.group, self.name = group, name
        self.ep_size = dist.get_world_size(group)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        token_mask: torch.Tensor | None,
        *,
        num_experts: int,
        problems: list[str],
        host_sizes: bool,
        top_k_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, GroupLayout, _State]:
        del host_sizes  # the received counts reach the host anyway (grouped GEMM sizes)
        counts, idx, weights = prepare_token_routing(
            self.name,
            hidden_states,
            top_k_index,
            token_mask,
            top_k_weights,
            num_experts=num_experts,
            problems=problems,
            group=self.group,
        )
        return self._send(hidden_states, counts, idx, weights, num_experts)

    def combine(
        self,
        expert_out: torch.Tensor,
        state: _State,
        top_k_weights: torch.Tensor,
        *,
        out_dtype: torch.dtype,
        combine_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        """Expert rows `[n, H]` -> `[T, H]`: weighted on this rank, summed per token, sent home and summed there."""
        del top_k_weights  # already applied on the experts' rank (they travelled with the tokens)
        dtype = combine_dtype if combine_dtype is not None else expert_out.dtype
        return self._combine(expert_out, state, dtype).to(out_dtype)

    def _send(
        self, x: torch.Tensor, counts: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, GroupLayout, _State]:
        raise NotImplementedError

    def _combine(self, expert_out: torch.Tensor, state: _State, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class TokenDispatcher(_TokenLevelDispatcher[TokenState]):
    """Experts sharded over `group` (rank r owns experts `[r * E / ep, (r + 1) * E / ep)`), tokens moved by a
    `TokenExchange` (DeepEP's protocol). The `GroupedExperts` dispatcher interface: dispatch -> rows grouped by local
    expert; combine -> `[T, H]`. Routing weights are applied on the experts' rank (the libraries sum there)."""

    def __init__(self, group: dist.ProcessGroup, exchange: TokenExchange, *, name: str) -> None:
        super().__init__(group, name=name)
        self.exchange = exchange

    def _send(
        self, x: torch.Tensor, counts: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, GroupLayout, TokenState]:
        box: dict[str, Any] = {"num_experts": num_experts}
        recv_x, recv_idx, recv_w = _Dispatch.apply(x, weights, idx, self.exchange, box)
        local = num_experts // self.ep_size
        rows, sizes, pair_rows, row_weights = _permute(recv_x, recv_idx, recv_w, local)
        state = TokenState(counts, box["handle"], recv_x.shape[0], idx.shape[1], pair_rows, row_weights, self.exchange)
        return rows, GroupLayout.from_sizes(sizes, device=rows.device), state

    def _combine(self, expert_out: torch.Tensor, state: TokenState, dtype: torch.dtype) -> torch.Tensor:
        # the exchange moves rows in the experts' dtype (bf16 for DeepEP): the per-rank partial sums round there
        per_token = _unpermute(expert_out, state, dtype, expert_out.dtype)
        return _Combine.apply(per_token, state.exchange, state.handle)


def make_dispatcher(
    dispatcher: str,
    group: dist.ProcessGroup,
    *,
    num_sms: int = 20,
    async_dispatch: bool = False,
    shared: dict[str, Any] | None = None,
) -> Any:
    """The dispatcher object for `dispatcher` on `group`. `shared`: one cache per `apply_expert_parallel` call when
    the layers share one token dispatcher (upstream's `dispatcher_share_token_dispatcher`, one communication buffer
    for all layers); None gives this layer its own."""
    # the exchange modules import this one (the shared logic): imported here, not at the top
    from .deepep import DeepEPExchange
    from .dispatch import AllToAllDispatcher
    from .hybridep import HybridEPDispatcher
    from .torch_token import TorchTokenExchange

    if shared is not None and dispatcher in shared:
        return shared[dispatcher]
    made: Any
    if dispatcher == "torch":
        made = AllToAllDispatcher(group)
    elif dispatcher == "torch_token":
        made = TokenDispatcher(group, TorchTokenExchange(group), name=dispatcher)
    elif dispatcher in ("deepep", "uccl_ep"):
        exchange = DeepEPExchange(group, module=_LIBRARY[dispatcher], num_sms=num_sms, async_dispatch=async_dispatch)
        made = TokenDispatcher(group, exchange, name=dispatcher)
    elif dispatcher == "hybridep":
        made = HybridEPDispatcher(group, num_sms=num_sms)
    else:
        raise ValueError(f"dispatcher={dispatcher!r} is unknown; choose one of {DISPATCHERS}")
    if shared is not None:
        shared[dispatcher] = made
    return made
