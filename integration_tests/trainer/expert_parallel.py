"""Expert parallelism (EP) in the reference trainer: the ep meshes, sharding the experts, and a step's expert load.

Where EP lives (torchtitan's rule: ep is carved out of the data-parallel ranks, so it adds no processes): the mesh
stays ("pp", "dp", "cp"). Within one pipeline stage, the flattened "dp_cp" axis (rank index d x cp + c) is
unflattened into ("expert_dp", "ep") with ep innermost (am-moe's `build_expert_meshes`): an ep group is `ep`
consecutive dp_cp ranks of the same stage, and expert_dp = dp x cp / ep groups hold copies of the experts. E.g.
    dp 2, ep 2:        the ep group is the dp group; expert_dp = 1
    dp 2, cp 2, ep 2:  the ep group is the cp group {(d, 0), (d, 1)}; expert_dp is the dp group
    dp 4, ep 2:        ep groups {d0, d1} and {d2, d3}; expert_dp groups {d0, d2} and {d1, d3}
Every rank of an ep group holds the same pipeline stage and runs the same schedule actions in the same order, so its
all-to-alls (one pair per MoE layer and microbatch, forward and backward) always meet; they sit inside a stage's
action like CP's ring transfers (see parallel.py).

Order (trainer/loop.py): pipeline split -> `apply_expert_parallel` (the model's `apply_expert_parallel(ep_mesh)` hook
on every stage module: expert weights become DTensor Shard(0) over ep, dispatch becomes all-to-all) -> `apply_fsdp`
with `expert_mesh`: the experts FSDP2-sharded over expert_dp first (`am_moe.fully_shard_experts`), then the layers and
the root over dp_cp as without EP.
Data and gradients: EP changes neither. Each dp x cp rank keeps its own data shard; the all-to-all backward brings
every token's expert gradient home to the expert's owner, so summing over expert_dp (FSDP2, divide factor 1) covers
every data rank exactly once, as the dense parameters' sum over dp_cp does.
What it must not do: decide what is valid (config.expert_parallel_plan and am-capabilities do, before any
collective; the run plan carries the EP plan), or name a model class (the experts are found through the model's
hook and am-moe's `GroupedExperts`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def has_experts(model: nn.Module) -> bool:
    """Whether `model` computes experts through am-moe (`GroupedExperts`): the load statistics exist only then."""
    from am_moe import expert_modules

    return bool(expert_modules(model))


def apply_expert_parallel(parts: list[nn.Module], *, ep_mesh: DeviceMesh) -> None:
    """Shard the experts of every model part (pipeline stage module, or the whole model) over `ep_mesh` through the
    hook its contract declares (`contract_of(part).ep.apply`, the model's `apply_expert_parallel`; am-capabilities
    checked that it exists). A stage without MoE layers shards nothing. Collective over `ep_mesh`.

    NOTE: after the pipeline split (a stage module is a pruned copy of the model), before any `fully_shard`.
    """
    from am_model_contract import contract_of

    for part in parts:
        hook = contract_of(part).ep.apply
        if hook is None:
            raise ValueError(f"{type(part).__name__} declares no expert-parallel hook (contract ep.apply); use --ep 1")
        hook(ep_mesh)


def step_expert_imbalance(
    parts: list[nn.Module], *, data_group: Any, pp_group: Any, device: torch.device, on_load: Any = None
) -> float:
    """This step's expert load imbalance over the whole model: the largest, over every MoE layer of every stage, of
    (tokens routed to the busiest expert) / (mean tokens per expert), counted on the global batch. Resets the
    counters for the next step.

    Collective: the per-expert counts are summed over `data_group` (dp x cp: every rank counts its own tokens, before
    dispatch; am-moe's `expert_load`), then the largest ratio is taken over `pp_group` (each stage holds its own
    layers). Call it on every rank, once per step, after the step's forwards and before any other forward (an
    evaluation forward would be counted too). NaN when no MoE layer saw a token.

    on_load: called as `on_load(part, load)` with each part's global `am_moe.ExpertLoad` (the bias update of
    trainer/moe_balance.py reads the same counts; no second all-reduce).
    """
    from am_moe import expert_load

    ratios = []
    for part in parts:
        load = expert_load(part, group=data_group, reset=True)
        if on_load is not None:
            on_load(part, load)
        ratios.append(load.max_imbalance())
    seen = [r for r in ratios if r is not None and not math.isnan(r)]
    worst = torch.tensor(max(seen) if seen else -1.0, dtype=torch.float64, device=device)
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pp_group)
    value = float(worst)
    return value if value >= 0 else math.nan


__all__ = [
    "apply_expert_parallel",
    "has_experts",
    "step_expert_imbalance",
]
