"""Make HuggingFace models pipeline-stage friendly: tensor-in / tensor-out forwards that tolerate pruned modules.

A pipeline stage keeps only some of the model's modules (the rest are `None`), receives hidden states in the
`input_ids` slot when it is not the first stage, and must return a plain tensor. The forwards here implement that
contract for HF causal LMs (Llama, Qwen3, Mistral, ...), the Gemma 4 text model and the Gemma 4 / Mistral 3 VLMs,
using transformers 5.x names (`past_key_values`, `inputs_embeds`). Causal masks are built once per stage and reused
(`_build_or_reuse_pp_causal_mask`).

This module never imports a model package of this repository and never touches torch pipelining internals.
transformers is imported lazily inside the functions that need it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from am_pipelining._compat import bind_method, is_reentrant_checkpoint_wrapper

__all__ = [
    "TEXT_MODULE_ATTRS",
    "MULTIMODAL_SUFFIXES",
    "get_text_module",
    "create_pipeline_forward_inner",
    "create_pipeline_forward_causal_lm",
    "create_pipeline_forward_gemma4_text",
    "create_pipeline_forward_gemma4_vlm",
    "create_pipeline_forward_mistral3_vlm",
    "patch_hf_model_for_pp",
    "init_hf_model_buffers",
    "model_keeps_self_forward",
    "validate_hf_model_for_pipeline_support",
]

TEXT_MODULE_ATTRS: tuple[str, ...] = ("language_model", "text_model", "text_decoder")
"""Attribute names of a nested text backbone, in lookup order."""

MULTIMODAL_SUFFIXES: tuple[str, ...] = (
    "vision_tower",
    "visual",
    "vision_model",
    "image_encoder",
    "vision_encoder",
    "embed_vision",
    "audio_tower",
    "audio_encoder",
    "audio_model",
    "mm_projector",
    "multi_modal_projector",
    "multimodal_projector",
    "vision_projector",
    "vit_large_projector",
    "audio_projector",
)
"""Encoder / projector attribute names that live on the first pipeline stage."""

_PP_VLM_MODEL_TYPES_WITH_DEDICATED_FORWARD = ("gemma4", "mistral3")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def get_text_module(model: nn.Module | None) -> nn.Module | None:
    """The nested text backbone of a multimodal model (`language_model`, ...), else the model itself."""
    if model is None:
        return None
    for attr in TEXT_MODULE_ATTRS:
        candidate = getattr(model, attr, None)
        if isinstance(candidate, nn.Module):
            return candidate
    return model


def model_keeps_self_forward(model: nn.Module) -> bool:
    """True when the model class declares its own forward PP-aware (`_pp_keep_self_forward = True`)."""
    return bool(getattr(type(model), "_pp_keep_self_forward", False))


def _config_of(module: Any) -> Any:
    return getattr(module, "config", None)


def _text_config(config: Any) -> Any:
    text_config = getattr(config, "text_config", None)
    return text_config if text_config is not None else config


# ------------------------------------------------------------------------------------------------------------
# Causal masks, built once per stage
# ------------------------------------------------------------------------------------------------------------


def _layer_items(text_module: nn.Module) -> list[tuple[int, nn.Module]]:
    """(global layer index, layer) pairs of a ModuleList or of a pruned ModuleDict keyed by the original index."""
    layers = getattr(text_module, "layers", None)
    if layers is None:
        return []
    if isinstance(layers, nn.ModuleDict):
        return [(int(key), layer) for key, layer in layers.items()]
    return list(enumerate(layers))


def _layer_attention_type(config: Any, index: int, layer: nn.Module) -> str:
    """Mask kind a decoder layer needs: "full_attention" or "sliding_attention" (or any `layer_types` entry)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and 0 <= index < len(layer_types):
        return str(layer_types[index])
    for attr in ("attention_type", "layer_type"):
        value = getattr(layer, attr, None)
        if isinstance(value, str):
            return value
    # Mistral-style configs slide every layer when `sliding_window` is set and there is no per-layer list.
    if layer_types is None and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _is_packed(position_ids: torch.Tensor | None) -> bool:
    """True when position ids restart inside a row (several sequences packed in one row).

    Only caller-given position ids are checked (the forwards pass None for their default `arange`): the check reads
    the tensor's values, which is a device synchronisation on a GPU.
    """
    if position_ids is None or position_ids.dim() < 2 or position_ids.shape[-1] < 2:
        return False
    return bool((torch.diff(position_ids, dim=-1) != 1).any())


