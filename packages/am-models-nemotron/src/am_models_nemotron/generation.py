"""Generation support of `NemotronHForCausalLM`: transformers' `GenerationMixin` with the Nemotron-H hooks.

What it is for: `NemotronHGenerationMixin`, the `GenerationMixin` the causal LM derives from, holding the hooks
transformers' `generate` calls: `prepare_inputs_for_generation` (what each decoding step's forward receives: the whole
prompt and a fresh `NemotronHybridCache` first, then one token per step, with `cache_position` and the attention
layers' `causal_mask_mapping` as NeMo AutoModel returns them), `_reorder_cache` (beam search); `can_generate` and the
experts-implementation hooks come from am-model-io's `OwnCacheGenerationHooks`. `generation_inputs` is the same
step as a plain function.
What it must not do: hand transformers' own cache classes to the model (the Mamba layers need conv windows and SSM
states), pass packing inputs while generating (a packed row cannot continue from a cache), or build a mask that lets
a token see padding or the future (the mask is the one the forward would build from `attention_mask`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin

from am_model_io import OwnCacheGenerationHooks

from .attention import build_attention_mask
from .cache import NemotronHybridCache

__all__ = ["NemotronHGenerationMixin", "generation_inputs", "make_causal_mask"]


def make_causal_mask(
    *,
    batch_size: int,
    query_length: int,
    past_length: int,
    attention_mask: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive attention mask [B, 1, q, past + q] in `dtype`: 0 where a query may attend, -inf elsewhere.

    Without padding: -inf strictly above the diagonal for a prefill, all zeros [B, 1, 1, kv] for a one-token decode
    step (NeMo AutoModel's `_make_causal_mask`). attention_mask: [B, past + q] 1/0; padded keys are hidden too (a
    query whose every key is padding keeps its causal keys, so no row is all -inf).
    """
    allowed = build_attention_mask(
        batch_size=batch_size,
        query_length=query_length,
        past_length=past_length,
        attention_mask=attention_mask,
        device=device,
    )
    if allowed is None:  # plain causal attention (build_attention_mask leaves it to SDPA's is_causal)
        query_pos = torch.arange(query_length, device=device)[:, None] + past_length
        causal = torch.arange(past_length + query_length, device=device)[None, :] <= query_pos
        allowed = causal[None, None].expand(batch_size, 1, query_length, past_length + query_length)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, float("-inf"))


def generation_inputs(
    model: Any,
    input_ids: torch.Tensor,
    *,
    past_key_values: Any,
    attention_mask: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    cache_position: torch.Tensor | None = None,
    use_cache: bool = True,
) -> dict[str, Any]:
    """The forward's inputs for one decoding step of `model` (a `NemotronHForCausalLM`: `nemotron_config`, `dtype`).

    input_ids: [B, S] all tokens so far (generated tokens only when the prompt came as `inputs_embeds`).
    First call (the cache has no state): the whole prompt (`inputs_embeds` [B, P, H] when given, else `input_ids`),
    a fresh `NemotronHybridCache` in place of any other cache, `cache_position = arange(P)`. Later calls: only the
    last token with `cache_position = [tokens cached]` (a longer `cache_position` is trimmed to its last element).
    Always: `causal_mask_mapping = {"full_attention": make_causal_mask(...)}` [B, 1, q, kv], `use_cache`,
    `attention_mask`, and `logits_to_keep=1` (only the last position's logits are needed).
    """
    if not isinstance(past_key_values, NemotronHybridCache):
        batch = (inputs_embeds if inputs_embeds is not None else input_ids).shape[0]
        device = (inputs_embeds if inputs_embeds is not None else input_ids).device
        past_key_values = NemotronHybridCache(model.nemotron_config, batch, model.dtype, device)
    model_inputs: dict[str, Any] = {
        "attention_mask": attention_mask,
        "past_key_values": past_key_values,
        "use_cache": use_cache,
        "logits_to_keep": 1,
    }
    if past_key_values.has_previous_state:
        past = past_key_values.get_seq_length()
        step = input_ids[:, -1:]
        model_inputs["input_ids"] = step
        if cache_position is not None and cache_position.numel() > 1:
            cache_position = cache_position[-1:]
        if cache_position is None:
            cache_position = torch.tensor([past], device=step.device)
        batch, query, device = step.shape[0], 1, step.device
    else:
        past = 0
        prompt = inputs_embeds if inputs_embeds is not None else input_ids
        model_inputs["inputs_embeds" if inputs_embeds is not None else "input_ids"] = prompt
        batch, query, device = prompt.shape[0], prompt.shape[1], prompt.device
        cache_position = torch.arange(query, device=device)
    model_inputs["cache_position"] = cache_position
    model_inputs["causal_mask_mapping"] = {
        "full_attention": make_causal_mask(
            batch_size=batch,
            query_length=query,
            past_length=past,
            attention_mask=attention_mask,
            dtype=model.dtype,
            device=device,
        )
    }
    return model_inputs


class NemotronHGenerationMixin(OwnCacheGenerationHooks, GenerationMixin):
    """transformers' `GenerationMixin` with Nemotron-H's hooks (`generate` runs through `NemotronHybridCache`;
    `can_generate` and the experts-implementation hooks are am-model-io's `OwnCacheGenerationHooks`).

    The class using it provides `nemotron_config`, `dtype` and a forward that accepts `past_key_values`,
    `cache_position`, `causal_mask_mapping` and `logits_to_keep`.
    """

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """GenerationMixin hook: False, so `generate` creates no `DynamicCache` of its own (whose `get_seq_length`
        fails without attention layers); `prepare_inputs_for_generation` creates the `NemotronHybridCache`."""
        return False

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        past_key_values: Any = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = None,
        *,
        cache_position: torch.Tensor | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The inputs of one decoding step (`generation_inputs`): `input_ids` (or the prompt's `inputs_embeds` on the
        first step), `past_key_values`, `cache_position`, `causal_mask_mapping`, `attention_mask`, `use_cache`.

        `next_sequence_length` / `is_first_iteration` (transformers >= 5.20) need no handling: the cache's
        `has_previous_state` decides between the prompt and the last token. Other keyword arguments (generation
        options transformers forwards) are not model inputs and are dropped.
        """
        del next_sequence_length, is_first_iteration, kwargs
        return generation_inputs(
            self,
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            cache_position=cache_position,
            use_cache=use_cache,
        )

    def _reorder_cache(self, past_key_values: NemotronHybridCache, beam_idx: torch.LongTensor) -> NemotronHybridCache:
        past_key_values.reorder_cache(beam_idx)
        return past_key_values
