"""The context that makes attention run as a ring over the CP group while a sharded batch is in use.

What it is for: `make_cp_batch_and_ctx` shards the batch itself (out of place) and returns a `RingAttentionContext`
— a factory like upstream's (`with ctx():` around forward AND backward). Entering it
  1. records, for this thread, the CP group and the global positions / document ids of the local tokens, and
  2. with `model=` and `route_hf_attention=True`: makes that model's blocks name the ring as their HF attention
     implementation for the duration (`hf.routed_model_attention`; HF builds no local mask for it), and counts the
     ring calls per block during the model's first forward (`coverage.AttentionCoverage`): a block that never
     called the ring raises instead of attending to this rank's tokens only.
Models that call attention themselves use `ctx.attention(q, k, v, ...)` or read `current_ring_context()`.
What it must not do: import transformers (hf.py does, lazily, only for a model that has an HF config), change
anything process-wide, or shard anything (batch.py did that).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .coverage import AttentionCoverage, hf_configs
from .kernels import AttentionKernel, select_kernel
from .layouts import Layout
from .model_protocol import model_cp_options
from .ring import attend
from .ring_setup import RingState

__all__ = ["RingAttentionContext", "current_ring_context"]

_CURRENT: ContextVar[RingAttentionContext | None] = ContextVar("am_context_parallel_ring", default=None)


def current_ring_context() -> RingAttentionContext | None:
    """The `RingAttentionContext` entered on this thread, or None outside one."""
    return _CURRENT.get()


class RingAttentionContext:
    """What attention needs to know about a sharded batch; call it to get the context manager.

    positions: `[S_local]` (or `[B, S_local]`) global positions of the local tokens; doc_ids: `[B, S_local]`
    document ids (0 = padding, never attended to) or None when every token is real and in one document.
    seq_len / padded_len: the batch's sequence length before and after CP padding (`unshard` trims to seq_len);
    checked against the layout and the positions (the layout keeps `len(layout.local_indices(padded_len))` tokens
    per rank), so a context is never built from another batch's positions.

    model: the model that runs inside the context. Unless it declares the contiguous layout (it owns its CP
    attention), its first forward inside the context must call the ring in every block of its layer stack
    (`coverage.py`; a RuntimeError names the blocks that did not). None: nothing is checked (a model calling
    `ctx.attention` itself, or upstream's model-less entry points). route_hf_attention: route `model`'s HF attention
    (its layer stack's configs) to the ring while entered; needs `model`.

    Raises:
        ValueError: when padded_len < seq_len, the positions do not hold the layout's number of local tokens, or
            `route_hf_attention=True` comes without a `model`, or a `model` that does not own its CP has no layer
            stack (see `coverage.attention_blocks`).
    """

    def __init__(
        self,
        *,
        group: Any,
        layout: Layout,
        positions: torch.Tensor,
        doc_ids: torch.Tensor | None,
        seq_len: int,
        padded_len: int,
        route_hf_attention: bool = False,
        kernel: AttentionKernel | None = None,
        model: nn.Module | None = None,
    ) -> None:
        local_tokens = layout.local_indices(padded_len).numel()
        if padded_len < seq_len or positions.shape[-1] != local_tokens:
            raise ValueError(
                f"RingAttentionContext: seq_len={seq_len}, padded_len={padded_len} and {layout!r} keep "
                f"{local_tokens} tokens per rank, but the positions hold {positions.shape[-1]}; pass this batch's "
                "lengths and positions (layout.local_indices(padded_len))"
            )
        if route_hf_attention and model is None:
            raise ValueError(
                "RingAttentionContext(route_hf_attention=True) routes ONE model's attention to the ring: pass "
                "model=model (nothing is routed process-wide)"
            )
        self.group = group
        self.layout = layout
        self.seq_len = seq_len
        self.padded_len = padded_len
        self.route_hf_attention = route_hf_attention
        self.kernel = kernel  # None: select_kernel(device); set e.g. FlashCPUAttentionKernel() for speed on the CPU
        # The ring's setup (gathers, plans, chunk masks), computed at the first attention call and reused by every
        # call of every layer, forward and backward.
        self._ring = RingState(group=group, positions=positions, doc_ids=doc_ids)
        self._auto_kernel: AttentionKernel | None = None
        self.model = model
        # A model that declares the contiguous layout owns its CP attention: routed when asked, never counted.
        owns_cp = model is not None and model_cp_options(model) is not None
        self._coverage = AttentionCoverage(model) if model is not None and not owns_cp else None
        routed = self._coverage.blocks if self._coverage is not None else [model] if model is not None else []
        self._routed_configs = hf_configs(routed) if route_hf_attention else []

    @property
    def positions(self) -> torch.Tensor:
        """`[S_local]` (or `[B, S_local]`) global positions of the local tokens (read-only: the ring caches them)."""
        return self._ring.positions

    @property
    def doc_ids(self) -> torch.Tensor | None:
        """`[B, S_local]` document ids of the local tokens, 0 = padding, or None (read-only: the ring caches them)."""
        return self._ring.doc_ids

    def __repr__(self) -> str:
        return (
            f"RingAttentionContext(layout={self.layout!r}, seq_len={self.seq_len}, padded_len={self.padded_len}, "
            f"local_tokens={self.positions.shape[-1]}, doc_ids={'yes' if self.doc_ids is not None else 'no'})"
        )

    @contextmanager
    def __call__(self) -> Iterator[RingAttentionContext]:
        """Activate ring attention for this thread (and HF attention dispatch) until exit."""
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if world != self.layout.cp_size:
            raise ValueError(
                f"the CP group has {world} ranks but the batch was sharded for {self.layout.cp_size} "
                f"({self.layout!r}); use the same CP mesh for sharding and attention"
            )
        token = _CURRENT.set(self)
        coverage = self._coverage
        try:
            if coverage is not None:
                coverage.attach()
            if self.route_hf_attention:
                from .hf import routed_model_attention

                with routed_model_attention(self._routed_configs):
                    yield self
            else:
                yield self
        except BaseException:
            if coverage is not None:
                coverage.detach()  # the propagating error is the news; no verdict on a broken forward
            raise
        else:
            if coverage is not None:
                coverage.close()
        finally:
            _CURRENT.reset(token)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        sliding_window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """`ring_attention` of local `[B, heads, S_local, d]` tensors with this batch's positions and doc ids.

        The first call gathers the header, positions and doc ids over the group; the first call of each
        (causal, sliding_window) builds its plan and chunk masks; every other call only moves K/V (and gradients).
        """
        if self._coverage is not None:
            self._coverage.record()
        kernel = self.kernel
        if kernel is None:
            if self._auto_kernel is None:
                self._auto_kernel = select_kernel(q.device)
            kernel = self._auto_kernel
        return attend(self._ring, q, k, v, causal=causal, sliding_window=sliding_window, scale=scale, kernel=kernel)

    def unshard(self, tensor: torch.Tensor, *, seq_dim: int = 1, trim: bool = True) -> torch.Tensor:
        """Gather a local `[..., S_local, ...]` tensor (e.g. logits) back to global order, padding trimmed."""
        return self.layout.unshard(tensor, seq_dim=seq_dim, group=self.group, seq_len=self.seq_len if trim else None)
