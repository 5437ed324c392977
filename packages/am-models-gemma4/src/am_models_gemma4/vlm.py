"""`Gemma4ForConditionalGeneration`: our Gemma 4 text decoder with transformers' vision tower for the image path.

What it is for: the module tree and state-dict names of transformers' `Gemma4ForConditionalGeneration`
(`model.language_model.*` is ours — dense or MoE, ring CP — `model.vision_tower.*` and `model.embed_vision.*` are
transformers' `Gemma4VisionModel` and `Gemma4MultimodalEmbedder`, `lm_head` is tied), with text-only and image+text
forwards: media placeholder ids are embedded as the pad id, the pooled image features are scattered into the
image-token rows, and `use_bidirectional_attention="vision"` lets an image's tokens see each other on sliding
layers. `generate(...)` (transformers' `GenerationMixin`, `generation.py`) takes images in the prompt and returns text:
the prefill runs the vision tower and the bidirectional image mask, later steps only the text decoder with its
`Gemma4HybridCache`.
What it must not do: run audio or video towers (configs with `audio_config` are rejected at construction; video or
audio inputs are rejected in forward), or import am-pipelining (whose Gemma 4 VLM forward reads `model.
language_model`, `model.vision_tower`, `model.get_image_features(...).pooler_output` and `lm_head`).

Under CP every rank runs the vision tower on all images of the batch and keeps the feature rows of its own image
tokens (their offset is the image tokens of the previous ranks: one all-gather of C integers), so the tower's
gradients, summed over the CP group, are the full-sequence gradients.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling, CausalLMOutputWithPast
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4MultimodalEmbedder,
    Gemma4VisionModel,
    get_block_sequence_ids_for_mask,
)

from am_precision import BackendConfig

from .config import check_moe_config, normalize_text_config
from .cp import active_ring_context, tokens_before_this_rank
from .model import Gemma4TextModel, reject_unknown_kwargs
from .pretrained import Gemma4PreTrainedModel

__all__ = ["Gemma4ForConditionalGeneration", "Gemma4Model"]

# transformers' Gemma4ForConditionalGeneration inputs of the video and audio paths, which this model does not run
_UNSUPPORTED_MEDIA_KWARGS = (
    "pixel_values_videos",
    "video_position_ids",
    "input_features",
    "input_features_mask",
    "num_frames_per_video",
)


class Gemma4Model(nn.Module):
    """Container with transformers' attribute names: `language_model`, `vision_tower`, `embed_vision`."""

    def __init__(self, config: Any, *, backend: BackendConfig | None = None) -> None:
        super().__init__()
        if getattr(config, "audio_config", None) is not None:
            raise NotImplementedError(
                "Gemma4 audio (config.audio_config is set) is not supported by am_models_gemma4; drop audio_config "
                "to train the text + vision model"
            )
        self.config = config
        text_config = normalize_text_config(config.text_config)
        self.language_model = Gemma4TextModel(text_config, backend=backend)
        self.vision_tower: nn.Module | None = None
        self.embed_vision: nn.Module | None = None
        if config.vision_config is not None:
            self.vision_tower = Gemma4VisionModel(config.vision_config)
            self.embed_vision = Gemma4MultimodalEmbedder(config.vision_config, text_config)

    @property
    def layers(self) -> nn.ModuleDict:
        return self.language_model.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.language_model.embed_tokens

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.embed_tokens

    def get_image_features(
        self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor | None = None, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        """Vision tower + projector; `pooler_output` is a tuple of `[N_i, H]` soft tokens per image.

        pixel_values: `[N_images, max_patches, 3·patch²]`; image_position_ids: `[N_images, max_patches, 2]` with
        (-1, -1) for padding patches.
        """
        del kwargs
        if self.vision_tower is None or self.embed_vision is None:
            raise ValueError("pixel_values were given but the config has no vision_config (no vision tower)")
        if image_position_ids is None:
            raise ValueError("image_position_ids [N_images, max_patches, 2] are required with pixel_values")
        outputs = self.vision_tower(pixel_values=pixel_values, pixel_position_ids=image_position_ids)
        projected = self.embed_vision(inputs_embeds=outputs.last_hidden_state)
        pooling = self.config.vision_config.pooling_kernel_size
        output_length = pixel_values.shape[-2] // (pooling**2)
        k_squared = int((image_position_ids.shape[1] // output_length) ** 0.5) ** 2
        per_image = ((image_position_ids != -1).all(dim=-1).sum(dim=-1) // k_squared).tolist()
        pooled: Any = torch.split(projected, per_image)  # a tuple per image, as transformers returns
        return BaseModelOutputWithPooling(last_hidden_state=outputs.last_hidden_state, pooler_output=pooled)


class Gemma4ForConditionalGeneration(Gemma4PreTrainedModel):
    """Gemma 4 vision-language model: logits `[B, S, V]` for text-only or image+text inputs; `generate(...)`."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    # The image inputs describe the prompt: after the prefill, steps carry new text tokens only.
    _prefill_only_inputs: ClassVar[tuple[str, ...]] = ("image_position_ids", "mm_token_type_ids")

    def __init__(
        self,
        config: Any,
        moe_config: Any = None,
        backend: Any = None,
        text_config: dict[str, Any] | None = None,
    ) -> None:
        """Build from a `Gemma4Config`, with upstream's calling convention.

        Args:
            config: `Gemma4Config` (text + optional vision sub-configs); not modified.
            moe_config: upstream's `MoEConfig` (anything with its field names), or None. The MoE block is built
                from the text config (`enable_moe_block`, `num_experts`, `top_k_experts`, `moe_intermediate_size`);
                a given `moe_config` is checked against it (`config.check_moe_config`), never a second source.
            backend: an `am_precision.BackendConfig` (upstream's), or None for the model's defaults. Its `attn`,
                `compile_attn` and `experts` choose the text model's kernels, its routing fields (`gate_precision`,
                `fake_balanced_gate`, `fake_gate_noise`) every MoE router's; values Gemma 4 cannot run are refused
                (`backend.resolve_backend`). The vision tower keeps transformers' attention.
            text_config: overrides applied to a copy of `config.text_config` (upstream's dict override).

        Raises:
            ValueError: `config` has no text_config, `text_config` names a field the text config lacks, or
                `moe_config` disagrees with the (overridden) text config (every field named).
        """
        super().__init__()
        if text_config:
            config = copy.deepcopy(config)
            unknown = sorted(k for k in text_config if not hasattr(config.text_config, k))
            if unknown:
                raise ValueError(f"text_config overrides name fields the Gemma 4 text config lacks: {unknown}")
            for key, value in text_config.items():
                setattr(config.text_config, key, value)
        if getattr(config, "text_config", None) is None:
            raise ValueError(
                f"Gemma4ForConditionalGeneration needs a Gemma4Config with a text_config; got {type(config).__name__}: "
                "use Gemma4ForCausalLM for a text-only checkpoint"
            )
        if moe_config is not None:
            check_moe_config(config, moe_config)
        self.config = config
        self.model = Gemma4Model(config, backend=backend)
        text = config.text_config
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_weights()
        self._init_generation_config(config)

    def _media_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        for attr in ("image_token_id", "video_token_id", "audio_token_id"):
            token_id = getattr(self.config, attr, None)
            if token_id is not None:
                mask |= input_ids == token_id
        return mask

    def _scatter_image_features(
        self,
        inputs_embeds: torch.Tensor,
        image_mask: torch.Tensor,
        pixel_values: torch.Tensor,
        image_position_ids: torch.Tensor | None,
        ring: Any,
    ) -> torch.Tensor:
        pooled: Any = self.model.get_image_features(pixel_values, image_position_ids).pooler_output
        features = torch.cat(list(pooled))
        features = features.to(inputs_embeds.dtype)
        count = image_mask.sum()
        if ring is not None:
            offset = tokens_before_this_rank(count, group=ring.group)
            features = features[offset : offset + int(count)]
        if features.shape[0] != int(count):
            raise ValueError(
                f"image features and image tokens do not match: {int(count)} image tokens (id "
                f"{self.config.image_token_id}) but {features.shape[0]} feature rows from the vision tower"
            )
        expanded = image_mask.unsqueeze(-1).expand_as(inputs_embeds)
        return inputs_embeds.masked_scatter(expanded, features)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        *,
        padding_mask: torch.Tensor | None = None,
        _packed_seq_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """input_ids `[B, S]` (+ pixel_values, image_position_ids) → logits `[B, S, V]` and, with labels, the loss.

        Labels follow `Gemma4ForCausalLM.forward`: unshifted without CP, already shifted under CP.
        """
        unsupported_media = [k for k in _UNSUPPORTED_MEDIA_KWARGS if kwargs.get(k) is not None]
        if unsupported_media:
            raise NotImplementedError(
                f"video and audio inputs are not supported by am_models_gemma4 (got {unsupported_media}); train with "
                "text and images only (pixel_values + image_position_ids), or use transformers' Gemma4 for video/audio"
            )
        other = {k: v for k, v in kwargs.items() if k not in _UNSUPPORTED_MEDIA_KWARGS}
        reject_unknown_kwargs(other, "Gemma4ForConditionalGeneration.forward")
        text_config = self.config.text_config
        language_model = self.model.language_model
        ring = active_ring_context()
        per_layer_inputs = None
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            media = self._media_mask(input_ids)
            llm_ids = torch.where(media, text_config.pad_token_id, input_ids)
            inputs_embeds = language_model.embed_tokens(llm_ids)
            if language_model.hidden_size_per_layer_input:
                per_layer_inputs = language_model.get_per_layer_inputs(llm_ids)
            if pixel_values is not None:
                image_mask = input_ids == self.config.image_token_id
                inputs_embeds = self._scatter_image_features(
                    inputs_embeds, image_mask, pixel_values, image_position_ids, ring
                )
        elif pixel_values is not None:
            raise ValueError("pixel_values need input_ids (the image-token positions); got inputs_embeds")

        vision_group_ids = None
        if getattr(text_config, "use_bidirectional_attention", None) == "vision" and mm_token_type_ids is not None:
            if ring is not None and pixel_values is not None:
                raise NotImplementedError(
                    "bidirectional attention among image tokens (use_bidirectional_attention='vision') is not "
                    "supported under context parallelism; train image batches of this variant with cp=1"
                )
            if ring is None:
                vision_group_ids = get_block_sequence_ids_for_mask(mm_token_type_ids, device=inputs_embeds.device)

        outputs = language_model(
            None,
            attention_mask,
            position_ids,
            past_key_values,
            inputs_embeds,
            per_layer_inputs,
            use_cache,
            padding_mask=padding_mask,
            _packed_seq_ids=_packed_seq_ids,
            vision_group_ids=vision_group_ids,
        )
        logits, loss = self.logits_and_loss(outputs.last_hidden_state, labels, logits_to_keep=logits_to_keep)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)
