"""The cases of the FSDP2 test group: `run_on_group` runs every case on a real 2-rank gloo group (launched once by
test_fsdp2.py through am-testing) and returns facts as JSON-shaped data.

Each case returns JSON-serialisable facts (or the traceback of its failure); test_fsdp2.py asserts on them.
"""

from __future__ import annotations

import json
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from am_precision_toy_models import UNROUNDABLE, ToyLM
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from am_precision import (
    assert_fp32_contract,
    cast_frozen_modules_to_compute_dtype,
    cast_model_to_dtype,
    compute_lm_head_logits,
    fp32_report,
    prepare_for_final_backward,
    prepare_for_grad_accumulation,
    yield_fp32_model,
)

BF16 = torch.bfloat16
CASES: dict[str, Callable[[DeviceMesh], dict[str, Any]]] = {}


def case(fn: Callable[[DeviceMesh], dict[str, Any]]) -> Callable[[DeviceMesh], dict[str, Any]]:
    CASES[fn.__name__] = fn
    return fn


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def shard_of(full: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The dim-0 shard FSDP2 gives this rank (torch.chunk semantics)."""
    chunks = torch.chunk(full, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else full[:0]


def sharded_toy(mesh: DeviceMesh) -> tuple[ToyLM, dict[str, torch.Tensor]]:
    """ToyLM with strict `lm_head` + router bias, non-strict `norm` (params and a buffer), FSDP2 per block."""
    torch.manual_seed(0)
    model = ToyLM()
    model._keep_in_fp32_modules_strict = ["lm_head", "router.e_score_correction_bias"]
    model._keep_in_fp32_modules = ["norm"]
    model.final_norm.register_buffer("running_scale", torch.full((8,), UNROUNDABLE))
    original = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)  # fp32 group of its own: FSDP2 all-gathers one dtype per group
    fully_shard(model, mesh=mesh)
    return model, original


@case
def strict_and_non_strict_params(mesh: DeviceMesh) -> dict[str, Any]:
    model, original = sharded_toy(mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cast_model_to_dtype(model, BF16)
    params = dict(model.named_parameters())
    facts: dict[str, Any] = {"warnings": [str(w.message) for w in caught]}
    facts["params"] = {
        name: {
            "dtensor": isinstance(p, DTensor),
            "dtype": dtype_name(p),
            "local_exact": torch.equal(p.to_local(), shard_of(original[name], mesh).to(p.dtype)),
            "full_exact": torch.equal(p.full_tensor(), original[name].to(p.dtype)),
        }
        for name, p in params.items()
    }
    facts["buffers"] = {
        name: {"dtype": dtype_name(b), "exact": torch.equal(b, original[name].to(b.dtype))}
        for name, b in model.named_buffers()
    }
    facts["original_bias_rounds_in_bf16"] = not torch.equal(
        original["layers.0.router.e_score_correction_bias"].to(BF16).float(),
        original["layers.0.router.e_score_correction_bias"],
    )
    # Forward/backward parity with an unsharded copy holding the same dtypes: proves FSDP2 re-registered its
    # sharded storage after the cast (a stale storage would all-gather the old values).
    reference = ToyLM()
    with torch.no_grad():
        for name, tensor in [*reference.named_parameters(), *reference.named_buffers()]:
            target = params[name].dtype if name in params else dict(model.named_buffers())[name].dtype
            tensor.data = original[name].to(target)
    reference.final_norm.register_buffer("running_scale", original["final_norm.running_scale"])
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    out, ref_out = model(ids), reference(ids)
    out.float().pow(2).mean().backward()
    facts["forward_dtype"] = dtype_name(out)
    facts["forward_max_abs_diff"] = (out.float() - ref_out.float()).abs().max().item()
    facts["lm_head_grad_dtype"] = dtype_name(model.lm_head.weight.grad)
    facts["report"] = str(fp32_report(model, storage_dtype=BF16))
    try:
        assert_fp32_contract(model, storage_dtype=BF16)
        facts["contract_error"] = None
    except AssertionError as err:
        facts["contract_error"] = str(err)
    report = fp32_report(model, storage_dtype=BF16)
    facts["report_entries"] = {
        e.name: {
            "dtensor": e.is_dtensor,
            "dtype": dtype_name(torch.empty(0, dtype=e.dtype)),
            "rule": None if e.rule is None else [e.rule.keyword, e.rule.strict],
            "pinned": e.pinned,
            "note": e.note,
        }
        for e in report.entries
    }
    return facts


@case
def cast_after_forward_while_root_is_unsharded(mesh: DeviceMesh) -> dict[str, Any]:
    """FSDP2 keeps the root's parameters unsharded after forward; the cast must classify the sharded parameters
    (the ones FSDP2's _apply re-registers), or strict pins in the root group would be missed."""
    model, original = sharded_toy(mesh)
    # The root group (embed, final_norm) is all strict: one dtype per FSDP2 group.
    model._keep_in_fp32_modules_strict = ["lm_head", "router.e_score_correction_bias", "embed", "final_norm"]
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.no_grad():
        model(ids)  # no backward: the root stays unsharded
    root_unsharded = not isinstance(model.embed.weight, DTensor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cast_model_to_dtype(model, BF16)
    params = dict(model.named_parameters())
    # No forward after this cast: FSDP2 (torch 2.15) keeps its all-gather buffers from the first forward in the
    # old dtype, so a model must be cast before its first forward (see the README).
    return {
        "root_unsharded_before_cast": root_unsharded,
        "root_params": {
            name: [isinstance(params[name], DTensor), dtype_name(params[name])]
            for name in ("embed.weight", "final_norm.weight")
        },
        "root_exact": all(
            torch.equal(params[name].full_tensor(), original[name]) for name in ("embed.weight", "final_norm.weight")
        ),
        "block_proj": dtype_name(params["layers.0.proj.weight"]),
        "warnings": [str(w.message) for w in caught],
    }


@case
def plain_to_after_sharding_breaks_contract(mesh: DeviceMesh) -> dict[str, Any]:
    model, _ = sharded_toy(mesh)
    model.to(BF16)
    violations = fp32_report(model).violations
    return {"violations": sorted(e.name for e in violations)}


@case
def skip_modules_keeps_fp32_holder(mesh: DeviceMesh) -> dict[str, Any]:
    facts = {}
    for skip in ((), ("_fp32_params",)):
        torch.manual_seed(1)
        model = ToyLM()
        model._fp32_params = nn.Module()
        model._fp32_params.a_log = nn.Parameter(torch.full((6, 2), UNROUNDABLE))
        exact = model._fp32_params.a_log.detach().clone()
        fully_shard(model._fp32_params, mesh=mesh)
        fully_shard(model, mesh=mesh)
        cast_model_to_dtype(model, BF16, skip_modules=skip)
        holder = model._fp32_params.a_log
        facts["with_skip" if skip else "without_skip"] = {
            "dtensor": isinstance(holder, DTensor),
            "dtype": dtype_name(holder),
            "full_exact": torch.equal(holder.full_tensor().float(), exact),
            "local_exact": torch.equal(holder.to_local().float(), shard_of(exact, mesh)),
            "other_dtype": dtype_name(model.embed.weight),
        }
    return facts


@case
def lm_head_uses_fsdp_param_dtype(mesh: DeviceMesh) -> dict[str, Any]:
    torch.manual_seed(2)
    head = nn.Linear(8, 6, bias=False)
    full_weight = head.weight.detach().clone()
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fully_shard(head, mesh=mesh, mp_policy=policy)
    storage_dtype = dtype_name(head.weight)  # read before forward: a root FSDP2 module stays unsharded after it
    hidden = torch.randn(2, 5, 8)
    out = compute_lm_head_logits(head, hidden, logits_to_keep=3)
    expected = nn.functional.linear(hidden[:, -3:].to(BF16), full_weight.to(BF16))
    try:
        head(hidden)  # without our cast: fp32 input against the bf16 all-gathered weight
        direct_call_error = None
    except RuntimeError as err:
        direct_call_error = str(err)
    return {
        "weight_storage_dtype": storage_dtype,
        "logits_dtype": dtype_name(out.logits),
        "logits_shape": list(out.logits.shape),
        "logits_max_abs_diff": (out.logits.float() - expected.float()).abs().max().item(),
        "direct_call_error": direct_call_error,
    }


@case
def frozen_cast_skips_dtensor_weights(mesh: DeviceMesh) -> dict[str, Any]:
    torch.manual_seed(3)
    model = nn.Module()
    model.tower = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    model.tower.register_buffer("scale", torch.full((4,), UNROUNDABLE))
    model.head = nn.Linear(4, 2)
    model.tower.requires_grad_(False)
    fully_shard(model.tower[0], mesh=mesh)
    cast_frozen_modules_to_compute_dtype(model, BF16)
    return {
        "sharded_weight": [isinstance(model.tower[0].weight, DTensor), dtype_name(model.tower[0].weight)],
        "plain_sibling": dtype_name(model.tower[2].weight),
        "tower_buffer": dtype_name(model.tower.scale),
        "head": dtype_name(model.head.weight),
    }


@case
def yield_fp32_on_sharded_model(mesh: DeviceMesh) -> dict[str, Any]:
    model, _ = sharded_toy(mesh)
    cast_model_to_dtype(model, BF16)
    with yield_fp32_model(model):
        inside = sorted({dtype_name(p) for p in model.parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(UNROUNDABLE)
    head = model.lm_head.weight
    return {
        "inside": inside,
        "after": {n: dtype_name(p) for n, p in model.named_parameters()},
        "head_exact": torch.equal(head.full_tensor(), torch.full(head.shape, UNROUNDABLE)),
        "embed_rounded_once": torch.equal(
            model.embed.weight.full_tensor(), torch.full(model.embed.weight.shape, UNROUNDABLE).to(BF16)
        ),
    }


@case
def deferred_sync_accumulates_the_same_gradients(mesh: DeviceMesh) -> dict[str, Any]:
    """Three micro-batches accumulated with the sync deferred to the last backward give the gradients of plain
    FSDP2 accumulation; no gradient is reduce-scattered before the last backward (plain FSDP2 does it every time)."""
    grads = {}
    calls = {}
    for deferred in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(1 + mesh.get_local_rank())
        batches = [torch.randn(3, 8) for _ in range(3)]
        units = prepare_for_grad_accumulation(model) if deferred else 0
        reduced_early = []  # did a micro-batch before the last reduce-scatter (a sharded .grad appears)?
        for i, x in enumerate(batches):
            if deferred and i == len(batches) - 1:
                prepare_for_final_backward(model)
            model(x).square().mean().backward()
            if i < len(batches) - 1:
                # a reduce-scatter leaves sharded (DTensor) gradients; deferred, the unsharded ones accumulate
                reduced_early.append(all(isinstance(p.grad, DTensor) for p in model.parameters()))
        key = "deferred" if deferred else "plain"
        grads[key] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        calls[key] = {"reduced_early": reduced_early, "units": units}
    return {
        "calls": calls,
        "max_diff": max((grads["deferred"][n] - grads["plain"][n]).abs().max().item() for n in grads["plain"]),
        "pp_noop": prepare_for_grad_accumulation(nn.Linear(2, 2), pp_enabled=True),
    }


def run_on_group(rank: int, world_size: int) -> dict[str, Any]:
    """Every case on this rank of the 2-rank group (am-testing's `run_group` creates and ends it); facts go through
    JSON so the test sees exactly what a JSON file would hold."""
    mesh = init_device_mesh("cpu", (world_size,))
    results: dict[str, Any] = {}
    for name, fn in CASES.items():
        try:
            results[name] = {"ok": True, "facts": fn(mesh)}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        dist.barrier()  # keep ranks in step: a case that failed on one rank must not leave collectives pending
    return json.loads(json.dumps(results))
