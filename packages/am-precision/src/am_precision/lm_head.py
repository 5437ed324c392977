"""Language-model head projection with slicing, THD layout and dtype handling.

What it is for: `compute_lm_head_logits`, the last step of a causal LM forward: keep only the positions that need
logits, run the head in the right dtype (FSDP2 mixed-precision param dtype, or fp32 for an fp32 head), and wrap
the result in transformers' `CausalLMOutputWithPast`.
What it must not do: import transformers at import time (it is the optional `hf` extra), or slice with
`slice(0, None)` when all positions are kept (unsupported on DTensors under tensor + sequence parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["compute_lm_head_logits"]


def _causal_lm_output_cls() -> Any:
    try:
        from transformers.modeling_outputs import CausalLMOutputWithPast
    except ImportError as err:
        raise ImportError(
            "compute_lm_head_logits returns transformers' CausalLMOutputWithPast; install the 'hf' extra: "
            f"`pip install am-precision[hf]`. Import failed: {err}"
        ) from err
    return CausalLMOutputWithPast


def _head_compute_dtype(lm_head: nn.Module) -> torch.dtype | None:
    """The FSDP2 mixed-precision `param_dtype` of `lm_head`, else its weight's dtype (None: neither)."""
    # FSDP2 exposes no public getter for its policy; read it defensively so a torch change degrades to the
    # weight dtype instead of failing.
    get_state = getattr(lm_head, "_get_fsdp_state", None)
    policy = getattr(get_state(), "_mp_policy", None) if get_state is not None else None
    fsdp_dtype = getattr(policy, "param_dtype", None)
    if fsdp_dtype is not None:
        return fsdp_dtype
    weight = getattr(lm_head, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else None


def _keep_positions(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(logits_to_keep, torch.Tensor):
        index: Any = logits_to_keep
    elif isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool) and logits_to_keep >= 0:
        if logits_to_keep == 0:
            return hidden_states
        index = slice(-logits_to_keep, None)
    else:
        raise ValueError(
            f"logits_to_keep must be 0 (all positions), a positive int (last k positions) or an index tensor, "
            f"got {logits_to_keep!r}"
        )
    if hidden_states.dim() == 2:
        return hidden_states[index]
    if hidden_states.dim() == 3:
        return hidden_states[:, index, :]
    raise ValueError(f"hidden_states must be [T, H] (packed) or [B, S, H], got shape {tuple(hidden_states.shape)}")


def compute_lm_head_logits(
    lm_head: nn.Module | None,
    hidden_states: torch.Tensor,
    logits_to_keep: int | torch.Tensor = 0,
    is_thd: bool = False,
    fp32_lm_head: bool = False,
    output_hidden_states: bool = False,
) -> Any:
    """Project hidden states to vocabulary logits and wrap them in `CausalLMOutputWithPast`.

    hidden_states: [B, S, H] or packed [T, H] -> logits: [B, S_kept, V] or [T_kept, V] ([1, T_kept, V] when
    `is_thd`). Without a head (a non-final pipeline stage) `logits` is `hidden_states` itself.

    Args:
        lm_head: the output projection, or None to pass hidden states through.
        hidden_states: final hidden states.
        logits_to_keep: 0 keeps all positions; k > 0 keeps the last k; a tensor selects positions by index
            (dim 0 of [T, H], dim 1 of [B, S, H]).
        is_thd: packed (THD) layout: 2-D results gain a leading batch dim of 1 (3-D results are left alone).
        fp32_lm_head: run the head on an fp32 input (the head must hold fp32 weights, e.g. pinned by
            `_keep_in_fp32_modules_strict`) and cast the logits back to `hidden_states.dtype`.
        output_hidden_states: also return `hidden_states` (with the same THD unsqueeze) in the output.

    Returns:
        `CausalLMOutputWithPast(logits=..., hidden_states=... or None)`.

    Raises:
        ImportError: transformers is not installed (`pip install am-precision[hf]`).
        ValueError: `logits_to_keep` is negative or not int/tensor; `hidden_states` is not 2-D or 3-D.
    """
    output_cls = _causal_lm_output_cls()
    if lm_head is None:
        logits = hidden_states
    else:
        kept = _keep_positions(hidden_states, logits_to_keep)
        if fp32_lm_head:
            logits = lm_head(kept.float()).to(hidden_states.dtype)
        else:
            compute_dtype = _head_compute_dtype(lm_head)
            logits = lm_head(kept if compute_dtype is None else kept.to(compute_dtype))
    returned_hidden = hidden_states if output_hidden_states else None
    if is_thd:
        if logits.dim() == 2:
            logits = logits.unsqueeze(0)
        if returned_hidden is not None and returned_hidden.dim() == 2:
            returned_hidden = returned_hidden.unsqueeze(0)
    return output_cls(logits=logits, hidden_states=returned_hidden)
