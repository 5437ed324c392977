"""Nemotron-H's tensor-parallel plan, as data, and the Mamba2 mixer's own head-parallel layout (Megatron's).

What it is for: the `{module pattern: style}` maps (transformers' style names) that am-tensor-parallel applies over a
`tp` mesh dimension, one per module class (each class's `_tp_plan`, patterns relative to it, merged by
`am_tensor_parallel.declared_plan` the way transformers merges them):
  - `NemotronV3Model`: the vocabulary-parallel `embed_tokens`; `NemotronHForCausalLM`: a gathered `lm_head`;
  - `NemotronAttention`: q/k/v `colwise` (whole heads: attention and KV heads must divide by tp), `o_proj` `rowwise`;
  - `NemotronMLP` (dense MLP layers and the MoE's shared expert): `up_proj` `colwise`, `down_proj` `rowwise`;
  - `Mamba2Mixer`: `"module"` — the mixer shards itself with `Mamba2HeadParallel` (below);
  - `NemotronMoE`: `"sequence_gather"` (whole on every tp rank; see sequence parallelism); `MTPModule`: its fusion
    projections `"sequence_gather"`.
Routed experts are NOT tensor-parallel: under tp every tp rank keeps the whole MoE router and experts (the same tokens
reach them on every tp rank); expert parallelism (`apply_expert_parallel` over an `ep` mesh dimension) splits the
experts, whole, over the ep ranks. The MoE latent projections (`fc1/fc2_latent_proj`) stay replicated too.

Mamba2 under TP (as Megatron-LM's `MambaMixer`): each rank owns `heads / tp` heads and `n_groups / tp` groups.
`in_proj` `[z | x | B | C | dt]` is split per segment (z and x by heads, B and C by groups, dt by heads), the
depthwise `conv1d` per channel of `[x | B | C]` (the same segments), the gated RMSNorm per group (whole groups stay on
one rank, so its statistics are exact), `A_log` / `dt_bias` / `D` per head, and `out_proj` row-wise (input features
by heads; the partial outputs summed over tp). Since no DTensor placement describes a slice of every segment, the
mixer's parameters are plain tensors holding this rank's shard; `gather_mamba2_state_dict` re-assembles them.
A tp that does not divide the heads or the groups is refused (`tensor_parallel_problems`: the groups cannot be split
exactly, so the plan says so and am-capabilities refuses `supports_tp` at that tp with the reason).

Sequence parallelism (`sequence_parallel=True`): the residual stream and the block norms run on sequence shards;
attention, MLP and Mamba2 regions gather their input once and reduce-scatter their output (Mamba2: `region_output`);
the routed MoE (`NemotronMoE`: `"sequence_gather"`) and the MTP fusion projections run on whole sequences (input
gathered, output sliced back), so routing, balancing and expert parallelism see exactly what they see without it.
Not supported under tp (refused before any collective with the reason): a bias on Mamba2's `out_proj` under sequence
parallelism, and a non-torch linear backend for the mixer's projections.
Generation with a cache is not sharded (the cache is allocated with the full sizes): generate with tp=1.

What it must not do: import a model module (the model modules import it); plan dicts are plain data.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from am_tensor_parallel import SummedLinear, gather_segments, region_input, shard_segments

__all__ = [
    "ATTENTION_TP_PLAN",
    "BACKBONE_TP_PLAN",
    "CAUSAL_LM_TP_PLAN",
    "MAMBA2_TP_PLAN",
    "MLP_TP_PLAN",
    "MOE_TP_PLAN",
    "MTP_TP_PLAN",
    "Mamba2HeadParallel",
    "conv_segments",
    "gather_mamba2_grads",
    "gather_mamba2_state_dict",
    "in_proj_segments",
    "mamba2_full_state",
    "mamba2_shard_state",
    "mamba2_tp_problems",
]

BACKBONE_TP_PLAN = MappingProxyType({"embed_tokens": "embedding_rowwise"})
CAUSAL_LM_TP_PLAN = MappingProxyType({"lm_head": "colwise_gather_output"})
ATTENTION_TP_PLAN = MappingProxyType(
    {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
)
MLP_TP_PLAN = MappingProxyType({"up_proj": "colwise", "down_proj": "rowwise"})
MAMBA2_TP_PLAN = MappingProxyType({"": "module"})  # "" = the mixer itself: Mamba2HeadParallel
# Routed MoE (router, experts, latent projections) whole on every tp rank, on whole sequences: under sequence
# parallelism its input is gathered from the sequence shards and its output sliced back (routing, the balancing
# terms and the ep all-to-all see the tokens they see without it); the shared expert inside stays a TP region.
MOE_TP_PLAN = MappingProxyType({"": "sequence_gather"})
# MTP depth fusion `eh_proj([enorm(e); hnorm(h)])`: a replicated projection on the stream, run on whole sequences
# under sequence parallelism (only the first sublayer of a depth has one: hence a pattern on the MTP module).
MTP_TP_PLAN = MappingProxyType({"layers.*.eh_proj": "sequence_gather"})


def in_proj_segments(mixer: Any) -> dict[str, int]:
    """The packed output features of `in_proj`, in order: `{z: I, x: I, B: G·N, C: G·N, dt: heads}`."""
    groups = mixer.n_groups * mixer.ssm_state_size
    inner = mixer.intermediate_size
    return {"z": inner, "x": inner, "B": groups, "C": groups, "dt": mixer.num_heads}


def conv_segments(mixer: Any) -> dict[str, int]:
    """The channels of the depthwise `conv1d`, in order: `{x: I, B: G·N, C: G·N}`."""
    segments = in_proj_segments(mixer)
    return {name: segments[name] for name in ("x", "B", "C")}


def mamba2_tp_problems(mixer: Any, tp: int, *, sequence_parallel: bool = False) -> list[str]:
    """Why the Mamba2 mixer cannot be split by heads over `tp` ranks; [] if it can. Pure (reads sizes only)."""
    problems = []
    if mixer.num_heads % tp:
        problems.append(
            f"Mamba2 has {mixer.num_heads} heads, which cannot be split over tp={tp}; choose a tp that divides them"
        )
    if mixer.n_groups % tp:
        problems.append(
            f"Mamba2 has n_groups={mixer.n_groups} B/C groups, which cannot be split exactly over tp={tp} (each rank "
            f"needs whole groups for its heads, as in Megatron); choose a tp that divides {mixer.n_groups}"
        )
    for name in ("in_proj", "out_proj"):
        if type(getattr(mixer, name)) is not nn.Linear:
            problems.append(
                f"Mamba2 {name} is a {type(getattr(mixer, name)).__name__}; the head-parallel layout shards "
                "torch nn.Linear projections only (BackendConfig(linear='torch'))"
            )
    if sequence_parallel and mixer.out_proj.bias is not None:
        problems.append("Mamba2 out_proj has a bias, which the sequence-parallel reduce-scatter does not add once")
    return problems


class Mamba2HeadParallel(ParallelStyle):
    """Shard a `Mamba2Mixer` in place by heads over a 1-D tp mesh (see the module docstring for the layout).

    After it, the mixer's sizes (`num_heads`, `n_groups`, `intermediate_size`, `conv_dim`) are this rank's, its
    parameters hold this rank's shard as plain tensors, its input enters as the replicated hidden states
    (`[B, S, H]`, gradient summed over tp) and its output is the sum of the ranks' `out_proj` partial outputs
    (`[B, S, H]`, all-reduced; reduce-scattered to the `Shard(1)` stream under sequence parallelism).
    """

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mixer: Any = module
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        problems = mamba2_tp_problems(mixer, tp, sequence_parallel=self.sequence_parallel)
        if problems:
            raise ValueError("cannot shard the Mamba2 mixer by heads: " + "; ".join(problems))
        segments, channels = in_proj_segments(mixer), conv_segments(mixer)
        mixer._tp_full_segments = {"in_proj": segments, "conv1d": channels}  # read by gather_mamba2_state_dict
        mixer._tp_rank = (tp, rank)  # read by mamba2_shard_state (the mixer's `tensor_parallel_shard_state`)

        def keep(owner: nn.Module, name: str, value: torch.Tensor) -> None:
            param = getattr(owner, name)
            owner.register_parameter(name, nn.Parameter(value.detach().clone(), requires_grad=param.requires_grad))

        # One layout, written once (`_shard_one`): on a meta-built model (the trainer's order) the shards are meta
        # tensors of the local shapes, filled later through `mamba2_shard_state`; on a real one they are the values.
        with torch.no_grad():
            for name, tensor in _mamba2_tensors(mixer, lambda p: p):
                owner, attribute = name.rsplit(".", 1)
                keep(mixer.get_submodule(owner), attribute, _shard_one(name, tensor, mixer._tp_full_segments, tp, rank))
        for name in ("A_log", "D"):  # the optimizer's no-weight-decay markers, as on the full parameters
            getattr(mixer._fp32_params, name)._no_weight_decay = True

        mixer.num_heads //= tp
        mixer.n_groups //= tp
        mixer.intermediate_size //= tp
        mixer.conv_dim //= tp
        mixer.in_proj.out_features //= tp
        mixer.out_proj.in_features //= tp
        for attr in ("in_channels", "out_channels", "groups"):
            setattr(mixer.conv1d, attr, getattr(mixer.conv1d, attr) // tp)
        # norm.group_size stays: a group keeps all its channels on one rank

        def enter(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            return (region_input(args[0], device_mesh), *args[1:]), kwargs

        mixer.register_forward_pre_hook(enter, with_kwargs=True)
        # out_proj (its input-feature shard) becomes the region's exit: partial products summed over tp, bias once
        mixer.out_proj = SummedLinear.take(mixer.out_proj, device_mesh, sequence_parallel=self.sequence_parallel)
        return mixer


def gather_mamba2_state_dict(model: nn.Module, *, group: Any = None) -> dict[str, torch.Tensor]:
    """The full tensors of every head-sharded Mamba2 mixer of `model`, by state-dict name (collective over the tp
    `group`: call on every tp rank). Merge into `model.state_dict()` before saving a checkpoint or comparing."""
    return _gather_all(model, lambda p: p.detach(), group)


def mamba2_full_state(mixer: Any, local: dict[str, torch.Tensor], *, group: Any = None) -> dict[str, torch.Tensor]:
    """am-tensor-parallel's `tensor_parallel_full_state` of a head-sharded mixer: `local` maps names relative to the
    mixer (`in_proj.weight`, `_fp32_params.A_log`, ...) to this rank's shards (plain tensors, e.g. from a full
    FSDP2 state dict); returns them re-assembled to the unsharded shapes, collective over the tp `group` (every tp
    rank calls it with the same names, in the same order). Names the layout does not shard (`out_proj.bias`) and
    a mixer that is not sharded come back unchanged."""
    segments = getattr(mixer, "_tp_full_segments", None)
    if segments is None:
        return dict(local)
    sharded = {name for name, _ in _mamba2_tensors(mixer, lambda p: p)}
    return {
        name: _gather_one(name, tensor, segments, group) if name in sharded else tensor
        for name, tensor in local.items()
    }


def mamba2_shard_state(mixer: Any, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """am-tensor-parallel's `tensor_parallel_shard_state` of a head-sharded mixer (the inverse of
    `mamba2_full_state`): `full` maps names relative to the mixer (`in_proj.weight`, `_fp32_params.A_log`, ...) to
    unsharded tensors; returns this rank's shards of them, cut exactly as `Mamba2HeadParallel` cuts (no
    collective). Names the layout does not shard (`out_proj.bias`) and a mixer that is not sharded come back
    unchanged. Used to materialize or load a mixer that was sharded on the meta device."""
    layout = getattr(mixer, "_tp_rank", None)
    if layout is None:
        return dict(full)
    tp, rank = layout
    sharded = {name for name, _ in _mamba2_tensors(mixer, lambda p: p)}
    return {
        name: _shard_one(name, tensor, mixer._tp_full_segments, tp, rank) if name in sharded else tensor
        for name, tensor in full.items()
    }


def gather_mamba2_grads(model: nn.Module, *, group: Any = None) -> dict[str, torch.Tensor]:
    """`gather_mamba2_state_dict` for the parameters' gradients (collective; parameters without a gradient skipped)."""
    return _gather_all(model, lambda p: p.grad, group)


