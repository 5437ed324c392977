"""Generation support of `NemotronHForCausalLM` through transformers' `GenerationMixin`.

What it is for: `generation_inputs`, what the model's `prepare_inputs_for_generation` returns (the whole prompt and
a fresh `NemotronHybridCache` first, then one token per step).
What it must not do: hand transformers' own cache classes to the model (the Mamba layers need conv windows and SSM
states), or pass packing inputs while generating (a packed row cannot continue from a cache).
"""

from __future__ import annotations

from typing import Any

import torch

from .cache import NemotronHybridCache

__all__ = ["generation_inputs"]


def generation_inputs(
    model: Any,
    input_ids: torch.Tensor,
    *,
    past_key_values: Any,
    attention_mask: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
) -> dict[str, Any]:
    """The forward's inputs for one decoding step of `model` (a `NemotronHForCausalLM`, providing `nemotron_config`
    and `dtype`). First call: the whole prompt and a fresh `NemotronHybridCache` (replacing a transformers cache);
    later calls: only the last token. input_ids: [B, S] all tokens so far."""
    if not isinstance(past_key_values, NemotronHybridCache):
        past_key_values = NemotronHybridCache(model.nemotron_config, input_ids.shape[0], model.dtype, input_ids.device)
    model_inputs: dict[str, Any] = {
        "attention_mask": attention_mask,
        "past_key_values": past_key_values,
        "use_cache": True,
        "logits_to_keep": 1,
    }
    if past_key_values.has_previous_state:
        model_inputs["input_ids"] = input_ids[:, -1:]
    elif inputs_embeds is not None:
        model_inputs["inputs_embeds"] = inputs_embeds
    else:
        model_inputs["input_ids"] = input_ids
    return model_inputs
