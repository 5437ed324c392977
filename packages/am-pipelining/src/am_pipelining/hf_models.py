"""Architecture-specific pipeline forwards: Gemma 4 (text decoder and VLM) and Mistral 3 (VLM).

Each architecture is one entry of `hf_utils.PIPELINE_FORWARDS` (registered at the bottom of this module), so the
generic patching and validation in `hf_utils` never name a model. Gemma 4's text decoder needs per-layer-type
rotary embeddings and masks; the VLM forwards run the vision tower on the first stage and scatter the image
features into the placeholder rows, the last stage applies the LM head (and Gemma's final logit soft-capping).

This module never imports a model package of this repository; transformers is imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .hf_masks import _build_or_reuse_pp_causal_mask, _layer_items
from .hf_transforms import _text_config
from .hf_utils import (
    _FLOAT_DTYPES,
    _default_positions,
    _embed_or_take_hidden,
    _first_tensor,
    _logits_or_hidden,
    _position_embeddings,
    register_pipeline_forward,
)

__all__ = [
    "create_pipeline_forward_gemma4_text",
    "create_pipeline_forward_gemma4_vlm",
    "create_pipeline_forward_mistral3_vlm",
]


def _gemma4_layer_type(config: Any, index: int, layer: nn.Module) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return str(layer_types[index]) if 0 <= index < len(layer_types) else "full_attention"
    return str(getattr(layer, "attention_type", "full_attention"))


def _stage_padding_mask(
    padding_mask: torch.Tensor | None, attention_mask: Any, hidden: torch.Tensor
) -> torch.Tensor | None:
    """The stage's `[B, S]` padding mask (True = pad): the given one, else derived from a 2-D `attention_mask`
    (0 = pad), else None (no padding known to this stage)."""
    if padding_mask is None and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        padding_mask = ~attention_mask.bool()
    if padding_mask is not None and tuple(padding_mask.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"padding_mask has shape {tuple(padding_mask.shape)} but this stage's tokens are {tuple(hidden.shape[:2])} "
            "[B, S]: pass a per-token padding mask that is split into micro-batches like the inputs."
        )
    return padding_mask


def create_pipeline_forward_gemma4_text() -> Callable[..., Any]:
    """Forward for HF `Gemma4TextModel`: per-layer-type rotary embeddings and masks; returns [B, S, H].

    KV sharing (`num_kv_shared_layers > 0`) and per-layer inputs (E-series PLE) are rejected by
    `validate_hf_model_for_pipeline_support`; a fresh shared-KV store is created per call for the layers of
    this stage. `padding_mask` `[B, S]` (True = pad; default: `~attention_mask` when a 2-D mask is given) is passed
    to every layer, as upstream does, so MoE layers that read it keep padding out of expert routing. Masks never
    travel between stages: pass `padding_mask` / `attention_mask` to `schedule.step` on EVERY pipeline rank (the
    schedule splits them into micro-batches along dim 0).
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
        padding_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if input_ids is None and inputs_embeds is None:
            raise ValueError("input_ids or inputs_embeds must be provided")
        hidden = _embed_or_take_hidden(self, input_ids, inputs_embeds)
        padding_mask = _stage_padding_mask(padding_mask, attention_mask, hidden)
        given_position_ids = position_ids
        position_ids = _default_positions(self, hidden, position_ids)
        config = self.config
        layers = _layer_items(self)
        kinds = {_gemma4_layer_type(config, index, layer) for index, layer in layers}
        mapping = _build_or_reuse_pp_causal_mask(
            self, hidden, attention_mask, cache_position, given_position_ids, mask_types=kinds
        )
        position_embeddings = _position_embeddings(self, hidden, position_ids, kinds)
        from transformers.cache_utils import KVSharingDict  # transformers >= 5.23 (the declared floor)

        shared_kv_states = KVSharingDict()
        for index, layer in layers:
            kind = _gemma4_layer_type(config, index, layer)
            hidden = _first_tensor(
                layer(
                    hidden,
                    None,
                    shared_kv_states=shared_kv_states,
                    position_embeddings=position_embeddings.get(kind, position_embeddings.get(None)),
                    attention_mask=mapping.get(kind),
                    position_ids=position_ids,
                    past_key_values=past_key_values,
                    padding_mask=padding_mask,
                )
            )
        norm = getattr(self, "norm", None)
        if norm is not None:
            hidden = norm(hidden)
        return hidden

    return pipeline_forward_gemma4_text


def _take_media_chunk(model: Any, input_ids: torch.Tensor, pixel_values: Any) -> tuple[Any, Any]:
    """(pixel values, staged grid/position info or None): the given `pixel_values`, else the entry staged per
    micro-batch on `_vlm_pixel_values_chunks`, if any.

    The training loop may stage one entry per micro-batch before `schedule.step()` (images per sample vary, so
    they cannot be chunked along dim 0); the cursor `_vlm_chunk_idx` advances only for micro-batches that contain
    image tokens.
    """
    if pixel_values is not None:
        return pixel_values, None
    image_token_id = getattr(model.config, "image_token_id", None)
    chunks = getattr(model, "_vlm_pixel_values_chunks", None)
    if not chunks or image_token_id is None or not bool((input_ids == image_token_id).any()):
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


