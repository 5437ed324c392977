"""`TorchTokenExchange`: the token-level exchange of DeepEP's protocol in plain torch (`all_to_all_single`).

What it is for: the "torch_token" dispatcher of `apply_expert_parallel` and the reference the library exchanges are
tested against: a token goes once to every rank hosting at least one of its top-k experts, with its top-k indices
(local expert ids, -1 elsewhere) and weights; the combine sends one row back per (token, rank) and sums them. It runs
on any torch.distributed backend, gloo included, so the logic around the libraries (`token_dispatch.TokenDispatcher`)
is tested on the CPU.
What it must not do: add autograd (`token_dispatch`'s `_Dispatch` / `_Combine` do), or keep per-call state on itself
(the layout travels in the returned handle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .dispatch import _all_to_all, _record, _record_receive, _remote_bytes

__all__ = ["TorchTokenExchange"]


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
