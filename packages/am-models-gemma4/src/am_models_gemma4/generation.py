"""`generate()` for the Gemma 4 models: transformers' `GenerationMixin` driving our `Gemma4HybridCache`.

What it is for: `model.generate(input_ids, attention_mask=..., max_new_tokens=..., do_sample=...)` as transformers
users call it (greedy, sampling, beam search; logits processors, stopping criteria and streamers are
transformers'), on `Gemma4ForCausalLM` and `Gemma4ForConditionalGeneration`. Where transformers would make its own
cache, `_prepare_cache_for_generation` makes a `Gemma4HybridCache`; `prepare_inputs_for_generation` hands the whole
prompt over first (the prefill, or its chunks with `prefill_chunk_size`), then the last token of every step with its
position (transformers derives positions from the attention mask, so left-padded rows count from their first real
token) and the attention mask over every token so far.
What it must not do: run in a training forward (nothing here is called outside `generate`), or accept a
transformers cache (`DynamicCache` lays K/V out differently; refused with a TypeError rather than ignored).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL, GenerationMode

from am_model_io import OwnCacheGenerationHooks

from .cache import Gemma4HybridCache

__all__ = ["Gemma4GenerationMixin"]


class Gemma4GenerationMixin(OwnCacheGenerationHooks, GenerationMixin):
    """transformers' `GenerationMixin` with the hooks a plain `nn.Module` must provide, and our cache
    (`can_generate`, `device`, `dtype` and the experts-implementation hooks: am-model-io's
    `OwnCacheGenerationHooks`).

    The model class calls `_init_generation_config(config)` in its `__init__`.
    """

    main_input_name: ClassVar[str] = "input_ids"
    # The cache cannot be rolled back (no `crop`): transformers then refuses assisted decoding instead of running it.
    _is_stateful: ClassVar[bool] = True
    # Inputs that describe the prompt only (besides transformers' list): dropped after the prefill.
    _prefill_only_inputs: ClassVar[tuple[str, ...]] = ()
    config: Any
    generation_config: GenerationConfig

    def _init_generation_config(self, config: Any) -> None:
        """`generation_config` from the model config (bos/eos/pad ids), as transformers' models build theirs."""
        self.generation_config = GenerationConfig.from_model_config(config)

    def _prepare_cache_for_generation(
        self,
        generation_config: GenerationConfig,
        model_kwargs: dict[Any, Any],
        generation_mode: GenerationMode,
        batch_size: int,
        max_cache_length: int,
    ) -> bool:
        """transformers' hook: put a new `Gemma4HybridCache` into `model_kwargs` (instead of a `DynamicCache`).

        Raises:
            TypeError: the caller passed another kind of cache.
            ValueError: `cache_implementation` asks for a cache this model does not have (e.g. "static").
        """
        cache = model_kwargs.get("past_key_values")
        if cache is None and generation_config.use_cache:
            if generation_config.cache_implementation not in (None, "dynamic"):
                raise ValueError(
                    f"cache_implementation={generation_config.cache_implementation!r} is not available for "
                    f"{type(self).__name__}: it generates with its own Gemma4HybridCache (full layers keep every "
                    "token, sliding layers their window); leave cache_implementation unset"
                )
            model_kwargs["past_key_values"] = Gemma4HybridCache(self.config, max_length=max_cache_length)
            return False
        if cache is not None and not isinstance(cache, Gemma4HybridCache):
            raise TypeError(
                f"past_key_values is a {type(cache).__name__}; {type(self).__name__} generates with a "
                "Gemma4HybridCache (pass none and generate() makes one, or pass Gemma4HybridCache(model.config))"
            )
        # transformers' checks of a cache passed by the caller (it is ours here), or nothing without use_cache
        return super()._prepare_cache_for_generation(  # type: ignore[misc]
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        past_key_values: Any = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The forward's inputs for one step: the prompt first (or `inputs_embeds`), then the last
        `next_sequence_length` tokens with their positions; the attention mask over every token so far; the cache.

        Inputs transformers lists as prefill-only (`pixel_values`, ...) and the keys of `_prefill_only_inputs` are
        passed on the first iteration only (or on every step without a cache, which recomputes the whole sequence).
        """
        use_cache = kwargs.get("use_cache", True)
        inputs: dict[str, Any] = {"past_key_values": past_key_values, "attention_mask": attention_mask}
        if inputs_embeds is not None and is_first_iteration:
            embeds = inputs_embeds[:, -next_sequence_length:] if next_sequence_length else inputs_embeds
            inputs.update(input_ids=None, inputs_embeds=embeds)
            length = embeds.shape[1]
        else:
            ids = input_ids[:, -next_sequence_length:] if next_sequence_length else input_ids
            inputs["input_ids"] = ids
            length = ids.shape[1]
        position_ids = kwargs.pop("position_ids", None)
        if position_ids is not None:
            inputs["position_ids"] = position_ids[..., -length:]
        prefill_only = set(MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL) | set(self._prefill_only_inputs)
        for key, value in kwargs.items():
            if key in ("labels", "next_sequence_length"):
                continue
            if key in prefill_only and not is_first_iteration and use_cache:
                continue
            inputs[key] = value
        return inputs
