"""A stand-in for DeepEP's `deep_ep` module (which needs CUDA): `Buffer` with DeepEP's public signatures
(`set_num_sms`, `get_dispatch_config` / `get_combine_config` size hints, `get_dispatch_layout`, `dispatch` with and
without a cached handle, `combine`), computing DeepEP's semantics with am_moe's `TorchTokenExchange` on gloo. It lets
the multi-rank tests run `am_moe.DeepEPExchange` exactly as it calls the real library: a wrong keyword is a
TypeError here as there. It checks what DeepEP requires of its inputs (int64 indices, fp32 weights, the layout)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from am_moe import TorchTokenExchange


class _Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * 1024

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class Buffer:
    num_sms = 20
    created = 0

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0) -> None:
        self.group, self.num_nvl_bytes, self.num_rdma_bytes = group, num_nvl_bytes, num_rdma_bytes
        self.exchange = TorchTokenExchange(group)
        self.num_experts = 0
        Buffer.created += 1

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _Config:
        return _Config()

    @staticmethod
    def get_combine_config(num_ranks: int) -> _Config:
        return _Config()

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, None]:
        assert topk_idx.dtype == torch.int64
        ep = dist.get_world_size(self.group)
        owner = torch.where(topk_idx >= 0, topk_idx // (num_experts // ep), -1)
        in_rank = (owner.unsqueeze(-1) == torch.arange(ep)).any(dim=1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        self.num_experts = num_experts
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(
        self,
        x: torch.Tensor,
        handle: Any = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, ...]:
        if handle is not None:
            assert topk_idx is None
            assert topk_weights is None
            return self.exchange.dispatch_cached(x, handle), None, None, None, None, None
        assert num_tokens_per_rank is not None
        assert is_token_in_rank is not None
        assert num_tokens_per_expert is not None
        assert topk_idx is not None
        assert topk_weights is not None
        assert topk_weights.dtype == torch.float32
        recv_x, recv_idx, recv_w, new_handle = self.exchange.dispatch(x, topk_idx, topk_weights, self.num_experts)
        local = self.num_experts // dist.get_world_size(self.group)
        per_local = torch.bincount(recv_idx[recv_idx >= 0], minlength=local).tolist()
        return recv_x, recv_idx, recv_w, per_local, new_handle, None

    def combine(
        self,
        x: torch.Tensor,
        handle: Any,
        topk_weights: torch.Tensor | None = None,
        bias: Any = None,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        assert topk_weights is None or topk_weights.dtype == torch.float32
        out, out_w = self.exchange.combine(x, handle, topk_weights)
        return out, out_w, None