def _build_or_reuse_pp_causal_mask(
    module: nn.Module,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | dict | None,
    cache_position: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    mask_types: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Mask mapping {"full_attention": ..., "sliding_attention": ...} for the layers of this stage.

    Built once per (batch, seq_len, dtype, device, mask kinds) and cached on `module._pp_causal_mask_cache` when
    no attention mask is given and the positions are not packed — the case of fixed-length training and of every
    non-first stage. With an explicit `attention_mask` (padding) or packed `position_ids` it is rebuilt on every
    call. `module._pp_mask_builds` counts the builds and `module._pp_mask_build_seconds` sums their time (tests
    and the benchmark read them).

    inputs_embeds: [B, S, H]; attention_mask: [B, S] or an already built mapping (returned unchanged).
    `cache_position` is accepted for signature compatibility and unused (training has no KV cache).
    """
    del cache_position
    if isinstance(attention_mask, dict):
        return attention_mask
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config: Any = module.config
    if mask_types is None:
        kinds = {"full_attention"}
        if getattr(module, "has_sliding_layers", False) is True:
            kinds.add("sliding_attention")
    else:
        kinds = set(mask_types) or {"full_attention"}
    # `_pp_mask_cache_enabled = False` on the module turns caching off (the benchmark's "without cache" arm).
    cacheable = (
        attention_mask is None
        and not _is_packed(position_ids)
        and module.__dict__.get("_pp_mask_cache_enabled", True) is not False
    )
    # The batch size is part of the key: eager masks are expanded to [B, 1, S, S], and a mask built for another
    # batch size would broadcast the attention scores to the wrong batch (a forward with a different batch size,
    # e.g. evaluation, must not reuse the training microbatch's mask).
    key = (
        inputs_embeds.shape[0],
        inputs_embeds.shape[1],
        inputs_embeds.dtype,
        inputs_embeds.device,
        tuple(sorted(kinds)),
    )
    cache = module.__dict__.get("_pp_causal_mask_cache")
    if not isinstance(cache, dict):
        cache = {}
        module.__dict__["_pp_causal_mask_cache"] = cache
    if cacheable and key in cache:
        return cache[key]

    mask_kwargs: dict[str, Any] = {
        "config": config,
        "inputs_embeds": inputs_embeds,
        "attention_mask": attention_mask,
        "past_key_values": None,
        "position_ids": position_ids,
    }
    started = time.perf_counter()
    mapping: dict[str, Any] = {}
    for kind in sorted(kinds):
        builder = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        mapping[kind] = builder(**mask_kwargs)
    module.__dict__["_pp_mask_builds"] = module.__dict__.get("_pp_mask_builds", 0) + 1
    seconds = module.__dict__.get("_pp_mask_build_seconds", 0.0) + time.perf_counter() - started
    module.__dict__["_pp_mask_build_seconds"] = seconds
    if cacheable:
        cache[key] = mapping
    return mapping


# ------------------------------------------------------------------------------------------------------------
# Shared pieces of the forwards
# ------------------------------------------------------------------------------------------------------------


def _embed_or_take_hidden(
    text_module: nn.Module, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> torch.Tensor:
    """Embed token ids on the first stage; accept float hidden states (in the `input_ids` slot) elsewhere."""
    if inputs_embeds is not None:
        return inputs_embeds
    embed_tokens = getattr(text_module, "embed_tokens", None)
    if input_ids is not None and input_ids.dtype in _FLOAT_DTYPES:
        return input_ids
    if embed_tokens is not None:
        if input_ids is None:
            raise ValueError("You must provide either input_ids or inputs_embeds")
        return embed_tokens(input_ids)
    raise ValueError(
        "inputs_embeds must be provided for pipeline stages without embed_tokens: this stage has no embedding, so "
        f"it expects float hidden states [B, S, H] in the input_ids slot, got "
        f"{None if input_ids is None else input_ids.dtype}."
    )


def _default_positions(hidden: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, tuple):
        return output[0]
    last_hidden_state = getattr(output, "last_hidden_state", None)
    return last_hidden_state if last_hidden_state is not None else output


def _softcap(logits: torch.Tensor, config: Any) -> torch.Tensor:
    cap = getattr(_text_config(config), "final_logit_softcapping", None) if config is not None else None
    if cap is None:
        return logits
    return cap * torch.tanh(logits / cap)


def _logits_or_hidden(model: nn.Module, hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """Apply the LM head (and Gemma's final soft-capping) on the last stage; pass hidden states elsewhere."""
    if getattr(model, "_pp_return_hidden_states", False) is True:
        return hidden
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None:
        return hidden
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return _softcap(lm_head(hidden[:, keep, :]), _config_of(model))


def _base_model_output(hidden: torch.Tensor, past_key_values: Any) -> Any:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values)


# ------------------------------------------------------------------------------------------------------------
# Forwards
# ------------------------------------------------------------------------------------------------------------


def create_pipeline_forward_inner(model_class_name: str = "AutoModel") -> Callable[..., Any]:
    """Forward for an HF inner decoder (`LlamaModel`, `Qwen3Model`, a VLM's `language_model`, ...).

    Returns a function to bind onto the module. It embeds on the first stage (else takes hidden states from
    `input_ids`), runs the layers this stage kept with per-layer-type masks, applies `norm` when kept, and returns
    a bare tensor [B, S, H] when `model_class_name == "PipelineStage"`, else a `BaseModelOutputWithPast`.
    """

    def pipeline_forward(
        self: Any,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache_position: torch.Tensor | None = None,
        causal_mask_mapping: dict | None = None,
        **kwargs: Any,
    ) -> Any:
        text_module: Any = get_text_module(self)
        assert text_module is not None
        hidden = _embed_or_take_hidden(text_module, input_ids, inputs_embeds)
        if use_cache and past_key_values is None:
            from transformers.cache_utils import DynamicCache

            past_key_values = DynamicCache(config=text_module.config)
        given_position_ids = position_ids
        position_ids = _default_positions(hidden, position_ids)
        layers = _layer_items(text_module)
        config = text_module.config
        kinds = {_layer_attention_type(config, index, layer) for index, layer in layers}
        if causal_mask_mapping is None:
            causal_mask_mapping = _build_or_reuse_pp_causal_mask(
                text_module, hidden, attention_mask, cache_position, given_position_ids, mask_types=kinds
            )
        rotary_emb = getattr(text_module, "rotary_emb", None)
        position_embeddings = rotary_emb(hidden, position_ids) if rotary_emb is not None and layers else None
        for index, layer in layers:
            kind = _layer_attention_type(config, index, layer)
            mask = causal_mask_mapping.get(kind, causal_mask_mapping.get("full_attention"))
            hidden = _first_tensor(
                layer(
                    hidden,
                    attention_mask=mask,
                    position_ids=position_ids,
                    past_key_values=past_key_values,
                    use_cache=use_cache,
                    position_embeddings=position_embeddings,
                )
            )
        norm = getattr(text_module, "norm", None)
        if norm is not None:
            hidden = norm(hidden)
        if model_class_name == "PipelineStage":
            return hidden
        return _base_model_output(hidden, past_key_values if use_cache else None)

    return pipeline_forward


def create_pipeline_forward_causal_lm() -> Callable[..., Any]:
    """Forward for an HF `*ForCausalLM`: inner model (when kept) then `lm_head` (when kept).

    Returns logits [B, S, V] on the last stage (soft-capped when the config sets `final_logit_softcapping`),
    hidden states [B, S, H] elsewhere or when `_pp_return_hidden_states` is True. `labels` are ignored: the
    schedule's `loss_fn` computes the loss.
    """

    def pipeline_forward_causal_lm(
        self: Any,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> torch.Tensor:
        del labels
        inner = getattr(self, "model", None)
        if inner is not None:
            hidden = _first_tensor(
                inner(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    past_key_values=past_key_values,
                    inputs_embeds=inputs_embeds,
                    use_cache=use_cache,
                    **kwargs,
                )
            )
        elif inputs_embeds is not None:
            hidden = inputs_embeds
        elif input_ids is not None and input_ids.dtype in _FLOAT_DTYPES:
            hidden = input_ids
        else:
            raise ValueError(
                "Expected hidden states as input for pipeline stage without inner model: pass float hidden states "
                "[B, S, H] as input_ids or inputs_embeds."
            )
        return _logits_or_hidden(self, hidden, logits_to_keep)

    return pipeline_forward_causal_lm


def _gemma4_layer_type(config: Any, index: int, layer: nn.Module) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return str(layer_types[index]) if 0 <= index < len(layer_types) else "full_attention"
    return str(getattr(layer, "attention_type", "full_attention"))


def _shared_kv_store() -> Any:
    try:
        from transformers.cache_utils import KVSharingDict
    except ImportError:  # older transformers: a plain dict is what the layers expect
        return {}
    return KVSharingDict()


def create_pipeline_forward_gemma4_text() -> Callable[..., Any]:
    """Forward for HF `Gemma4TextModel`: per-layer-type rotary embeddings and masks; returns [B, S, H].

    KV sharing (`num_kv_shared_layers > 0`) and per-layer inputs (E-series PLE) are rejected by
    `validate_hf_model_for_pipeline_support`; a fresh shared-KV store is created per call for the layers of
    this stage.
    """

    def pipeline_forward_gemma4_text(
        self: Any,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if input_ids is None and inputs_embeds is None:
            raise ValueError("input_ids or inputs_embeds must be provided")
        hidden = _embed_or_take_hidden(self, input_ids, inputs_embeds)
        given_position_ids = position_ids
        position_ids = _default_positions(hidden, position_ids)
        config = self.config
        layers = _layer_items(self)
        kinds = {_gemma4_layer_type(config, index, layer) for index, layer in layers}
        mapping = _build_or_reuse_pp_causal_mask(
            self, hidden, attention_mask, cache_position, given_position_ids, mask_types=kinds
        )
        rotary_emb = getattr(self, "rotary_emb", None)
        position_embeddings: dict[str, Any] = {}
        if rotary_emb is not None:
            for kind in sorted(kinds):
                try:
                    position_embeddings[kind] = rotary_emb(hidden, position_ids, kind)
                except TypeError:  # rotary without a layer-type argument
                    position_embeddings[kind] = rotary_emb(hidden, position_ids)
        shared_kv_states = _shared_kv_store()
        for index, layer in layers:
            kind = _gemma4_layer_type(config, index, layer)
            hidden = _first_tensor(
                layer(
                    hidden,
                    None,
                    shared_kv_states=shared_kv_states,
                    position_embeddings=position_embeddings.get(kind),
                    attention_mask=mapping.get(kind),
                    position_ids=position_ids,
                    past_key_values=past_key_values,
                )
            )
        norm = getattr(self, "norm", None)
        if norm is not None:
            hidden = norm(hidden)
        return hidden

    return pipeline_forward_gemma4_text


def _take_media_chunk(model: Any, input_ids: torch.Tensor | None, image_token_id: Any) -> tuple[Any, Any]:
    """Pixel values (and grid/position info) staged per micro-batch on `_vlm_pixel_values_chunks`, if any.

    The training loop may stage one entry per micro-batch before `schedule.step()` (images per sample vary, so
    they cannot be chunked along dim 0); the cursor `_vlm_chunk_idx` advances only for micro-batches that contain
    image tokens.
    """
    chunks = getattr(model, "_vlm_pixel_values_chunks", None)
    if not chunks or input_ids is None or image_token_id is None or not bool((input_ids == image_token_id).any()):
        return None, None
    index = getattr(model, "_vlm_chunk_idx", 0)
    if index >= len(chunks):
        return None, None
    grids = getattr(model, "_vlm_image_grid_hws_chunks", None)
    grid = grids[index] if grids is not None and index < len(grids) else None
    model._vlm_chunk_idx = index + 1
    return chunks[index], grid


def _scatter_features(embeds: torch.Tensor, mask: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Write image features [N, H] into the embedding rows selected by mask [B, S]."""
    features = features.to(embeds.device, embeds.dtype)
    expanded = mask.unsqueeze(-1).expand_as(embeds).to(embeds.device)
    if int(expanded.sum()) != features.numel():
        raise ValueError(
            f"Image features and image tokens do not match: {int(mask.sum())} image tokens in the micro-batch but "
            f"{features.shape[0]} feature rows. Each micro-batch must carry the images of its own samples."
        )
    return embeds.masked_scatter(expanded, features)


def create_pipeline_forward_gemma4_vlm() -> Callable[..., Any]:
    """Forward for HF `Gemma4ForConditionalGeneration`.

    First stage: embeds text (media placeholders replaced by the pad id, as HF does), runs the vision tower and
    scatters the pooled image features into the placeholder rows. Every stage runs its kept text layers; the last
    applies `lm_head` and the final logit soft-capping `cap * tanh(logits / cap)`.
    """

    def pipeline_forward_gemma4_vlm(
        self: Any,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> torch.Tensor:
        del labels
        inner = self.model
        language_model = inner.language_model
        config = self.config
        is_first = getattr(language_model, "embed_tokens", None) is not None
        if is_first and inputs_embeds is None:
            if input_ids is None or input_ids.dtype in _FLOAT_DTYPES:
                raise ValueError("The first Gemma4 VLM stage needs integer input_ids [B, S].")
            if pixel_values is None:
                pixel_values, grid = _take_media_chunk(self, input_ids, getattr(config, "image_token_id", None))
                if grid is not None and image_position_ids is None:
                    image_position_ids = grid
            media_mask = torch.zeros_like(input_ids, dtype=torch.bool)
            for token_attr in ("image_token_id", "video_token_id", "audio_token_id"):
                token_id = getattr(config, token_attr, None)
                if token_id is not None:
                    media_mask |= input_ids == token_id
            pad_id = getattr(_text_config(config), "pad_token_id", None) or 0
            inputs_embeds = language_model.embed_tokens(torch.where(media_mask, pad_id, input_ids))
            if pixel_values is not None and getattr(inner, "vision_tower", None) is not None:
                features = inner.get_image_features(pixel_values, image_position_ids, return_dict=True).pooler_output
                if isinstance(features, (tuple, list)):
                    features = torch.cat(list(features), dim=0)
                if mm_token_type_ids is not None:
                    image_mask = mm_token_type_ids == 1
                else:
                    image_mask = input_ids == config.image_token_id
                inputs_embeds = _scatter_features(inputs_embeds, image_mask, features)
        elif inputs_embeds is None:
            if input_ids is None or input_ids.dtype not in _FLOAT_DTYPES:
                raise ValueError("Expected float hidden states for non-first PP stage (in the input_ids slot).")
            inputs_embeds = input_ids
        hidden = _first_tensor(
            language_model(
                input_ids=None,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
            )
        )
        return _logits_or_hidden(self, hidden, logits_to_keep)

    return pipeline_forward_gemma4_vlm


def create_pipeline_forward_mistral3_vlm() -> Callable[..., Any]:
    """Forward for HF `Mistral3ForConditionalGeneration` (Pixtral vision tower + Mistral text model).

    First stage: embeds text, runs the vision tower on `pixel_values` with `image_sizes` (and
    `vision_feature_layer`, defaulting to the config's) and scatters the projected features into the image-token
    rows. The last stage returns `lm_head(hidden)`.
    """

    def pipeline_forward_mistral3_vlm(
        self: Any,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
        vision_feature_layer: int | list[int] | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> torch.Tensor:
        del labels
        inner = self.model
        language_model = inner.language_model
        config = self.config
        is_first = getattr(language_model, "embed_tokens", None) is not None
        if is_first and inputs_embeds is None:
            if input_ids is None or input_ids.dtype in _FLOAT_DTYPES:
                raise ValueError("The first Mistral3 VLM stage needs integer input_ids [B, S].")
            if pixel_values is None:
                pixel_values, grid = _take_media_chunk(self, input_ids, getattr(config, "image_token_id", None))
                if grid is not None:
                    image_sizes = grid
            inputs_embeds = language_model.embed_tokens(input_ids)
            if pixel_values is not None and getattr(inner, "vision_tower", None) is not None:
                if vision_feature_layer is None:
                    vision_feature_layer = getattr(config, "vision_feature_layer", -1)
                features = inner.get_image_features(
                    pixel_values=pixel_values,
                    image_sizes=image_sizes,
                    vision_feature_layer=vision_feature_layer,
                    return_dict=True,
                ).pooler_output
                if isinstance(features, (tuple, list)):
                    features = torch.cat(list(features), dim=0)
                inputs_embeds = _scatter_features(inputs_embeds, input_ids == config.image_token_id, features)
        elif inputs_embeds is None:
            if input_ids is None or input_ids.dtype not in _FLOAT_DTYPES:
                raise ValueError("Expected float hidden states for non-first PP stage (in the input_ids slot).")
            inputs_embeds = input_ids
        hidden = _first_tensor(
            language_model(
                input_ids=None,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
            )
        )
        return _logits_or_hidden(self, hidden, logits_to_keep)

    return pipeline_forward_mistral3_vlm


# ------------------------------------------------------------------------------------------------------------
# Patching, buffers, validation
# ------------------------------------------------------------------------------------------------------------


def _model_type(config: Any) -> str | None:
    return getattr(config, "model_type", None) if config is not None else None


def _is_gemma4_vlm(model: nn.Module) -> bool:
    config = _config_of(model)
    if config is None:
        return False
    text_config = getattr(config, "text_config", None)
    return _model_type(config) == "gemma4" or _model_type(text_config) in ("gemma4", "gemma4_text")


def _is_mistral3_vlm(model: nn.Module) -> bool:
    return _model_type(_config_of(model)) == "mistral3"


def _is_gemma4_text(module: nn.Module) -> bool:
    return _model_type(_config_of(module)) == "gemma4_text"


def _is_vlm(model: nn.Module) -> bool:
    config = _config_of(model)
    if config is not None and getattr(config, "text_config", None) is not None:
        return True
    if getattr(model, "vision_tower", None) is not None:
        return True
    inner = getattr(model, "model", None)
    return inner is not None and any(getattr(inner, attr, None) is not None for attr in ("vision_tower", "visual"))


def patch_hf_model_for_pp(
    model: Any, *, patch_inner_model: bool = True, patch_causal_lm_model: bool = True
) -> nn.Module:
    """Bind pipeline-friendly forwards onto `model` (in place) and return it.

    Skip this for models with `_pp_keep_self_forward = True`. Dispatch: Gemma4 VLM, Mistral3 VLM, a model with an
    inner `.model` (causal LM; Gemma4 text inner gets its own forward), else the model itself is the decoder.
    """
    inner = getattr(model, "model", None)
    language_model = getattr(inner, "language_model", None) if inner is not None else None
    if language_model is not None and _is_gemma4_vlm(model):
        if patch_inner_model:
            bind_method(language_model, "forward", create_pipeline_forward_gemma4_text())
        if patch_causal_lm_model:
            bind_method(model, "forward", create_pipeline_forward_gemma4_vlm())
    elif language_model is not None and _is_mistral3_vlm(model):
        if patch_inner_model:
            bind_method(language_model, "forward", create_pipeline_forward_inner("PipelineStage"))
        if patch_causal_lm_model:
            bind_method(model, "forward", create_pipeline_forward_mistral3_vlm())
    elif inner is not None:
        if patch_inner_model:
            forward = (
                create_pipeline_forward_gemma4_text()
                if _is_gemma4_text(inner)
                else create_pipeline_forward_inner("PipelineStage")
            )
            bind_method(inner, "forward", forward)
        if patch_causal_lm_model:
            bind_method(model, "forward", create_pipeline_forward_causal_lm())
            model._pp_return_hidden_states_supported = True
    elif patch_inner_model:
        forward = (
            create_pipeline_forward_gemma4_text()
            if _is_gemma4_text(model)
            else create_pipeline_forward_inner("PipelineStage")
        )
        bind_method(model, "forward", forward)
    return model


def init_hf_model_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Recompute rotary-embedding buffers (`inv_freq`, per-layer-type variants) on `device`.

    Needed after building a model on the meta device and materializing it with `to_empty`: non-persistent buffers
    are not in checkpoints, so they would stay uninitialized. Each `*RotaryEmbedding` module with a `config` is
    rebuilt on `device` (cheap: buffers only) and its buffers are copied over. Other modules are untouched.
    """
    for module in model.modules():
        if not type(module).__name__.endswith("RotaryEmbedding") or getattr(module, "config", None) is None:
            continue
        with torch.device(device):
            try:
                fresh = type(module)(module.config)
            except TypeError:
                continue
        for name, buffer in fresh.named_buffers(recurse=False):
            persistent = name not in module._non_persistent_buffers_set
            module.register_buffer(name, buffer, persistent=persistent)


def _uses_reentrant_checkpointing(model: nn.Module) -> list[str]:
    """Names of modules that run reentrant activation checkpointing (torch wrapper or HF's setting)."""
    found = []
    for name, module in model.named_modules():
        if is_reentrant_checkpoint_wrapper(module):
            found.append(name or "<root>")
            continue
        if getattr(module, "gradient_checkpointing", False) is True:
            func = module.__dict__.get("_gradient_checkpointing_func")
            keywords = getattr(func, "keywords", None) or {}
            if keywords.get("use_reentrant", False) is True:
                found.append(name or "<root>")
    return found


def validate_hf_model_for_pipeline_support(model: nn.Module) -> None:
    """Raise one ValueError listing every reason `model` cannot run under pipeline parallelism, with the fix.

    Tied input/output embeddings are supported (the last stage keeps a copy whose gradient is summed with the
    first stage's, see `am_pipelining.tied`), so they are not rejected. Rejected: encoder-decoder models; VLMs
    without a pipeline-aware forward; Gemma 4 per-layer inputs (PLE) and cross-layer KV sharing, which need data
    no stage receives; reentrant activation checkpointing, which breaks the stage backward.
    """
    issues: list[str] = []
    config = _config_of(model)
    if config is not None:
        name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None) or type(model).__name__
        if getattr(config, "is_encoder_decoder", False):
            issues.append(
                "Encoder-decoder models with cross-attention are not supported yet for pipeline parallelism: the "
                "decoder stages would need the encoder output. Train it with FSDP2/TP instead."
            )
        model_types = {_model_type(config), _model_type(getattr(config, "text_config", None))}
        if (
            _is_vlm(model)
            and not model_keeps_self_forward(model)
            and not model_types & set(_PP_VLM_MODEL_TYPES_WITH_DEDICATED_FORWARD)
            and not model_types & {"gemma4_text"}
        ):
            issues.append(
                f"{type(model).__name__} (model_type={_model_type(config)!r}) is a multimodal model that is not on the "
                "pipeline-aware list (gemma4, mistral3): images would never reach its vision tower. Fix: give the "
                "class a PP-aware forward and set `_pp_keep_self_forward = True`, or train it without PP."
            )
        text_config = _text_config(config)
        if getattr(text_config, "hidden_size_per_layer_input", 0):
            issues.append(
                "Gemma 4 per-layer inputs (hidden_size_per_layer_input="
                f"{text_config.hidden_size_per_layer_input}) need the token ids on every stage, but only hidden "
                "states travel between stages. Fix: use a variant without per-layer inputs (not the E-series) or pp=1."
            )
        if getattr(text_config, "num_kv_shared_layers", 0):
            issues.append(
                f"num_kv_shared_layers={text_config.num_kv_shared_layers}: layers that reuse another layer's keys and "
                "values cannot be placed on a different stage from it. Fix: use a variant without KV sharing or pp=1."
            )
        prefix = f"Model '{name}' is not compatible with pipeline parallelism:"
    else:
        prefix = f"Model '{type(model).__name__}' is not compatible with pipeline parallelism:"
    reentrant = _uses_reentrant_checkpointing(model)
    if reentrant:
        shown = ", ".join(reentrant[:4]) + (" ..." if len(reentrant) > 4 else "")
        issues.append(
            f"Reentrant activation checkpointing is enabled on {shown}: the stage backward calls "
            "torch.autograd.grad on stage inputs, which reentrant checkpointing does not support. Fix: use "
            "`use_reentrant=False` (HF: activation_checkpointing_enable(activation_checkpointing_kwargs="
            "{'use_reentrant': False}); torch: checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.NO_REENTRANT))."
        )
    if issues:
        numbered = "\n".join(f"{i}. {issue}" for i, issue in enumerate(issues, start=1))
        raise ValueError(f"{prefix}\n\n{numbered}")


def statically_defines(obj: Any, name: str) -> bool:
    """True when `obj`'s class (or the object) really defines `name` (Mocks and __getattr__ do not count)."""
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return False
    return True
