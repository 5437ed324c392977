"""Make HuggingFace models pipeline-stage friendly: tensor-in / tensor-out forwards that tolerate pruned modules.

A pipeline stage keeps only some of the model's modules (the rest are `None`), receives hidden states in the
`input_ids` slot when it is not the first stage, and must return a plain tensor. The generic forwards here implement
that contract for HF decoders and causal LMs (Llama, Qwen3, Mistral, ...) using transformers 5.x names
(`past_key_values`, `inputs_embeds`); causal masks are built once per stage and reused
(`_build_or_reuse_pp_causal_mask`). Architectures that need their own forward (a VLM feeding a vision tower on stage
0, Gemma 4's per-layer-type rotary embeddings) are entries of the `PIPELINE_FORWARDS` table keyed by `model_type`:
`patch_hf_model_for_pp` and `validate_hf_model_for_pipeline_support` consult it, so supporting another one is
`register_pipeline_forward(...)`, not a new branch here. The built-in entries (Gemma 4, Mistral 3) live in
`hf_models`.

This module never imports a model package of this repository and never touches torch pipelining internals.
transformers is imported lazily inside the functions that need it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from am_pipelining._compat import bind_method, is_reentrant_checkpoint_wrapper
from am_pipelining.hf_masks import _build_or_reuse_pp_causal_mask, _layer_attention_type, _layer_items

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
    """True when the model class declares its own forward PP-aware (`_pp_keep_self_forward = True`)."""
    return bool(getattr(type(model), "_pp_keep_self_forward", False))


def _config_of(module: Any) -> Any:
    return getattr(module, "config", None)


def _text_config(config: Any) -> Any:
    text_config = getattr(config, "text_config", None)
    return text_config if text_config is not None else config


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
        position_ids = _default_positions(self, hidden, position_ids)
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


# ------------------------------------------------------------------------------------------------------------
# Patching, buffers, validation
# ------------------------------------------------------------------------------------------------------------


def _model_type(config: Any) -> str | None:
    return getattr(config, "model_type", None) if config is not None else None


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
    for model_type in (
        _model_type(config),
        _model_type(getattr(config, "text_config", None)),
        _model_type(_config_of(inner)) if isinstance(inner, nn.Module) else None,
    ):
        if model_type is not None and model_type in PIPELINE_FORWARDS:
            return PIPELINE_FORWARDS[model_type]
    return None


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

    Skip this for models with `_pp_keep_self_forward = True`. The model's `PIPELINE_FORWARDS` entry (if any) picks
    the forwards: a multimodal entry patches `model.model.language_model` and the top-level model; otherwise the
    inner `.model` (causal LM) or the model itself (a bare decoder) gets the text forward, and a causal LM's
    top-level model the generic causal-LM forward.
    """
    entry = _pipeline_forward_for(model)
    inner = getattr(model, "model", None)
    language_model = getattr(inner, "language_model", None) if inner is not None else None
    text_factory = entry.text_forward if entry is not None and entry.text_forward is not None else None
    text_forward = text_factory() if text_factory is not None else create_pipeline_forward_inner("PipelineStage")
    if entry is not None and entry.multimodal and language_model is not None:
        text_module, outer_factory = language_model, entry.outer_forward
    elif inner is not None:
        text_module = inner
        outer_factory = entry.outer_forward if entry is not None else None
    else:
        if patch_inner_model:
            bind_method(model, "forward", text_forward)
        return model
    if patch_inner_model:
        bind_method(text_module, "forward", text_forward)
    if patch_causal_lm_model:
        if outer_factory is not None:
            bind_method(model, "forward", outer_factory())
        else:
            bind_method(model, "forward", create_pipeline_forward_causal_lm())
            model._pp_return_hidden_states_supported = True
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
        entry = _pipeline_forward_for(model)
        if _is_vlm(model) and not model_keeps_self_forward(model) and not (entry is not None and entry.multimodal):
            aware = ", ".join(sorted(t for t, e in PIPELINE_FORWARDS.items() if e.multimodal))
            issues.append(
                f"{type(model).__name__} (model_type={_model_type(config)!r}) is a multimodal model that is not on the "
                f"pipeline-aware list ({aware}): images would never reach its vision tower. Fix: register its "
                "forwards with `register_pipeline_forward(model_type, outer_forward=..., multimodal=True)`, or give "
                "the class a PP-aware forward and set `_pp_keep_self_forward = True`, or train it without PP."
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


# The built-in architecture-specific forwards register themselves in PIPELINE_FORWARDS on import; their upstream
# names stay importable from here.
from am_pipelining.hf_models import (  # noqa: E402
    create_pipeline_forward_gemma4_text,
    create_pipeline_forward_gemma4_vlm,
    create_pipeline_forward_mistral3_vlm,
)
