"""Token-level expert-parallel dispatchers: DeepEP, UCCL-EP and HybridEP, and the same protocol in plain torch.

What it is for: upstream's `BackendConfig.dispatcher` values "deepep", "uccl_ep" and "hybridep". These libraries send
each TOKEN once to every rank that hosts at least one of its top-k experts (not once per (token, k) pair, as the
torch all-to-all of `dispatch.py` does), with its top-k indices (local expert ids, -1 elsewhere) and weights; the
receiving rank multiplies each expert output by its routing weight and sums a token's local experts before the
combine sends one row back per (token, rank), which the combine sums. The logic around the library call is shared
and runs on plain torch:
  - `agree_on_input`: every rank raises on any rank's bad router outputs before any token moves (as `dispatch.py`);
  - padding tokens get index -1 everywhere (the libraries' "no selection"), so they reach no rank;
  - `_permute` / `_unpermute`: the received (token, local expert) pairs sorted by expert for the grouped GEMM, the
    outputs weighted (in `combine_dtype`, fp32 by default) and summed per received token;
  - `_Dispatch` / `_Combine`: the autograd rule of every exchange — dispatch's backward is a combine of the
    gradients (with the weights' gradients, so the router is trained), combine's backward a dispatch with the
    cached layout (Megatron's fused_a2a does the same around DeepEP).
Only the exchange (`TokenExchange`: dispatch, combine, cached dispatch) is library code: `TorchTokenExchange`
(`all_to_all_single`, any backend, gloo included: it is how the shared logic is tested), `DeepEPExchange`
(`deep_ep.Buffer.get_dispatch_layout / dispatch / combine`, or UCCL-EP's DeepEP-compatible `uccl_ep.Buffer`).
HybridEP permutes inside the library (`deep_ep.HybridEPBuffer.dispatch_with_permute / combine_with_unpermute`), so
`HybridEPDispatcher` skips `_permute` and keeps the rest.
What it must not do: import a library before it is used (they need CUDA), fall back to another dispatcher, accept a
knob it does not honour (`dispatcher_problems` refuses), or store per-call state on a module (it travels in the
returned state, as in `dispatch.py`).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .dispatch import _all_to_all, _record, _record_receive, _remote_bytes, _sort_pairs, agree_on_input
from .grouped_mm import GroupLayout
from .routing import RoutingError

__all__ = [
    "DISPATCHERS",
    "DeepEPExchange",
    "HybridEPDispatcher",
    "TokenDispatcher",
    "TokenExchange",
    "TorchTokenExchange",
    "dispatcher_problems",
]

# "torch": pairs over all_to_all_single (dispatch.py); "torch_token": the token-level protocol in plain torch;
# the others: the libraries. Upstream's BackendConfig names, plus "torch_token".
DISPATCHERS: tuple[str, ...] = ("torch", "torch_token", "deepep", "uccl_ep", "hybridep")
_LIBRARY = {"deepep": "deep_ep", "uccl_ep": "uccl_ep", "hybridep": "deep_ep"}
_INSTALL = {
    "deep_ep": "build DeepEP from source (https://github.com/deepseek-ai/DeepEP)",
    "uccl_ep": "`pip install uccl` (UCCL-EP)",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


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


@dataclass
class _TorchHandle:
    send_token: torch.Tensor  # [S]: the token of each sent row, rows grouped by destination rank
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


class TorchTokenExchange:
    """DeepEP's protocol over `all_to_all_single` on `group` (gloo or NCCL): a token goes once to each rank hosting
    one of its experts. Counts what it sends in `count_all_to_all_bytes` like the pair dispatcher."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _TorchHandle]:
        local = num_experts // self.ep
        ranks = torch.arange(self.ep, device=x.device)
        owner = torch.where(topk_idx >= 0, topk_idx // local, -1)  # [T, K]
        in_rank = (owner.unsqueeze(-1) == ranks).any(dim=1)  # [T, ep]
        dest, send_token = in_rank.t().nonzero(as_tuple=True)  # rows grouped by destination rank, tokens in order
        send_splits = in_rank.sum(dim=0).tolist()
        counts = torch.tensor(send_splits, dtype=torch.long, device=x.device)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_splits = recv_counts.tolist()
        here = owner[send_token] == dest.unsqueeze(-1)  # [S, K]: the k's this destination hosts
        send_idx = torch.where(here, topk_idx[send_token] - dest.unsqueeze(-1) * local, -1)
        rows = x[send_token]
        _record(dispatch_bytes=_remote_bytes(rows, send_splits, self.group))
        recv_x = _all_to_all(rows, recv_splits, send_splits, self.group)
        _record_receive(recv_x)
        recv_idx = _all_to_all(send_idx, recv_splits, send_splits, self.group)
        recv_w = _all_to_all(topk_weights[send_token], recv_splits, send_splits, self.group)
        return recv_x, recv_idx, recv_w, _TorchHandle(send_token, send_splits, recv_splits, x.shape[0])

    def combine(
        self, y: torch.Tensor, handle: _TorchHandle, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _record(combine_bytes=_remote_bytes(y, handle.recv_splits, self.group))
        back = _all_to_all(y, handle.send_splits, handle.recv_splits, self.group)
        out = y.new_zeros(handle.num_tokens, y.shape[1]).index_add_(0, handle.send_token, back)
        out_w = None
        if weights is not None:
            back_w = _all_to_all(weights, handle.send_splits, handle.recv_splits, self.group)
            out_w = weights.new_zeros(handle.num_tokens, weights.shape[1]).index_add_(0, handle.send_token, back_w)
        return out, out_w

    def dispatch_cached(self, x: torch.Tensor, handle: _TorchHandle) -> torch.Tensor:
        rows = x[handle.send_token]
        _record(backward_bytes=_remote_bytes(rows, handle.send_splits, self.group))
        return _all_to_all(rows, handle.recv_splits, handle.send_splits, self.group)


class DeepEPExchange:
    """DeepEP's normal (high-throughput) kernels: `Buffer.get_dispatch_layout`, `Buffer.dispatch`, `Buffer.combine`
    (and the cached-handle dispatch), imported from `module` on first use: "deep_ep", or "uccl_ep" for UCCL-EP's
    DeepEP-compatible `Buffer`. One communication buffer per exchange, sized by the library's size hints and grown
    when a larger hidden size needs it. Tokens must be bf16 (DeepEP's normal kernels); weights travel in fp32.

    num_sms: `Buffer.set_num_sms` (the SMs the kernels use; upstream's `dispatcher_num_sms`). async_dispatch:
    `async_finish` + `allocate_on_comm_stream`, the current stream waiting on the returned events (upstream's
    `dispatcher_async_dispatch`).
    """

    def __init__(
        self, group: dist.ProcessGroup, *, module: str = "deep_ep", num_sms: int = 20, async_dispatch: bool = False
    ) -> None:
        self.group, self.module, self.num_sms, self.async_dispatch = group, module, num_sms, async_dispatch
        self._buffer: Any = None

    def _lib(self) -> Any:
        return importlib.import_module(self.module)  # the CUDA extension loads here, on first use only

    def _get_buffer(self, hidden_bytes: int) -> Any:
        buffer_cls = self._lib().Buffer
        buffer_cls.set_num_sms(self.num_sms)
        size = dist.get_world_size(self.group)
        nvl = rdma = 0
        for config in (buffer_cls.get_dispatch_config(size), buffer_cls.get_combine_config(size)):
            nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, size))
            rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, size))
        current = self._buffer
        if current is None or current.num_nvl_bytes < nvl or current.num_rdma_bytes < rdma:
            self._buffer = buffer_cls(self.group, nvl, rdma)
        return self._buffer

    def _events(self) -> dict[str, Any]:
        if not self.async_dispatch:
            return {}
        utils = importlib.import_module(f"{self.module}.utils")
        return {
            "previous_event": utils.EventOverlap(utils.EventHandle()),
            "async_finish": True,
            "allocate_on_comm_stream": True,
        }

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        buffer = self._get_buffer(x.shape[1] * max(x.element_size(), 2))
        events = self._events()
        per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(
            topk_idx, num_experts, **events
        )
        if events:
            events["previous_event"] = event
        recv_x, recv_idx, recv_w, _, handle, after = buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights.float(),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            **events,
        )
        if events:
            after.current_stream_wait()
        return recv_x, recv_idx, recv_w, handle

    def combine(
        self, y: torch.Tensor, handle: Any, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        buffer = self._get_buffer(y.shape[1] * max(y.element_size(), 2))
        events = self._events()
        out, out_w, after = buffer.combine(
            y.contiguous(), handle, topk_weights=None if weights is None else weights.float(), **events
        )
        if events:
            after.current_stream_wait()
        return out, out_w

    def dispatch_cached(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        buffer = self._get_buffer(x.shape[1] * max(x.element_size(), 2))
        events = self._events()
        recv_x, *_, after = buffer.dispatch(x.contiguous(), handle=handle, **events)
        if events:
            after.current_stream_wait()
        return recv_x


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


class TokenDispatcher:
    """Experts sharded over `group` (rank r owns experts `[r * E / ep, (r + 1) * E / ep)`), tokens moved by a
    `TokenExchange` (DeepEP's protocol). The `GroupedExperts` dispatcher interface: dispatch -> rows grouped by local
    expert; combine -> `[T, H]`. Routing weights are applied on the experts' rank (the libraries sum there)."""

    def __init__(self, group: dist.ProcessGroup, exchange: TokenExchange, *, name: str) -> None:
        self.group, self.exchange, self.name = group, exchange, name
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
    ) -> tuple[torch.Tensor, GroupLayout, TokenState]:
        del host_sizes  # the received counts reach the host anyway (grouped GEMM sizes)
        if top_k_weights is None:
            raise RoutingError(f"dispatcher {self.name!r} applies the routing weights on the experts' rank: pass them")
        problems = problems + _library_dtype_problems(self.name, hidden_states)
        if problems:  # malformed shapes: still join the header exchange so every rank raises
            counts = torch.zeros(num_experts + 2, dtype=torch.long, device=hidden_states.device)
        else:
            counts = _sort_pairs(top_k_index, token_mask, num_experts)[2]
        agree_on_input(counts, problems, self.group, num_experts=num_experts)
        idx, weights = _masked_routing(top_k_index, top_k_weights, token_mask)
        box: dict[str, Any] = {"num_experts": num_experts}
        recv_x, recv_idx, recv_w = _Dispatch.apply(hidden_states, weights, idx, self.exchange, box)
        local = num_experts // self.ep_size
        rows, sizes, pair_rows, row_weights = _permute(recv_x, recv_idx, recv_w, local)
        ends = torch.tensor(sizes, dtype=torch.int64, device=rows.device).cumsum(0).to(torch.int32)
        state = TokenState(
            counts[:num_experts], box["handle"], recv_x.shape[0], idx.shape[1], pair_rows, row_weights, self.exchange
        )
        return rows, GroupLayout(ends, sizes=sizes), state

    def combine(
        self,
        expert_out: torch.Tensor,
        state: TokenState,
        top_k_weights: torch.Tensor,
        *,
        out_dtype: torch.dtype,
        combine_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        """Expert rows `[n, H]` -> `[T, H]`: weighted on this rank, summed per token, sent home and summed there."""
        del top_k_weights  # already applied on the experts' rank (they travelled with the tokens)
        dtype = combine_dtype if combine_dtype is not None else expert_out.dtype
        # the exchange moves rows in the experts' dtype (bf16 for DeepEP): the per-rank partial sums round there
        per_token = _unpermute(expert_out, state, dtype, expert_out.dtype)
        return _Combine.apply(per_token, state.exchange, state.handle).to(out_dtype)


class _HybridDispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, hybrid: HybridEPDispatcher, box: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = hybrid.buffer(x, box["local"])
        rows, row_probs, _, tokens_per_expert, handle = buffer.dispatch_with_permute(
            hidden=x,
            routing_map=routing_map,
            probs=probs,
            scaling_factor=None,
            num_of_experts_per_rank=box["local"],
            pad_multiple=None,
            num_permuted_tokens=None,
            non_blocking=False,
        )
        ctx.buffer, ctx.handle = buffer, handle
        box["handle"], box["sizes"] = handle, [int(n) for n in tokens_per_expert.tolist()]
        return rows, row_probs

    @staticmethod
    def backward(ctx: Any, g_rows: torch.Tensor, g_probs: torch.Tensor | None) -> tuple[Any, ...]:
        g_x, g_p = ctx.buffer.combine_with_unpermute(
            hidden=g_rows.contiguous(), probs=g_probs, handle=ctx.handle, pad_multiple=None
        )
        return g_x, g_p, None, None, None


class _HybridCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, buffer: Any, handle: Any) -> torch.Tensor:
        ctx.buffer, ctx.handle = buffer, handle
        out, _ = buffer.combine_with_unpermute(hidden=rows, handle=handle, pad_multiple=None)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, *_ = ctx.buffer.dispatch_with_permute(
            hidden=grad.contiguous(), scaling_factor=None, handle=ctx.handle, pad_multiple=None
        )
        return rows, None, None


@dataclass
class HybridState:
    counts: torch.Tensor
    handle: Any
    row_weights: torch.Tensor
    buffer: Any


class HybridEPDispatcher:
    """HybridEP (`deep_ep.HybridEPBuffer`): the library permutes received tokens into local-expert groups itself
    (`dispatch_with_permute`, one row per (token, local expert), with its probability) and sums them back
    (`combine_with_unpermute`). Validation, padding, weighting and the autograd rule are this module's (see top).

    num_sms: `num_sms_dispatch_api` and `num_sms_combine_api` of the buffer (upstream's `dispatcher_num_sms`).
    """

    def __init__(self, group: dist.ProcessGroup, *, num_sms: int = 20) -> None:
        self.group, self.num_sms, self.name = group, num_sms, "hybridep"
        self.ep_size = dist.get_world_size(group)
        self._buffer: Any = None
        self._capacity = (0, 0, 0)

    def buffer(self, x: torch.Tensor, local: int) -> Any:
        tokens, hidden = x.shape
        if self._buffer is None or tokens > self._capacity[0] or (hidden, local) != self._capacity[1:]:
            lib = importlib.import_module("deep_ep")  # HybridEP ships in DeepEP's package; CUDA loads here
            sms = {"num_sms_dispatch_api": self.num_sms, "num_sms_combine_api": self.num_sms}
            self._buffer = lib.HybridEPBuffer(
                group=self.group,
                hidden_dim=hidden,
                max_num_of_tokens_per_rank=tokens,
                num_local_experts=local,
                use_fp8=False,
                **sms,
            )
            self._capacity = (tokens, hidden, local)
        return self._buffer

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
    ) -> tuple[torch.Tensor, GroupLayout, HybridState]:
        del host_sizes
        if top_k_weights is None:
            raise RoutingError("dispatcher 'hybridep' applies the routing weights on the experts' rank: pass them")
        problems = problems + _library_dtype_problems(self.name, hidden_states)
        if problems:
            counts = torch.zeros(num_experts + 2, dtype=torch.long, device=hidden_states.device)
        else:
            counts = _sort_pairs(top_k_index, token_mask, num_experts)[2]
        agree_on_input(counts, problems, self.group, num_experts=num_experts)
        idx, weights = _masked_routing(top_k_index, top_k_weights, token_mask)
        valid = idx >= 0
        slot = idx.clamp(min=0)
        tokens = hidden_states.shape[0]
        routing_map = torch.zeros(tokens, num_experts, dtype=torch.bool, device=idx.device).scatter(1, slot, valid)
        probs = torch.zeros(tokens, num_experts, dtype=torch.float32, device=idx.device).scatter(
            1, slot, torch.where(valid, weights.float(), 0.0)
        )
        box: dict[str, Any] = {"local": num_experts // self.ep_size}
        rows, row_probs = _HybridDispatch.apply(hidden_states, probs, routing_map, self, box)
        sizes = box["sizes"]
        ends = torch.tensor(sizes, dtype=torch.int64, device=rows.device).cumsum(0).to(torch.int32)
        state = HybridState(counts[:num_experts], box["handle"], row_probs, self._buffer)
        return rows, GroupLayout(ends, sizes=sizes), state

    def combine(
        self,
        expert_out: torch.Tensor,
        state: HybridState,
        top_k_weights: torch.Tensor,
        *,
        out_dtype: torch.dtype,
        combine_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        del top_k_weights  # applied here, on the experts' rank (the probabilities travelled with the rows)
        dtype = combine_dtype if combine_dtype is not None else expert_out.dtype
        weighted = (expert_out.to(dtype) * state.row_weights.to(dtype).unsqueeze(-1)).to(expert_out.dtype)
        return _HybridCombine.apply(weighted, state.buffer, state.handle).to(out_dtype)


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
    from .dispatch import AllToAllDispatcher

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
