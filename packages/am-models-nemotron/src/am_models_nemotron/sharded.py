"""Nemotron-H at real size: build on the meta device, shard, then give each rank only its own initialized blocks.

What it is for, in the order a trainer calls it (torchtitan's order; nothing is allocated before the last step):
    model = NemotronHForCausalLM.from_config(config, device="meta")     # or from_pretrained(folder, device_map="meta")
    ... pipeline split, model.apply_expert_parallel(ep_mesh), am_moe.fully_shard_experts / fully_shard ...
    materialize_sharded(model, seed=0, device="cuda")                # random init, OR instead:
    model.to_empty(device="cuda"); load_sharded_checkpoint(model, folder)   # (checkpoint.py) this rank's slices
`materialize_sharded` runs the model's own init per unit (`init_units`: the embedding, the final norm, each backbone
layer, the LM head, each MTP sublayer) on a full CPU twin seeded per unit (am_model_io.materialize_sharded_), so
dp 1, FSDP2 dp 2, ep 2 and every pipeline stage hold exactly the values of the single process running the same call.
That seeded init is not `initialize_weights()`'s (one global RNG stream over the whole model, whose values depend
on the order of the tensors): a run that compares layouts uses `materialize_sharded` at every size, dp 1 included.
What it must not do: issue a collective, or allocate more than one unit (one decoder layer) in full on a rank.
"""

from __future__ import annotations

import torch
from torch import nn

from am_model_io import InitUnit, materialize_sharded_

from ._init import reset_linear_, weight_of
from .model import NemotronHForCausalLM

__all__ = ["init_units", "materialize_sharded", "meta_twin"]


def meta_twin(model: NemotronHForCausalLM) -> NemotronHForCausalLM:
    """The whole unsharded model `model` was built as (same config, backend and MTP options), on the meta device.

    A pipeline stage or a sharded model keeps its qualified names; the twin has every one of them with its full
    shape, which the strict checkpoint check and the per-unit init read (no storage is allocated)."""
    mtp = model.mtp_config
    return type(model)(
        model.config,
        model.backend,
        device="meta",
        num_nextn_predict_layers=mtp.num_layers,
        mtp_loss_scaling_factor=mtp.loss_scaling_factor,
        mtp_use_repeated_layer=mtp.use_repeated_layer,
    )


def init_units(model: NemotronHForCausalLM) -> list[InitUnit]:
    """The units of the seeded init, with the same init code as `initialize_weights`: embedding and LM head
    normal(0, initializer_range), the final norm's reset, each block's `init_weights` (backbone and MTP)."""
    cfg = model.nemotron_config
    std = cfg.initializer_range

    def embedding(module: nn.Module) -> None:
        nn.init.normal_(weight_of(module), mean=0.0, std=std)

    def block(module: nn.Module) -> None:
        module.init_weights(  # type: ignore[operator]
            num_hidden_layers=cfg.num_hidden_layers, rescale_prenorm_residual=cfg.rescale_prenorm_residual
        )

    units = [InitUnit("model.embed_tokens", embedding), InitUnit("model.norm", reset_linear_)]
    units += [InitUnit(f"model.layers.{key}", block) for key in model.model.layers]
    units.append(InitUnit("lm_head", embedding))
    if model.mtp is not None:
        units += [InitUnit(f"mtp.layers.{i}", block) for i in range(len(model.mtp.layers))]
    return units


def materialize_sharded(
    model: NemotronHForCausalLM, *, seed: int, device: torch.device | str = "cpu"
) -> NemotronHForCausalLM:
    """Allocate this rank's blocks of a meta-built (and possibly split / ep-sharded / FSDP2-wrapped) model on
    `device` and initialize them with the seeded per-unit init: the values equal the single process's
    `materialize_sharded(from_config(config, device="meta"), seed=seed)` whatever the layout. Floating tensors keep
    the model's dtypes (sampled in fp32, cast once; fp32-pinned tensors stay fp32). No collective.

    Peak host memory: this rank's blocks plus one init unit (the largest decoder layer) in fp32.

    Raises:
        ValueError: a tensor already materialized (build on the meta device), or one no unit covers (listed).
    """
    twin = meta_twin(model)
    materialize_sharded_(model, template=twin, units=init_units(twin), seed=seed, device=device)
    return model
