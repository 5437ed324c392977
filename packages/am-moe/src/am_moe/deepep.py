"""`DeepEPExchange`: the "deepep" and "uccl_ep" dispatchers' exchange, DeepEP's normal (high-throughput) kernels.

What it is for: the library part of `token_dispatch.TokenDispatcher` for DeepEP (`deep_ep.Buffer`) and UCCL-EP, whose
`uccl_ep.Buffer` has DeepEP's API: `Buffer.get_dispatch_layout`, `Buffer.dispatch` (with and without a cached
handle), `Buffer.combine`, with `dispatcher_num_sms` (`Buffer.set_num_sms`) and `dispatcher_async_dispatch`
(`async_finish` + `allocate_on_comm_stream`). Validation, padding, permutation, weighting and autograd are
`token_dispatch`'s, shared with the plain-torch exchange that tests them.
What it must not do: import the library before the first exchange (it needs CUDA), or fall back to another exchange.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DeepEPExchange"]


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

    def _get_buffer(self, x: torch.Tensor) -> Any:
        """The communication buffer, (re)built large enough for rows like `x`'s `[*, H]` (sized as bf16 at least)."""
        hidden_bytes = x.shape[1] * max(x.element_size(), 2)
        buffer_cls = importlib.import_module(self.module).Buffer  # the CUDA extension loads here, on first use only
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
        buffer, events = self._get_buffer(x), self._events()
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
        buffer, events = self._get_buffer(y), self._events()
        out, out_w, after = buffer.combine(
            y.contiguous(), handle, topk_weights=None if weights is None else weights.float(), **events
        )
        if events:
            after.current_stream_wait()
        return out, out_w

    def dispatch_cached(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        buffer, events = self._get_buffer(x), self._events()
        recv_x, *_, after = buffer.dispatch(x.contiguous(), handle=handle, **events)
        if events:
            after.current_stream_wait()
        return recv_x
