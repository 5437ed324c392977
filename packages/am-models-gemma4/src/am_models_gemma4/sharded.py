"""Gemma 4 at real size: build on the meta device, shard, then give each rank only its own blocks.

What it is for, in the order a trainer calls it (nothing is allocated before the last step):
    model = Gemma4ForCausalLM.from_config(config, device="meta")   # or from_pretrained(folder, device_map="meta")
    ... pipeline split, model.apply_expert_parallel(ep_mesh), am_moe.fully_shard_experts / fully_shard ...
    materialize_sharded(model, seed=0, device="cuda")             # random init (text models), OR instead:
    model.to_empty(device="cuda"); load_sharded_checkpoint(model, folder)   # (checkpoint.py) this rank's slices
`materialize_sharded` runs the model's own per-module init (`model.init_module_weights`) per unit — each decoder
layer, each other child of the text model, the untied LM head — on a full CPU twin seeded per unit
(am_model_io.materialize_sharded_), so every layout holds exactly the single process's values for the same call.
Buffers the constructor computes (RoPE inverse frequencies, the embedding scale) are rebuilt from the config, and
the tied LM head is tied again. That seeded init is not the constructor's (one global RNG stream): a run comparing
layouts uses `materialize_sharded` at every size, dp 1 included.
What it must not do: issue a collective, or allocate more than one unit (one decoder layer) in full on a rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import am_moe
from am_model_io import InitUnit, materialize_sharded_

from .config import text_config_of, ties_word_embeddings
from .model import init_module_weights

__all__ = ["init_units", "materialize_sharded", "meta_twin", "restore_constructed_buffers_"]


def meta_twin(model: nn.Module) -> nn.Module:
    """The whole unsharded model `model` was built as (same class and config), on the meta device: every qualified
    name with its full shape, for the strict checkpoint check and the per-unit init (no storage allocated)."""
    with torch.device("meta"):
        return type(model)(model.config)


def init_units(model: nn.Module) -> list[InitUnit]:
    """The units of the seeded init of a `Gemma4ForCausalLM` or `Gemma4ForConditionalGeneration`: each decoder layer,
    every other child of the text model (embeddings, norm, per-layer-input modules, RoPE), and the LM head when it is
    not tied; for a vision-language model also each vision encoder layer, every other vision-tower module that owns a
    tensor (patch embedder, RoPE, standardization), and the multimodal embedder (`_vision_units`)."""
    text = text_config_of(model.config)
    std = float(getattr(text, "initializer_range", 0.02))

    def tree(module: nn.Module) -> None:
        for sub in module.modules():
            init_module_weights(sub, std=std)
        restore_constructed_buffers_(module, config=text)

    prefix = "model.language_model" if hasattr(model.model, "language_model") else "model"
    units = []
    text_model: Any = model.get_submodule(prefix)
    for name, child in text_model.named_children():
        if name == "layers":
            units += [InitUnit(f"{prefix}.layers.{key}", tree) for key in child]
        else:
            units.append(InitUnit(f"{prefix}.{name}", tree))
    if getattr(model.model, "vision_tower", None) is not None:
        units += _vision_units(model)
    if not ties_word_embeddings(model.config):
        units.append(InitUnit("lm_head", tree))
    return units


def _vision_units(model: nn.Module) -> list[InitUnit]:
    """The vision side of a VLM, initialized by transformers' own Gemma 4 rules (the vision tower's `_init_weights`,
    as its constructor does), one unit per encoder layer and per other module owning a tensor directly, and the
    multimodal embedder (`model.embed_vision`) as one unit."""
    container: Any = model.model
    tower: Any = container.vision_tower
    rules = tower._init_weights  # bound to the tower: its vision config's initializer_range

    def vision(module: nn.Module) -> None:
        module.apply(rules)
        restore_constructed_buffers_(module)

    layers = [f"model.vision_tower.encoder.layers.{i}" for i in range(len(tower.encoder.layers))]
    inside = tuple(f"{name}." for name in layers)
    units = [InitUnit(name, vision) for name in layers]
    for name, module in tower.named_modules():
        full = f"model.vision_tower.{name}" if name else "model.vision_tower"
        if full in layers or full.startswith(inside):
            continue
        if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            units.append(InitUnit(full, vision))
    units.append(InitUnit("model.embed_vision", vision))
    return units


@torch.no_grad()
def restore_constructed_buffers_(module: nn.Module, *, config: Any = None) -> None:
    """Recompute the buffers Gemma 4's constructors derive from the config, which no checkpoint holds and
    `to_empty` leaves uninitialized: RoPE inverse frequencies (text and vision; rebuilt from the rotary module's own
    config, or `config`), the scaled embeddings' `embed_scale`, and zero expert load counters."""
    for sub in module.modules():
        if type(sub).__name__.endswith("RotaryEmbedding"):
            fresh = type(sub)(getattr(sub, "config", config))
            for name, computed in fresh.named_buffers():
                sub.get_buffer(name).copy_(computed)
        scale, embed_scale = getattr(sub, "scalar_embed_scale", None), getattr(sub, "embed_scale", None)
        if scale is not None and isinstance(embed_scale, torch.Tensor):
            embed_scale.fill_(scale)
    for _, experts in am_moe.expert_modules(module):
        experts.tokens_per_expert.zero_()


def materialize_sharded(model: nn.Module, *, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Allocate this rank's blocks of a meta-built (and possibly split / ep-sharded / FSDP2-wrapped)
    `Gemma4ForCausalLM` on `device` and initialize them with the seeded per-unit init: the values equal the single
    process's `materialize_sharded(from_config(config, device="meta"), seed=seed)` whatever the layout. No
    collective. Peak host memory: this rank's blocks plus one unit (the largest decoder layer) in fp32.

    Raises:
        ValueError: a tensor already materialized (build on the meta device), or one no unit covers (listed).
    """
    twin = meta_twin(model)
    materialize_sharded_(model, template=twin, units=init_units(twin), seed=seed, device=device)
    tie: Any = model.tie_weights
    tie()  # to_empty re-creates parameters one by one, which unties them
    return model
