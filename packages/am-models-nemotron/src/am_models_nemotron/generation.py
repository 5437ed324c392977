"""Generation support of `NemotronHForCausalLM` through transformers' `GenerationMixin`.

What it is for: `NemotronGenerationMixin` — `prepare_inputs_for_generation` (the whole prompt and a fresh
`NemotronHybridCache` first, then one token per step), cache reordering for beam search, and the hooks newer
transformers releases call.
What it must not do: hand transformers' own cache classes to the model (the Mamba layers need conv windows and SSM
states), or pass packing inputs while generating (a packed row cannot continue from a cache).
"""

from __future__ import annotations

from typing import Any

import torch

from .cache import NemotronHybridCache

__all__ = ["NemotronGenerationMixin"]


class NemotronGenerationMixin:
    """Generation hooks (the model provides `nemotron_config` and `dtype`)."""

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def get_experts_implementation(self) -> dict[str, str]:
        """GenerationMixin hook: our experts have one implementation, nothing to switch while decoding."""
        return {}

    def set_experts_implementation(self, implementation: Any) -> None:
        """GenerationMixin hook (no-op, see `get_experts_implementation`)."""

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        past_key_values: Any = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """First call: the whole prompt and a fresh `NemotronHybridCache` (replacing a transformers cache); later
        calls: only the last token."""
        if not isinstance(past_key_values, NemotronHybridCache):
            model: Any = self
            past_key_values = NemotronHybridCache(
                model.nemotron_config, input_ids.shape[0], model.dtype, input_ids.device
            )
        if past_key_values.has_previous_state:
            return {
                "input_ids": input_ids[:, -1:],
                "attention_mask": attention_mask,
                "past_key_values": past_key_values,
                "use_cache": True,
                "logits_to_keep": 1,
            }
        model_inputs: dict[str, Any] = {
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "use_cache": True,
            "logits_to_keep": 1,
        }
        if inputs_embeds is not None:
            model_inputs["inputs_embeds"] = inputs_embeds
        else:
            model_inputs["input_ids"] = input_ids
        return model_inputs

    def _reorder_cache(self, past_key_values: NemotronHybridCache, beam_idx: torch.LongTensor) -> NemotronHybridCache:
        past_key_values.reorder_cache(beam_idx)
        return past_key_values
