"""Causal and sliding-window masks for pipeline stages, built once per stage and reused.

Every stage rebuilds its masks (masks never travel between stages: only tensors do); `_build_or_reuse_pp_causal_mask`
caches the mapping on the stage's text module when nothing varies between microbatches. Also: which mask kind a
decoder layer needs, and the (global index, layer) pairs of a pruned layer container.

Never imports a model package; transformers is imported lazily.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


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
    key = (*inputs_embeds.shape[:2], inputs_embeds.dtype, inputs_embeds.device, tuple(sorted(kinds)))
    cache = module.__dict__.get("_pp_causal_mask_cache")
    if not isinstance(cache, dict):
        cache = module.__dict__["_pp_causal_mask_cache"] = {}
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
