"""Apply a validated `TensorParallelPlan` to a model over a `tp` mesh dimension.

Order (torchtitan's): tensor parallelism first, on the whole model or a pipeline stage, before activation
checkpointing, compile and FSDP2 (which shards over dp x cp on top of these DTensors). Every check runs in
`plan_tensor_parallel` before the first collective; this module only translates and applies.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from .plan import TensorParallelPlan
from .styles import MODULE_STYLE_METHOD, ShardSequence, check_sequence_divisible, enter_region, translate_style
from .validate import plan_tensor_parallel

__all__ = ["apply_tensor_parallel", "reduce_partial_grads", "tp_submesh"]


def tp_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D `tp` dimension of `mesh` (a 1-D mesh named `tp`, or any mesh with a `tp` dimension).

    Raises:
        ValueError: the mesh has no dimension named `tp`.
    """
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        raise ValueError(f"tensor parallelism runs over a mesh dimension named 'tp'; this mesh has {names or 'none'}")
    return mesh if mesh.ndim == 1 else mesh["tp"]


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    plan: TensorParallelPlan | Mapping[str, str] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> TensorParallelPlan:
    """Shard `model` in place over the `tp` dimension of `mesh`; return the plan applied.

    Args:
        model: the model (or pipeline stage), materialized on this rank's device with the same weights on every tp
            rank (each rank keeps its shards), or built on the meta device (each rank then materializes its own
            shards only, e.g. `am_model_io.materialize_sharded_`; a module that shards itself fills its plain
            tensors through its `tensor_parallel_shard_state`); then call `reduce_partial_grads(model)` once it is
            materialized (its forward refuses to run before).
        mesh: a mesh with a `tp` dimension (`tp_submesh`).
        plan: a `TensorParallelPlan` from `plan_tensor_parallel` (trusted: used as it is; then the two flags must stay
            False), a `{pattern: style}` dict, or None for the model's declared plan.
        sequence_parallel: norms and the residual stream between TP regions on sequence shards (`Shard(1)`
            DTensors; the sequence length must divide by tp).
        loss_parallel: keep the head's vocabulary shard `[B, S, V/tp]` (compute the loss with
            `vocab_parallel_cross_entropy`; the model's own `labels=` loss would see only a shard).

    After this, parameters are DTensors on the tp mesh (`Shard` for sharded layers; `Replicate` for norms under
    sequence parallelism and per-head norms, whose gradients are summed over tp after each accumulation); other
    parameters stay plain tensors, identical on every tp rank. Tied input/output embeddings stay one parameter.

    Raises:
        ValueError: the plan's problems (before any collective), or a mesh whose tp size differs from the plan's.
    """
    tp_mesh = tp_submesh(mesh)
    tp = tp_mesh.size()
    if isinstance(plan, TensorParallelPlan):
        if sequence_parallel or loss_parallel:
            raise ValueError(
                "pass sequence_parallel / loss_parallel to plan_tensor_parallel, not with a TensorParallelPlan"
            )
        frozen = plan
    else:
        frozen = plan_tensor_parallel(
            model, tp=tp, plan=plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
        )
    if frozen.tp != tp:
        raise ValueError(f"the plan was made for tp={frozen.tp}, but the mesh's tp dimension has {tp}")
    sp = frozen.sequence_parallel
    modules = dict(model.named_modules())

    # Inside a "sequence_gather" module the sequence is whole again: its regions leave replicated, as without SP.
    gathered = [name for name, style in frozen.styles.items() if style == "sequence_gather"]
    styles: dict[str, ParallelStyle] = {}
    for name, style in frozen.styles.items():
        seq = sp and not any(name.startswith(g + ".") for g in gathered)
        if style == "module":  # the module's own layout (validated by its `tensor_parallel_problems`)
            styles[name] = getattr(modules[name], MODULE_STYLE_METHOD)(sequence_parallel=seq)
            continue
        styles[name] = translate_style(style, sequence_parallel=seq, role="head" if name == frozen.output_head else "")
    for name in frozen.norms:
        styles[name] = translate_style("sequence_parallel", sequence_parallel=True)
    if sp and frozen.input_embedding not in frozen.styles:
        styles[frozen.input_embedding] = ShardSequence()
    elif sp:
        modules[frozen.input_embedding].register_forward_pre_hook(
            lambda _m, args: check_sequence_divisible(args[0].unsqueeze(-1), tp)
        )
    parallelize_module(model, tp_mesh, styles)
    for name in frozen.region_inputs:
        enter_region(modules[name], tp_mesh)

    if frozen.tied:
        embedding, head = (modules[n] for n in frozen.tied)
        head.weight = embedding.weight  # one parameter again: both were sharded the same way from the same tensor
    for attention, counts in frozen.head_counts.items():
        for attribute, value in counts.items():
            setattr(modules[attention], attribute, value)
    if any(param.is_meta for param in model.parameters()):
        # `to_empty` swaps a DTensor parameter's storage, which drops its gradient hooks: register them afterwards
        setattr(model, _PENDING_ATTR, True)
        model.register_forward_pre_hook(_refuse_pending)
    else:
        reduce_partial_grads(model)
    return frozen


_PENDING_ATTR = "_am_tp_partial_grads_pending"  # set on a meta model by `apply_tensor_parallel`


def reduce_partial_grads(model: nn.Module) -> int:
    """Sum over tp, after each accumulation, the partial gradient of every replicated DTensor parameter of `model`
    (norms under sequence parallelism, per-head norms: see `apply_tensor_parallel`). `apply_tensor_parallel` calls
    it on a materialized model; call it once on a model it sharded on the meta device, after materializing it.
    Returns the number of parameters it applies to.

    Raises:
        ValueError: a parameter is still on the meta device.
    """
    params = [p for p in model.parameters() if isinstance(p, DTensor) and p.requires_grad]
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"reduce_partial_grads: materialize the model first; on the meta device: {meta[:8]}")
    replicated = [p for p in params if all(isinstance(x, Replicate) for x in p.placements)]
    for param in replicated:
        param.register_post_accumulate_grad_hook(_reduce_partial_grad)
    setattr(model, _PENDING_ATTR, False)
    return len(replicated)


def _refuse_pending(module: nn.Module, _args: object) -> None:
    if getattr(module, _PENDING_ATTR, False):
        raise RuntimeError(
            f"{type(module).__name__} was sharded by apply_tensor_parallel on the meta device: after materializing it, "
            "call am_tensor_parallel.reduce_partial_grads(model) (the replicated parameters' partial gradients are "
            "summed over tp by hooks that materializing would drop)"
        )


def _reduce_partial_grad(param: torch.Tensor) -> None:
    """A replicated parameter used on sharded data (sequence shards, a rank's heads) gets each rank's partial
    gradient (DTensor `Partial`); sum it so the gradient is replicated like the parameter."""
    grad = param.grad
    if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
        param.grad = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)
