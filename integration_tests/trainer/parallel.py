"""How the reference trainer parallelizes a model: process group, DeviceMesh, precision, pipeline, CP, FSDP2.

What it is for: the functions the train loop applies to a model, in this fixed order:
    init_distributed -> build_mesh -> apply_precision -> split_pipeline (pp > 1) -> apply_fsdp (`uses_fsdp`)
and `shard_batch_for_cp` on every batch when cp > 1. Everything model-specific is read from the model through the
am-* protocols (keep-in-fp32 rules, pipeline hooks, the CP batch hook); nothing here names a model class.
What it must not do: decide what is valid (config.py and am-capabilities do that, before any collective), or touch
the data, the optimizer or the checkpoints.

Gradient reduction, so that every parallel run computes the single-process gradient of the GLOBAL token-mean loss:
each rank's loss is the token SUM of its own tokens divided by the token count of the whole global batch; the
pipeline schedule sums microbatch gradients (`scale_grads=False`); FSDP2 reduces over the flattened `dp_cp` axis
with divide factor 1 (a sum, not a mean); the ring attention of CP already sends dK/dV back to the ranks that own the
keys. Summing every rank's contribution is therefore exactly the single-process gradient.

Precision (`PRECISIONS`, one rule for every layout): `--dtype bf16` (the default) is mixed precision: fp32 master
weights, gradients and AdamW state, bf16 compute through FSDP2's `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`. Without sharding (dp x cp = 1) the same FSDP2 wrap runs over a mesh of one rank: no
communication, the identical cast-on-forward rule, so a single-process run and a sharded run compute alike.
fp32-pinned modules (strict keep rules) are FSDP2 groups of their own with an fp32 policy: stored and computed in
fp32. `--dtype bf16-pure` stores everything unpinned in bf16 (am-precision's `cast_model_to_dtype`), optimizer
state included: half the memory, but an AdamW update below half a bf16 ulp of a weight is rounded away.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from am_pipelining import find_layers
from am_precision import cast_model_to_dtype, fp32_keep_rules


@dataclass(frozen=True)
class Precision:
    """What `--dtype` means: `storage` of parameters, gradients and optimizer state; `compute` of forward and
    backward (activations, the dtype sent between pipeline stages); `reduce` of FSDP2's gradient reduction."""

    storage: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    warning: str | None = None


PRECISIONS = {
    "bf16": Precision(storage=torch.float32, compute=torch.bfloat16, reduce=torch.float32),
    "bf16-pure": Precision(
        storage=torch.bfloat16,
        compute=torch.bfloat16,
        reduce=torch.float32,
        warning="--dtype bf16-pure stores weights and AdamW state in bf16: updates below half a bf16 ulp of a weight "
        "are rounded away (norm weights may never move); the default --dtype bf16 keeps fp32 master weights",
    ),
    "fp32": Precision(storage=torch.float32, compute=torch.float32, reduce=torch.float32),
}


def uses_fsdp(*, dtype: str, dp: int, cp: int) -> bool:
    """Whether the model parts are wrapped with FSDP2: when sharded over dp x cp, and whenever the compute dtype is
    not the storage dtype (mixed precision: FSDP2's cast-on-forward, over a mesh of one rank if need be)."""
    precision = PRECISIONS[dtype]
    return dp * cp > 1 or precision.compute != precision.storage


