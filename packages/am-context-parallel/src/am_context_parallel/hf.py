"""HuggingFace transformers integration: run an HF model's attention as the ring while a CP context is active.

What it is for: an attention function in transformers' registry (`AttentionInterface`, name `am_cp_ring`) that
calls `ring_attention` with the positions and document ids of the active `RingAttentionContext`, and
`routed_model_attention`, which the context uses to make ONE model's blocks name it as their attention
implementation while it is open — so `make_cp_batch_and_ctx(mesh, batch, model=model)` + `with ctx():` is all a
trainer needs for HF models whose attention dispatches through the registry (`coverage.py` checks that it does).
What it must not do: import transformers at import time (it is not a dependency of this package): the registry is
only touched when a model with an HF config is routed, so transformers is loaded; or change anything process-wide
(no existing registry name is replaced: the swap of `sdpa`/`eager` that upstream's torch-style entry points need
lives in `upstream.py`). Flash/flex implementations are not routed (`coverage.cp_attention_problems` refuses them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .context import current_ring_context

__all__ = ["RING_ATTENTION_NAME", "hf_ring_attention_forward", "register_ring_attention", "routed_model_attention"]

RING_ATTENTION_NAME = "am_cp_ring"


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
def routed_model_attention(configs: list[Any]) -> Iterator[None]:
    """While open, these HF configs (a model's, see `coverage.attention_blocks`) name the ring as their attention
    implementation; restored on exit. Nothing process-wide changes: the ring's name is registered once in
    transformers' `AttentionInterface` (a new name, no existing one is replaced), and a model with another config
    keeps its own attention. HF builds no mask for the ring's name (none is registered for it)."""
    if not configs:
        yield
        return
    register_ring_attention()
    saved = [config._attn_implementation_internal for config in configs]
    try:
        for config in configs:
            # the internal field, not the setter: the setter recurses into sub-configs (a vision tower's) too
            config._attn_implementation_internal = RING_ATTENTION_NAME
        yield
    finally:
        for config, previous in zip(configs, saved, strict=True):
            config._attn_implementation_internal = previous
