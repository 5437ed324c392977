"""`HybridEPDispatcher`: the "hybridep" dispatcher, DeepEP's `HybridEPBuffer`, which permutes inside the library.

What it is for: `dispatch_with_permute` sends each token to the ranks of its experts and returns one row per (token,
local expert) grouped by local expert, with its routing probability; `combine_with_unpermute` sums them back per
token. `dispatcher_num_sms` sets the buffer's `num_sms_dispatch_api` / `num_sms_combine_api`. The validation of the
router outputs (every rank raises on any rank's bad input before a token moves), padding and the weighting on the
experts' rank are `token_dispatch`'s (`prepare_token_routing`); the autograd rule is the same as there: dispatch's
backward is a combine, combine's a dispatch with the cached handle.
What it must not do: import `deep_ep` before the first dispatch (it needs CUDA), or keep per-call state on the
dispatcher (it travels in `HybridState`), except the communication buffer, rebuilt when the shapes grow.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .grouped_mm import GroupLayout
from .token_dispatch import _TokenLevelDispatcher

__all__ = ["HybridEPDispatcher", "HybridState"]


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


class HybridEPDispatcher(_TokenLevelDispatcher[HybridState]):
    """HybridEP (`deep_ep.HybridEPBuffer`): the library permutes received tokens into local-expert groups itself
    (`dispatch_with_permute`, one row per (token, local expert), with its probability) and sums them back
    (`combine_with_unpermute`). Validation, padding, weighting and the autograd rule are this module's (see top).

    num_sms: `num_sms_dispatch_api` and `num_sms_combine_api` of the buffer (upstream's `dispatcher_num_sms`).
    """

    def __init__(self, group: dist.ProcessGroup, *, num_sms: int = 20) -> None:
        super().__init__(group, name="hybridep")
        self.num_sms = num_sms
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

    def _send(
        self, x: torch.Tensor, counts: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, GroupLayout, HybridState]:
        valid = idx >= 0
        slot = idx.clamp(min=0)
        tokens = x.shape[0]
        routing_map = torch.zeros(tokens, num_experts, dtype=torch.bool, device=idx.device).scatter(1, slot, valid)
        probs = torch.zeros(tokens, num_experts, dtype=torch.float32, device=idx.device).scatter(
            1, slot, torch.where(valid, weights.float(), 0.0)
        )
        box: dict[str, Any] = {"local": num_experts // self.ep_size}
        rows, row_probs = _HybridDispatch.apply(x, probs, routing_map, self, box)
        sizes = box["sizes"]
        state = HybridState(counts, box["handle"], row_probs, self._buffer)
        return rows, GroupLayout.from_sizes(sizes, device=rows.device), state

    def _combine(self, expert_out: torch.Tensor, state: HybridState, dtype: torch.dtype) -> torch.Tensor:
        # weighted here, on the experts' rank (the probabilities travelled with the rows)
        weighted = (expert_out.to(dtype) * state.row_weights.to(dtype).unsqueeze(-1)).to(expert_out.dtype)
        return _HybridCombine.apply(weighted, state.buffer, state.handle)