def init_distributed(*, timeout_s: float) -> torch.device:
    """Start the default process group from torchrun's environment: NCCL on GPUs, gloo on the CPU.

    A single process started without torchrun gets a one-rank group, so the same code path runs everywhere.
    `timeout_s` bounds every collective: a rank that waits on a dead peer raises instead of hanging.
    """
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_mesh(*, pp: int, dp: int, cp: int, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """One mesh with named axes ("pp", "dp", "cp"), and its flattened dp x cp axis ("dp_cp") that FSDP2 shards over
    (torchtitan's layout: FSDP2 over dp x cp sums gradients over both)."""
    mesh = init_device_mesh(device.type, (pp, dp, cp), mesh_dim_names=("pp", "dp", "cp"))
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")


def apply_precision(model: nn.Module, *, dtype: str) -> None:
    """The storage dtype of `--dtype`: bf16 (`bf16-pure`) with the model's fp32-pinned tensors kept bit-exactly
    (am-precision), or nothing (fp32 storage: `fp32`, and the mixed-precision default `bf16`)."""
    storage = PRECISIONS[dtype].storage
    if storage != torch.float32:
        cast_model_to_dtype(model, storage)


def split_pipeline(
    model: nn.Module, *, mesh: DeviceMesh, plan: Any, cfg: Any, device: torch.device
) -> tuple[list[Any], list[nn.Module]]:
    """This rank's pipeline stages and their modules (am-pipelining), exactly as `plan` (validated before any
    collective) lays them out, with static shapes for the microbatches. The model's hooks (e.g. Nemotron's `mtp` on
    the last stage) are honoured by am-pipelining."""
    from am_pipelining import split_model_into_stages

    return split_model_into_stages(
        model,
        mesh,
        "pp",
        cfg.schedule,
        device,
        plan=plan,
        microbatch_size=cfg.microbatch_size,
        seq_len=cfg.seq_len,
        tensor_dtype=PRECISIONS[cfg.dtype].compute,
    )


def _strict_fp32_modules(model: nn.Module) -> list[nn.Module]:
    """Modules with parameters that a STRICT keep-in-fp32 rule pins (outermost matches only)."""
    strict = [rule for rule in fp32_keep_rules(model) if rule.strict]
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or not any(rule.matches(name) for rule in strict):
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue
        if any(True for _ in module.parameters()):
            found.append((name, module))
    return [module for _, module in found]


def _layer_modules(model: nn.Module) -> list[nn.Module]:
    """One FSDP2 group per layer: the decoder layers (am-pipelining's `find_layers`), then the layers of any other
    `layers` container of the model (e.g. Nemotron's multi-token-prediction depths, `mtp.layers`)."""
    decoder = find_layers(model).container
    layers: list[nn.Module] = list(decoder.children())
    for name, module in model.named_modules():
        if module is decoder or name.rsplit(".", 1)[-1] != "layers":
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            layers.extend(module.children())
    return layers


def apply_fsdp(model: nn.Module, *, shard_mesh: DeviceMesh, dtype: str) -> nn.Module:
    """FSDP2 over the flattened "dp_cp" axis: fp32-pinned modules, then each layer, then the root.

    Strict-fp32 modules get their own group with an fp32 policy (FSDP2 all-gathers a group in one dtype, so they
    must not share a group with bf16 weights), kept unsharded from forward to backward; everything else computes in
    the compute dtype of `dtype` (`PRECISIONS`) and reduces gradients in fp32. A mesh of one rank is fine: then this
    is only the mixed-precision cast-on-forward.
    Gradients are SUMMED over dp_cp (divide factor 1): the loss is already normalized by the global token count.
    """
    precision = PRECISIONS[dtype]
    policy = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=precision.reduce)
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for module in _strict_fp32_modules(model):
        # reshard_after_forward=False: a holder such as Nemotron's `_fp32_params` hands its parameters to the caller,
        # which computes with them after the holder's forward; these modules are tiny, so staying unsharded is cheap.
        fully_shard(module, mesh=shard_mesh, mp_policy=fp32_policy, reshard_after_forward=False)
    for layer in _layer_modules(model):
        fully_shard(layer, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def shard_batch_for_cp(model: nn.Module, batch: dict[str, torch.Tensor], *, mesh: DeviceMesh) -> tuple[Any, dict]:
    """This rank's CP shard of `batch` and the context to run forward and backward in (am-context-parallel).

    A model that declares `_cp_layout = "contiguous"` (Gemma 4) gets the contiguous shard and the ring context its
    layers read; other models get the load-balanced layout with ring attention routed through transformers'
    attention registry. The model is read, never asked to shard.
    """
    from am_context_parallel import make_cp_batch_and_ctx

    return make_cp_batch_and_ctx(mesh, batch, model=model)
