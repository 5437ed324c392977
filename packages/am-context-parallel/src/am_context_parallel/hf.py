"""HuggingFace transformers integration: run an HF model's attention as the ring while a CP context is active.

What it is for: an attention function in transformers' registry (`AttentionInterface`, name `am_cp_ring`) that
calls `ring_attention` with the positions and document ids of the active `RingAttentionContext`, and
`routed_hf_attention`, which the context uses to send HF's `sdpa` and `eager` dispatch to it while it is open —
so `make_cp_batch_and_ctx` + `with ctx():` is all a trainer needs for HF Llama-style models.
What it must not do: import transformers at import time (it is not a dependency of this package): the registry is
only touched when transformers is already loaded, which it is whenever an HF model exists.

Scope of the routing: process-wide for the `sdpa`/`eager` names while a context is open (like torch's own
`context_parallel`, which swaps SDPA globally); other threads running HF attention outside a CP context at the
same time would fail loudly (no active context), never silently. Flash/flex implementations are not routed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .context import current_ring_context

__all__ = ["RING_ATTENTION_NAME", "hf_ring_attention_forward", "register_ring_attention", "routed_hf_attention"]

RING_ATTENTION_NAME = "am_cp_ring"
_ROUTED_NAMES = ("sdpa", "eager", RING_ATTENTION_NAME)
_MISSING = object()


def hf_ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-function signature; q/k/v `[B, heads, S_local, d]` → (`[B, S_local, heads, d]`, None).

    `attention_mask` (built by HF for the LOCAL tokens) is ignored: the ring masks with global positions and
    document ids. Causality comes from `is_causal` or `module.is_causal`; the window from `sliding_window`.

    Raises:
        RuntimeError: outside a `RingAttentionContext`.
        NotImplementedError: for attention dropout, logit soft-capping or attention sinks (`s_aux`).
    """
    del attention_mask  # local mask: meaningless for a sharded sequence
    ctx = current_ring_context()
    if ctx is None:
        raise RuntimeError(
            f"{type(module).__name__}: ring attention ('{RING_ATTENTION_NAME}') was called outside a context-parallel "
            "context; run forward and backward inside `with ctx():` (ctx from make_cp_batch_and_ctx), or set "
            "config._attn_implementation back to 'sdpa'"
        )
    if dropout:
        raise NotImplementedError(
            f"{type(module).__name__}: attention dropout {dropout} is not supported by ring attention; set "
            "attention_dropout=0 (or call model.eval())"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{type(module).__name__}: attention logit soft-capping is not supported")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            f"{type(module).__name__}: attention sinks (`s_aux`) are not supported by ring attention; train this "
            "model with cp=1"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out = ctx.attention(query, key, value, causal=causal, sliding_window=sliding_window, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_ring_attention() -> str:
    """Register `hf_ring_attention_forward` as `am_cp_ring` in transformers' AttentionInterface; returns the name.

    Set `model.config._attn_implementation = "am_cp_ring"` to use it outside the automatic routing; no mask
    function is registered for it, so HF builds no mask.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION_NAME, hf_ring_attention_forward)
    return RING_ATTENTION_NAME


@contextmanager
def routed_hf_attention() -> Iterator[None]:
    """While open, HF's `sdpa`, `eager` and `am_cp_ring` attention names all dispatch to the ring.

    A no-op when transformers has not been imported (no HF model can exist then).
    """
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is None:
        yield
        return
    mapping: dict[str, Any] = interface._global_mapping
    saved = {name: mapping.get(name, _MISSING) for name in _ROUTED_NAMES}
    for name in _ROUTED_NAMES:
        mapping[name] = hf_ring_attention_forward
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is _MISSING:
                mapping.pop(name, None)
            else:
                mapping[name] = previous