def _gather_all(model: nn.Module, read: Any, group: Any) -> dict[str, torch.Tensor]:
    """`read(param)` of every head-sharded mixer's parameters, re-assembled by state-dict name (None skipped)."""
    full: dict[str, torch.Tensor] = {}
    for prefix, mixer in model.named_modules():
        segments = getattr(mixer, "_tp_full_segments", None)
        if segments is None:
            continue
        for name, tensor in _mamba2_tensors(mixer, read):
            if tensor is not None:
                full[f"{prefix}.{name}"] = _gather_one(name, tensor, segments, group)
    return full


def _mamba2_tensors(mixer: Any, read: Any) -> list[tuple[str, Any]]:
    named = [
        ("in_proj.weight", mixer.in_proj.weight),
        ("in_proj.bias", mixer.in_proj.bias),
        ("conv1d.weight", mixer.conv1d.weight),
        ("conv1d.bias", mixer.conv1d.bias),
        ("norm.weight", mixer.norm.weight),
        ("_fp32_params.A_log", mixer._fp32_params.A_log),
        ("_fp32_params.dt_bias", mixer._fp32_params.dt_bias),
        ("_fp32_params.D", mixer._fp32_params.D),
        ("out_proj.weight", mixer.out_proj.weight),
    ]
    return [(name, read(param)) for name, param in named if param is not None]


def _shard_one(
    name: str, tensor: torch.Tensor, segments: dict[str, dict[str, int]], tp: int, rank: int
) -> torch.Tensor:
    """Rank `rank`'s shard of the mixer's unsharded tensor `name` (the inverse of `_gather_one`): in_proj / conv1d
    per segment, out_proj's input features, the gated norm's channels and A_log / dt_bias / D by heads."""
    owner = name.split(".")[0]
    if owner in segments:
        return shard_segments(tensor, segments[owner], tp=tp, rank=rank)
    dim = 1 if name == "out_proj.weight" else 0
    return tensor.chunk(tp, dim=dim)[rank]


def _gather_one(name: str, tensor: torch.Tensor, segments: dict[str, dict[str, int]], group: Any) -> torch.Tensor:
    owner = name.split(".")[0]
    if owner in segments:
        return gather_segments(tensor, segments[owner], group=group)
    dim = 1 if name == "out_proj.weight" else 0
    return gather_segments(tensor, {"all": tensor.shape[dim] * dist.get_world_size(group)}, group=group, dim=dim)