def _pooled_image_features(output: Any) -> torch.Tensor:
    """The `pooler_output` of `get_image_features(..., return_dict=True)` as one [N, H] tensor (per-image pieces
    are concatenated)."""
    features = output.pooler_output
    return torch.cat(list(features), dim=0) if isinstance(features, (tuple, list)) else features


def _vlm_stage_forward(
    model: Any,
    name: str,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    embed_first_stage: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    logits_to_keep: int | torch.Tensor,
    **text_kwargs: Any,
) -> torch.Tensor:
    """What every VLM stage does around its modality-specific part: the first stage (the one holding the text
    `embed_tokens`) embeds integer `input_ids` [B, S] with `embed_first_stage(embed_tokens, input_ids)`, a later
    stage takes the previous stage's hidden states [B, S, H] from the `input_ids` slot; then the kept text layers
    (`text_kwargs` go to the language model) and, on the last stage, the LM head and logit transforms."""
    language_model = model.model.language_model
    if inputs_embeds is None and getattr(language_model, "embed_tokens", None) is not None:
        if input_ids is None or input_ids.dtype in _FLOAT_DTYPES:
            raise ValueError(f"The first {name} VLM stage needs integer input_ids [B, S].")
        inputs_embeds = embed_first_stage(language_model.embed_tokens, input_ids)
    elif inputs_embeds is None:
        if input_ids is None or input_ids.dtype not in _FLOAT_DTYPES:
            raise ValueError("Expected float hidden states for non-first PP stage (in the input_ids slot).")
        inputs_embeds = input_ids
    hidden = _first_tensor(language_model(input_ids=None, inputs_embeds=inputs_embeds, **text_kwargs))
    return _logits_or_hidden(model, hidden, logits_to_keep)


def create_pipeline_forward_gemma4_vlm() -> Callable[..., Any]:
    """Forward for HF `Gemma4ForConditionalGeneration`.

    First stage: embeds text (media placeholders replaced by the pad id, as HF does), runs the vision tower and
    scatters the pooled image features into the placeholder rows. Every stage runs its kept text layers (other
    keyword arguments, e.g. `padding_mask`, go on to the text forward, as upstream passes them); the last applies
    `lm_head` and the final logit soft-capping `cap * tanh(logits / cap)`.
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
        inner, config = self.model, self.config

        def embed(embed_tokens: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
            pixels, grid = _take_media_chunk(self, input_ids, pixel_values)
            positions = image_position_ids if image_position_ids is not None else grid
            media_mask = torch.zeros_like(input_ids, dtype=torch.bool)
            for token_attr in ("image_token_id", "video_token_id", "audio_token_id"):
                token_id = getattr(config, token_attr, None)
                if token_id is not None:
                    media_mask |= input_ids == token_id
            pad_id = getattr(_text_config(config), "pad_token_id", None) or 0
            embeds = embed_tokens(torch.where(media_mask, pad_id, input_ids))
            if pixels is None or getattr(inner, "vision_tower", None) is None:
                return embeds
            features = _pooled_image_features(inner.get_image_features(pixels, positions, return_dict=True))
            image_mask = mm_token_type_ids == 1 if mm_token_type_ids is not None else input_ids == config.image_token_id
            return _scatter_features(embeds, image_mask, features)

        return _vlm_stage_forward(
            self,
            "Gemma4",
            input_ids,
            inputs_embeds,
            embed,
            logits_to_keep,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            **kwargs,
        )

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
        inner, config = self.model, self.config

        def embed(embed_tokens: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
            pixels, grid = _take_media_chunk(self, input_ids, pixel_values)
            sizes = grid if grid is not None else image_sizes
            embeds = embed_tokens(input_ids)
            if pixels is None or getattr(inner, "vision_tower", None) is None:
                return embeds
            default_layer = getattr(config, "vision_feature_layer", -1)
            layer = vision_feature_layer if vision_feature_layer is not None else default_layer
            output = inner.get_image_features(
                pixel_values=pixels, image_sizes=sizes, vision_feature_layer=layer, return_dict=True
            )
            return _scatter_features(embeds, input_ids == config.image_token_id, _pooled_image_features(output))

        return _vlm_stage_forward(
            self,
            "Mistral3",
            input_ids,
            inputs_embeds,
            embed,
            logits_to_keep,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
        )

    return pipeline_forward_mistral3_vlm


register_pipeline_forward("gemma4_text", text_forward=create_pipeline_forward_gemma4_text)
register_pipeline_forward(
    "gemma4",
    text_forward=create_pipeline_forward_gemma4_text,
    outer_forward=create_pipeline_forward_gemma4_vlm,
    multimodal=True,
)
register_pipeline_forward("mistral3", outer_forward=create_pipeline_forward_mistral3_vlm, multimodal=True)
