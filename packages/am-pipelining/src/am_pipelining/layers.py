"""Where the decoder layers of a model live: `find_layers(model)`.

One answer for the whole package and its users (stage lists, explicit-list validation, the reference trainer's
layer count and FSDP2 grouping): the FQN prefix of the module that holds the `layers` container, the container
itself, how many layers it holds, where the LM head and the multimodal encoders are. Works on full models and on
pruned pipeline stages (whose `layers` is a `ModuleDict` keyed by the original indices).

What it must not do: import a model package or transformers; it looks at module attributes only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .hf_utils import MULTIMODAL_SUFFIXES

__all__ = ["DecoderLayers", "find_layers", "LAYER_PREFIX_CANDIDATES"]

LAYER_PREFIX_CANDIDATES: tuple[str, ...] = (
    "model.language_model.model.",
    "model.language_model.",
    "model.text_model.",
    "model.text_decoder.",
    "model.",
    "language_model.model.",
    "language_model.",
    "backbone.",
    "",
)
"""Prefixes searched, in order, for a module with a `ModuleList` / `ModuleDict` named `layers`."""


@dataclass(frozen=True, eq=False)
class DecoderLayers:
    """Where a model's decoder layers (and the modules around them) live.

    Attributes:
        layers_prefix: FQN prefix of the module holding `layers` ("model.", "model.language_model.", "" ...).
        text_model: that module.
        container: the `layers` ModuleList / ModuleDict.
        num_layers: how many layers the container holds.
        indices: the layers' global indices (a pruned stage keeps the original ones).
        lm_head_fqn: FQN of the LM head, None when the model (or stage) has none.
        nested: the text model sits below the model's own base (a VLM's `language_model`).
        extra_module_fqns: multimodal encoder / projector FQNs that belong to the first stage of a nested model.
        has_rotary_emb: the text model has a `rotary_emb` attribute (replicated on every stage).
    """

    layers_prefix: str
    text_model: nn.Module
    container: nn.ModuleList | nn.ModuleDict
    num_layers: int
    indices: tuple[int, ...]
    lm_head_fqn: str | None
    nested: bool
    extra_module_fqns: tuple[str, ...]
    has_rotary_emb: bool

    @property
    def container_fqn(self) -> str:
        """FQN of the `layers` container, e.g. "model.layers"."""
        return f"{self.layers_prefix}layers"

    def layer_fqn(self, index: int) -> str:
        return f"{self.container_fqn}.{index}"

    @property
    def layers(self) -> list[nn.Module]:
        """The decoder layer modules, in order."""
        return list(self.container.children())


def module_at(model: nn.Module, fqn: str) -> nn.Module | None:
    """The submodule at `fqn` ("" or a trailing "." allowed), None when a part is missing or not a module."""
    module: Any = model
    for part in fqn.rstrip(".").split(".") if fqn.rstrip(".") else []:
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def find_layers(model: nn.Module) -> DecoderLayers:
    """Find the decoder layers of `model` (the first of `LAYER_PREFIX_CANDIDATES` holding a `layers` container).

    Raises:
        ValueError: no `layers` ModuleList / ModuleDict under any candidate prefix.
    """
    text_model: Any = None
    for prefix in LAYER_PREFIX_CANDIDATES:
        text_model = module_at(model, prefix)
        if text_model is not None and isinstance(getattr(text_model, "layers", None), (nn.ModuleList, nn.ModuleDict)):
            break
    else:
        raise ValueError(
            f"Cannot find the decoder layers of {type(model).__name__}: looked for a ModuleList/ModuleDict `layers` "
            f"under {[p or '<root>' for p in LAYER_PREFIX_CANDIDATES]}. Pass module_names_per_stage explicitly."
        )
    container = text_model.layers
    base = "model." if isinstance(getattr(model, "model", None), nn.Module) else ""
    if isinstance(getattr(model, "lm_head", None), nn.Module):
        lm_head_fqn: str | None = "lm_head"
    elif isinstance(getattr(text_model, "lm_head", None), nn.Module):
        lm_head_fqn = f"{prefix}lm_head"
    else:
        lm_head_fqn = None
    nested = prefix != base
    keys = list(container._modules.keys())
    return DecoderLayers(
        layers_prefix=prefix,
        text_model=text_model,
        container=container,
        num_layers=len(container),
        indices=tuple(int(k) for k in keys) if all(k.isdigit() for k in keys) else tuple(range(len(keys))),
        lm_head_fqn=lm_head_fqn,
        nested=nested,
        extra_module_fqns=tuple(f"{base}{suffix}" for suffix in MULTIMODAL_SUFFIXES) if nested else (),
        has_rotary_emb=hasattr(text_model, "rotary_emb"),
    )
