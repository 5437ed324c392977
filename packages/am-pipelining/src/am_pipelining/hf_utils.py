"""Make HuggingFace models pipeline-stage friendly: tensor-in / tensor-out forwards that tolerate pruned modules.

A pipeline stage keeps only some of the model's modules (the rest are `None`), receives hidden states in the
`input_ids` slot when it is not the first stage, and must return a plain tensor. The generic forwards here implement
that contract for HF decoders and causal LMs (Llama, Qwen3, Mistral, ...) using transformers 5.x names
(`past_key_values`, `inputs_embeds`); causal masks are built once per stage and reused
(`_build_or_reuse_pp_causal_mask`). Architectures that need their own forward (a VLM feeding a vision tower on stage
0, Gemma 4's per-layer-type rotary embeddings) are entries of the `PIPELINE_FORWARDS` table keyed by `model_type`:
`patch_hf_model_for_pp` and `validate_hf_model_for_pipeline_support` (in `hf_validation`) consult it, so
supporting another one is `register_pipeline_forward(...)`, not a new branch here. The built-in entries (Gemma 4,
Mistral 3) live in `hf_models`; what a model's forward does around its layers is `hf_transforms`.

This module never imports a model package of this repository and never touches torch pipelining internals.
transformers is imported lazily inside the functions that need it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from am_model_contract import contract_of

from ._compat import bind_method
from .hf_buffers import init_hf_model_buffers
from .hf_masks import _build_or_reuse_pp_causal_mask, _layer_attention_type, _layer_items
from .hf_transforms import active_forward_transforms, apply_embedding_transforms, apply_logit_transforms

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
    "forward_reproduction_problems",
    "check_forward_reproduction",
    "validate_hf_model_for_pipeline_support",
    "PipelineForward",
    "PIPELINE_FORWARDS",
    "register_pipeline_forward",
]

logger = logging.getLogger(__name__)

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
    """True when the model declares its own forward PP-aware (`contract_of(model).pp.keeps_own_forward`; a model
    without a contract: NeMo AutoModel's class flag `_pp_keep_self_forward = True`, read by am-model-contract)."""
    return contract_of(model).pp.keeps_own_forward


def _config_of(module: Any) -> Any:
    return getattr(module, "config", None)


# ------------------------------------------------------------------------------------------------------------
# Shared pieces of the forwards
# ------------------------------------------------------------------------------------------------------------


def _embed_or_take_hidden(
    text_module: nn.Module, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> torch.Tensor:
    """Embed token ids on the first stage; accept float hidden states (in the `input_ids` slot) elsewhere.

    On the stage holding `embed_tokens`, the model's embedding transforms (e.g. Granite's `embedding_multiplier`,
    see `hf_transforms.FORWARD_TRANSFORMS`) are applied to the embeddings, given or computed, as the model does.
    """
    embed_tokens = getattr(text_module, "embed_tokens", None)
    if inputs_embeds is not None:
        hidden = inputs_embeds
    elif input_ids is not None and input_ids.dtype in _FLOAT_DTYPES:
        return input_ids
    elif embed_tokens is not None:
        if input_ids is None:
            raise ValueError("You must provide either input_ids or inputs_embeds")
        hidden = embed_tokens(input_ids)
    else:
        raise ValueError(
            "inputs_embeds must be provided for pipeline stages without embed_tokens: this stage has no embedding, "
            f"so it expects float hidden states [B, S, H] in the input_ids slot, got "
            f"{None if input_ids is None else input_ids.dtype}."
        )
    if embed_tokens is None:
        return hidden
    return apply_embedding_transforms(hidden, _config_of(text_module), training=text_module.training)


def _default_positions(module: Any, hidden: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The stage's position ids: the given ones, else the module's duck-typed hook
    `pipeline_default_position_ids(hidden) -> [B or 1, S] | None` (a model under context parallelism returns the
    global positions of its shard: a non-first stage receives hidden states only), else `arange(S)`."""
    if position_ids is not None:
        return position_ids
    hook = getattr(module, "pipeline_default_position_ids", None)
    if callable(hook):
        positions = hook(hidden)
        if positions is not None:
            return positions
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, tuple):
        return output[0]
    last_hidden_state = getattr(output, "last_hidden_state", None)
    return last_hidden_state if last_hidden_state is not None else output


def _logits_or_hidden(model: nn.Module, hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """Apply the LM head and the model's logit transforms (scaling, soft-capping) on the last stage; pass hidden
    states elsewhere.

    Raises:
        ValueError: `_pp_return_hidden_states` is set on a model whose logits are transformed (the caller's head
            would skip the transform).
    """
    if getattr(model, "_pp_return_hidden_states", False) is True:
        active = active_forward_transforms(_config_of(model), "logits")
        if active:
            names = ", ".join(f"{t.feature} ({t.config_key}={v!r})" for t, v in active)
            raise ValueError(
                f"_pp_return_hidden_states=True on a model whose own forward transforms its logits: {names}. A loss "
                "computed from the returned hidden states would skip it. Fix: let the last stage return logits."
            )
        return hidden
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None:
        return hidden
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return apply_logit_transforms(lm_head(hidden[:, keep, :]), _config_of(model))


def _position_embeddings(
    text_module: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]
) -> dict[str | None, Any]:
    """(cos, sin) per layer kind when the rotary embedding takes a `layer_type` (Gemma 3, OLMo 3: other RoPE
    parameters for sliding layers), else one pair under the key None; empty without a rotary embedding or layers."""
    rotary_emb = getattr(text_module, "rotary_emb", None)
    if rotary_emb is None or not kinds:
        return {}
    if "layer_type" in inspect.signature(rotary_emb.forward).parameters:
        return {kind: rotary_emb(hidden, position_ids, kind) for kind in sorted(kinds)}
    return {None: rotary_emb(hidden, position_ids)}


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
        position_ids = _default_positions(self, hidden, position_ids)
        layers = _layer_items(text_module)
        config = text_module.config
        kinds = {_layer_attention_type(config, index, layer) for index, layer in layers}
        if causal_mask_mapping is None:
            causal_mask_mapping = _build_or_reuse_pp_causal_mask(
                text_module, hidden, attention_mask, cache_position, given_position_ids, mask_types=kinds
            )
        position_embeddings = _position_embeddings(text_module, hidden, position_ids, kinds if layers else set())
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
                    position_embeddings=position_embeddings.get(kind, position_embeddings.get(None)),
                )
            )
        norm = getattr(text_module, "norm", None)
        if norm is not None:
            hidden = norm(hidden)
        if model_class_name == "PipelineStage":
            return hidden
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values if use_cache else None)

    return pipeline_forward


def create_pipeline_forward_causal_lm() -> Callable[..., Any]:
    """Forward for an HF `*ForCausalLM`: inner model (when kept) then `lm_head` (when kept).

    Returns logits [B, S, V] on the last stage (with the model's logit scaling / soft-capping, `FORWARD_TRANSFORMS`),
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


# ------------------------------------------------------------------------------------------------------------
# Patching, buffers, validation
# ------------------------------------------------------------------------------------------------------------


def _model_type(config: Any) -> str | None:
    return getattr(config, "model_type", None)


@dataclass(frozen=True)
class PipelineForward:
    """How to make one architecture (a `model_type`) pipeline-stage friendly.

    Attributes:
        text_forward: factory of the forward bound onto the text decoder (a VLM's `language_model`, a causal LM's
            `.model`, or the model itself); None uses `create_pipeline_forward_inner("PipelineStage")`.
        outer_forward: factory of the forward bound onto the top-level model; None uses
            `create_pipeline_forward_causal_lm()`.
        multimodal: the outer forward feeds the vision / audio encoders on stage 0 (the model is a VLM whose
            `language_model` holds the layers); a VLM without such an entry is refused.
    """

    text_forward: Callable[[], Callable[..., Any]] | None = None
    outer_forward: Callable[[], Callable[..., Any]] | None = None
    multimodal: bool = False


PIPELINE_FORWARDS: dict[str, PipelineForward] = {}
"""`model_type` -> how to patch it; looked up by the model's `model_type`, then its text config's, then its inner
module's. Extend it with `register_pipeline_forward`."""


def register_pipeline_forward(
    model_type: str,
    *,
    text_forward: Callable[[], Callable[..., Any]] | None = None,
    outer_forward: Callable[[], Callable[..., Any]] | None = None,
    multimodal: bool = False,
) -> PipelineForward:
    """Register (or replace) the pipeline forwards of one `model_type`; returns the entry.

    Raises:
        ValueError: `multimodal=True` without an `outer_forward` (images would never reach the vision tower).
    """
    if multimodal and outer_forward is None:
        raise ValueError(
            f"register_pipeline_forward({model_type!r}, multimodal=True) needs an outer_forward that feeds the "
            "vision/audio encoders on the first stage."
        )
    entry = PipelineForward(text_forward=text_forward, outer_forward=outer_forward, multimodal=multimodal)
    PIPELINE_FORWARDS[model_type] = entry
    return entry


def _pipeline_forward_for(model: nn.Module) -> PipelineForward | None:
    config = _config_of(model)
    inner = getattr(model, "model", None)
    model_types = (
        _model_type(config),
        _model_type(getattr(config, "text_config", None)),
        _model_type(_config_of(inner)) if isinstance(inner, nn.Module) else None,
    )
    return next((PIPELINE_FORWARDS[t] for t in model_types if t in PIPELINE_FORWARDS), None)


def _is_vlm(model: nn.Module) -> bool:
    config = _config_of(model)
    if config is not None and getattr(config, "text_config", None) is not None:
        return True
    if getattr(model, "vision_tower", None) is not None:
        return True
    inner = getattr(model, "model", None)
    return inner is not None and any(getattr(inner, attr, None) is not None for attr in ("vision_tower", "visual"))


@dataclass(frozen=True)
class _ForwardPlan:
    """Which module gets which forward: one resolution shared by patching and validation."""

    text_module: nn.Module
    text_name: str
    text_factory: Callable[[], Callable[..., Any]] | None  # None: the generic text forward
    outer_factory: Callable[[], Callable[..., Any]] | None  # None: the generic causal-LM forward
    has_outer: bool  # False: a bare decoder, patched as the text module itself


def _forward_plan(model: nn.Module) -> _ForwardPlan:
    entry = _pipeline_forward_for(model) or PipelineForward()  # no entry: the generic forwards
    inner = getattr(model, "model", None)
    language_model = getattr(inner, "language_model", None)
    if entry.multimodal and language_model is not None:
        return _ForwardPlan(language_model, "model.language_model", entry.text_forward, entry.outer_forward, True)
    if inner is not None:
        return _ForwardPlan(inner, "model", entry.text_forward, entry.outer_forward, True)
    return _ForwardPlan(model, "", entry.text_forward, None, False)


def _assign_pipeline_forwards(
    model: nn.Module, *, inner: bool, outer: bool, assign: Callable[[nn.Module, Callable[[], Any], bool], None]
) -> None:
    """Give `model`'s modules their pipeline forwards as `_forward_plan` resolves them, through
    `assign(module, forward_factory, hidden_states_supported)`: the text decoder the text forward (`inner`), the
    top-level model of a causal LM or VLM the outer forward (`outer`); a bare decoder is its own text decoder.
    `hidden_states_supported`: the generic causal-LM forward can return hidden states."""
    plan = _forward_plan(model)  # a bare decoder's text module is the model itself
    if inner:
        assign(plan.text_module, plan.text_factory or partial(create_pipeline_forward_inner, "PipelineStage"), False)
    if outer and plan.has_outer:
        assign(model, plan.outer_factory or create_pipeline_forward_causal_lm, plan.outer_factory is None)


def _bind_forward(module: nn.Module, factory: Callable[[], Any], hidden_states_supported: bool) -> None:
    bind_method(module, "forward", factory())
    if hidden_states_supported:
        module._pp_return_hidden_states_supported = True  # type: ignore[assignment]


def patch_hf_model_for_pp(model: Any, patch_inner_model: bool = True, patch_causal_lm_model: bool = True) -> nn.Module:
    """Bind pipeline-friendly forwards onto `model` (in place) and return it: upstream's API, kept for its callers.
    The stage builder does not patch: `build_stage_modules` gives its own copies the same forwards as their
    classes' (`stage_modules._stage_class`), from the same resolution (`_assign_pipeline_forwards`).

    Skip this for models that keep their own forward (`model_keeps_self_forward`). The model's `PIPELINE_FORWARDS`
    entry (if any) picks the forwards: a multimodal entry patches `model.model.language_model` and the top-level
    model; otherwise the inner `.model` (causal LM) or the model itself (a bare decoder) gets the text forward, and a
    causal LM's top-level model the generic causal-LM forward.
    """
    _assign_pipeline_forwards(model, inner=patch_inner_model, outer=patch_causal_lm_model, assign=_bind_forward)
    return model


def statically_defines(obj: Any, name: str) -> bool:
    """True when `obj`'s class (or the object) really defines `name` (Mocks and __getattr__ do not count)."""
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return False
    return True


# The built-in architecture-specific forwards register themselves in PIPELINE_FORWARDS on import; their upstream
# names, and validation's, stay importable from here.
from .hf_models import (  # noqa: E402
    create_pipeline_forward_gemma4_text,
    create_pipeline_forward_gemma4_vlm,
    create_pipeline_forward_mistral3_vlm,
)
from .hf_validation import (  # noqa: E402
    check_forward_reproduction,
    forward_reproduction_problems,
    validate_hf_model_for_pipeline_support,
)
