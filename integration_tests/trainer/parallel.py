"""How the reference trainer parallelizes a model: process group, DeviceMesh, precision, pipeline, CP, FSDP2.

What it is for: the functions the train loop applies to a model, in this fixed order:
    init_distributed -> build_mesh -> the storage dtype (trainer/loop.py's `build`: am-precision's
    `cast_model_to_dtype`) -> the pipeline split (pp > 1; there too: am-pipelining's `build_stages`)
    -> tensor parallelism (tp > 1; trainer/tensor_parallel.py: the plan's modules of each part over the innermost
       "tp" axis, as DTensors, and the plain-tensor shards of modules that shard themselves)
    -> expert parallelism (ep > 1; trainer/expert_parallel.py: the ep and expert_dp meshes carved out of this
       stage's dp x cp ranks, ep innermost, and the experts sharded over ep) -> apply_fsdp (the plan's `fsdp`)
and, when cp > 1, `shard_batch_for_cp` on every microbatch (pp = 1) or `shard_pipeline_batch_for_cp` on every step's
batch (pp > 1). Everything model-specific is read from the model through the
am-* protocols (keep-in-fp32 rules, pipeline hooks, the CP batch hook); nothing here names a model class.
What it must not do: decide what is valid (config.py and am-capabilities do that, before any collective), or touch
the data, the optimizer or the checkpoints.

Gradient reduction, so that every parallel run computes the single-process gradient of the GLOBAL token-mean loss:
each rank's loss is the token SUM of its own tokens divided by the token count of the whole global batch; the
pipeline schedule sums microbatch gradients (`scale_grads=False`); FSDP2 reduces over the flattened `dp_cp` axis
with divide factor 1 (a sum, not a mean); the ring attention of CP already sends dK/dV back to the ranks that own the
keys. Summing every rank's contribution is therefore exactly the single-process gradient.

Expert parallelism (`--ep`, the mesh stays pp x dp x cp): ep is carved out of each stage's dp x cp ranks. The
flattened "dp_cp" axis (rank d x cp + c) is unflattened into ("expert_dp", "ep") with ep innermost, so an ep group is
ep consecutive dp_cp ranks of one stage (dp 2 x cp 2 x ep 2: the cp group; dp 2 x ep 2: the dp group). Expert
weights are DTensors sharded over ep and FSDP2-sharded over expert_dp; every other parameter is sharded over dp_cp
as without EP, and the data split does not change. The meshes, the order and why the gradients stay exact sums:
trainer/expert_parallel.py.

Precision (the run plan's policy: trainer/plan.py's `PRECISIONS`, one rule for every layout): `--dtype bf16` (the
default) is mixed precision: fp32 master weights, gradients and AdamW state, bf16 compute through FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`. Without sharding (dp x cp = 1) the same FSDP2 wrap runs
over a mesh of one rank: no communication, the identical cast-on-forward rule, so a single-process run and a sharded
run compute alike (the plan's `fsdp`). fp32-pinned modules (strict keep rules) are FSDP2 groups of their own with an
fp32 policy: stored and computed in fp32. `--dtype bf16-pure` stores everything unpinned in bf16 (am-precision's
`cast_model_to_dtype`), optimizer state included: half the memory, but an AdamW update below half a bf16 ulp of a
weight is rounded away.

Pipeline x context parallelism (mesh pp x dp x cp): the CP layout is the model's (contiguous for models that declare
it; the load-balanced layout is refused with pp > 1 by config.py). The step's batch is sequence-sharded BEFORE the
schedule splits it into microbatches, one microbatch at a time so the ring context (document ids, positions) is
exactly each microbatch's; the whole `schedule.step` runs inside that context. Two kinds of point-to-point traffic
then interleave, on separate process groups so neither can match the other's messages:
  - pipeline p2p (activations forward, gradients backward) on the "pp" group: rank (s, d, c) talks only to the ranks
    (s +- 1, d, c) of the same dp and cp coordinates;
  - ring p2p (K/V blocks, Mamba2 states and conv halos) and the models' CP flag all-gathers on the "cp" group: the
    ranks (s, d, *) of one stage.
Ordering, and why it cannot deadlock: every rank of a cp group holds the same stage, so it runs the same schedule
actions in the same order; the ring transfers of one action are issued by all of them inside that action, after its
pipeline receive completed and before its pipeline send. A rank waits on a pipeline receive only from its own cp
coordinate in the neighbour stage, whose cp peers run the same action list, so every wait is matched by an action all
peers of a group reach in the same order (induction over the schedule's actions).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from am_pipelining import DecoderLayers, find_layers
from am_pipelining.layers import LAYER_PREFIX_CANDIDATES
from am_precision import fp32_keep_rules
from trainer.plan import Precision, RunPlan


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


def build_mesh(plan: RunPlan, *, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """One mesh with the plan's named axes ("pp", "dp", "cp", and "tp" innermost at tp > 1) and sizes, and its
    flattened dp x cp axis ("dp_cp") that FSDP2 shards over (torchtitan's layout: FSDP2 over dp x cp sums gradients
    over both)."""
    mesh = init_device_mesh(device.type, plan.mesh_shape, mesh_dim_names=plan.mesh_axes)
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")


def _outermost(model: nn.Module, match: Callable[[str, nn.Module], bool]) -> list[nn.Module]:
    """The submodules (root excluded) that `match(name, module)` selects, outermost only, in module order."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if name and match(name, module) and not any(name.startswith(prefix + ".") for prefix in found):
            found[name] = module
    return list(found.values())


def _strict_fp32_modules(model: nn.Module) -> list[nn.Module]:
    """Modules with parameters that a STRICT keep-in-fp32 rule pins (outermost matches only)."""
    strict = [rule for rule in fp32_keep_rules(model) if rule.strict]
    return _outermost(
        model, lambda name, module: any(r.matches(name) for r in strict) and any(True for _ in module.parameters())
    )


def decoder_layers(model: nn.Module) -> DecoderLayers | None:
    """The decoder layers of `model` (am-pipelining's `find_layers`), None when it cannot find them (GPTNeoX's
    `gpt_neox.layers`, Falcon's / GPT-2's / Bloom's `transformer.h`, OPT's `model.decoder.layers`). Only the
    features that work per layer need them (`layer_feature_problems`); FSDP2 and pp = 1 training do not."""
    try:
        return find_layers(model)
    except ValueError:
        return None


def layer_feature_problems(model: nn.Module, cfg: Any) -> list[str]:
    """One problem when `cfg` asks for a feature that works on the decoder layers (--pp > 1, --activation-checkpointing,
    --compile) and `model`'s decoder layers cannot be found; [] otherwise (such a model trains at --pp 1 with FSDP2
    over dp x cp). The hint is one the CLI can follow: the option to drop."""
    wanted = [
        (need, fix)
        for asked, need, fix in (
            (cfg.pp > 1, f"--pp {cfg.pp} cuts the stages between them", "--pp 1"),
            (cfg.activation_checkpointing, "--activation-checkpointing wraps each", "no --activation-checkpointing"),
            (cfg.compile, "--compile compiles each", "no --compile"),
        )
        if asked
    ]
    if not wanted or decoder_layers(model) is not None:
        return []
    searched = ", ".join(f"{prefix or '<root>.'}layers" for prefix in LAYER_PREFIX_CANDIDATES)
    return [
        f"{type(model).__name__}: its decoder layers cannot be found (am-pipelining looks for a ModuleList at "
        f"{searched}), and {'; '.join(need for need, _ in wanted)}: run it with {', '.join(fix for _, fix in wanted)} "
        "(it trains without them: dp, cp and FSDP2 need no layers)"
    ]


def _no_split_layers(model: nn.Module) -> list[nn.Module]:
    """The outermost modules whose class transformers lists in the model's `_no_split_modules` (its own statement of
    which blocks hold together: the decoder layers of every transformers causal LM), in module order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return _outermost(model, lambda _, module: type(module).__name__ in names)


def fsdp_grouping(model: nn.Module) -> str:
    """How `apply_fsdp` groups `model` (recorded in summary.json): "decoder layers" (am-pipelining's `find_layers`),
    "_no_split_modules" (transformers' layer classes, where `find_layers` finds none), or "root" (one group)."""
    if decoder_layers(model) is not None:
        return "decoder layers"
    return "_no_split_modules" if _no_split_layers(model) else "root"


def layer_notes(model: nn.Module, *, grouping: str) -> list[str]:
    """What a run of a model whose decoder layers cannot be found does instead (printed on rank 0 before training):
    [] when `find_layers` finds them. `grouping`: the plan's `fsdp_grouping(model)`."""
    if grouping == "decoder layers":
        return []
    how = (
        f"one group per {' / '.join(sorted(getattr(model, '_no_split_modules', None) or ()))} "
        "(transformers' _no_split_modules)"
        if grouping == "_no_split_modules"
        else "one group for the whole model"
    )
    return [
        f"{type(model).__name__}: am-pipelining cannot find its decoder layers; it trains at --pp 1 (dp, cp) with "
        f"FSDP2 {how}, and --pp > 1, --activation-checkpointing and --compile are not available for it"
    ]


def _layer_modules(model: nn.Module) -> list[nn.Module]:
    """One FSDP2 group per layer: the decoder layers (am-pipelining's `find_layers`), then the layers of any other
    `layers` container of the model (e.g. Nemotron's multi-token-prediction depths, `mtp.layers`). A model whose
    decoder layers `find_layers` cannot find gets one group per block of its `_no_split_modules` classes, or none
    (the root group holds everything): grouping is memory, never arithmetic, so the gradients are the same."""
    found = decoder_layers(model)
    if found is None:
        return _no_split_layers(model)
    decoder = found.container
    layers: list[nn.Module] = list(decoder.children())
    for name, module in model.named_modules():
        if module is decoder or name.rsplit(".", 1)[-1] != "layers":
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            layers.extend(module.children())
    return layers


def apply_fsdp(
    model: nn.Module, *, shard_mesh: DeviceMesh, precision: Precision, expert_mesh: DeviceMesh | None = None
) -> nn.Module:
    """FSDP2 over the flattened "dp_cp" axis: fp32-pinned modules, then the experts (under EP), then each layer,
    then the root.

    Strict-fp32 modules get their own group with an fp32 policy (FSDP2 all-gathers a group in one dtype, so they
    must not share a group with bf16 weights), kept unsharded from forward to backward; everything else computes in
    `precision.compute` and reduces gradients in `precision.reduce` (fp32). A mesh of one rank is fine: then this
    is only the mixed-precision cast-on-forward.
    Under expert parallelism (`expert_mesh`: the expert_dp mesh of trainer/expert_parallel.py, the experts already
    sharded over ep) the experts are groups of their own over `expert_mesh` (am-moe's `fully_shard_experts`, same
    policy), so the layer groups over dp_cp leave them alone.
    Gradients are SUMMED over dp_cp, and the experts' over expert_dp (divide factor 1): the loss is already
    normalized by the global token count.
    """
    policy = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=precision.reduce)
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for module in _strict_fp32_modules(model):
        # reshard_after_forward=False: a holder such as Nemotron's `_fp32_params` hands its parameters to the caller,
        # which computes with them after the holder's forward; these modules are tiny, so staying unsharded is cheap.
        fully_shard(module, mesh=shard_mesh, mp_policy=fp32_policy, reshard_after_forward=False)
    if expert_mesh is not None:
        from am_moe import fully_shard_experts

        fully_shard_experts(model, mesh=expert_mesh, mp_policy=policy)
    for layer in _layer_modules(model):
        fully_shard(layer, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def model_cp_layout(model: nn.Module) -> tuple[str, int]:
    """(layout, pad multiple) of `model` under CP (am-context-parallel's `model_cp_options`): "contiguous" for a model
    that declares `cp.layout="contiguous"` in its contract (Gemma 4, Nemotron-H), else "load_balanced" (head-tail).
    Sequences are padded to a multiple of pad multiple x cp before sharding (2 unless the model's contiguous options
    say otherwise; the load-balanced layout needs 2 chunks per rank)."""
    from am_context_parallel import model_cp_options

    options = model_cp_options(model)
    return ("contiguous", options.pad_multiple) if options is not None else ("load_balanced", 2)


def shard_batch_for_cp(
    model: nn.Module, batch: dict[str, torch.Tensor], *, mesh: DeviceMesh, layout: str
) -> tuple[Any, dict]:
    """This rank's CP shard of `batch` and the context to run forward and backward in (am-context-parallel).

    batch: `input_ids` [B, S] and `labels` [B, S], ALREADY shifted (the trainer's convention). A model whose contract
    declares `cp.prepare` (Nemotron-H's `prepare_batch_for_cp`: document ids, padding mask, the per-depth MTP inputs
    and targets) prepares the WHOLE sequences first, so everything that is shifted is right at block edges.
    `layout` is the run plan's `cp_layout`: "contiguous" (a model whose contract declares it) gets the contiguous
    shard and the ring context its layers read; "load_balanced" the head-tail layout with ring attention routed
    through transformers' attention registry. am-context-parallel checks the layout against the model, it does not
    derive it again. The model is never asked to shard. The returned context describes exactly these B rows.
    """
    from am_context_parallel import make_cp_batch_and_ctx
    from am_model_contract import contract_of

    prepare = contract_of(model).cp.prepare
    if prepare is not None:
        batch = prepare(batch, labels_shifted=True)
    return make_cp_batch_and_ctx(mesh, batch, model=model, layout=layout)


def split_cp_targets(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Pop the loss targets from a CP-sharded batch: (labels [B, S_local], D MTP targets [B, S_local] or None).

    The MTP targets were computed on the whole sequences (`prepare_batch_for_cp`); the loss must use them instead of
    rolling the local labels, which would be wrong at block edges. The load-balanced path's `loss_mask` is dropped
    too: none of these keys is a forward input."""
    labels = batch.pop("labels")
    mtp = batch.pop("mtp_per_depth_targets", None)
    batch.pop("loss_mask", None)
    return labels, (list(mtp.unbind(1)) if mtp is not None else None)


def shard_pipeline_batch_for_cp(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    mesh: DeviceMesh,
    microbatch_size: int,
    layout: str,
) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
    """pp > 1 and cp > 1: (ring context, first-stage inputs, schedule target) for one step's local batch, in the
    plan's CP `layout` (see `shard_batch_for_cp`).

    The schedule splits the batch into microbatches of `microbatch_size` rows but the step runs inside ONE entered
    context, whose document ids are per row. So every microbatch is prepared and sharded on its own (exactly as
    pp = 1 does), the shards are concatenated back along the batch dim (the schedule splits them again, into the
    same rows), and the context of the first microbatch is kept — after checking that every microbatch's context
    is the same (document ids, positions, lengths); a batch whose microbatches differ (packed documents placed
    differently), or whose position ids are not the context's global positions (a later stage could not see them),
    is refused rather than run with the wrong masks or rotary embeddings.

    Returns the context factory, the first stage's inputs (`input_ids` [B, S_local] and the model's per-token
    kwargs, all split along dim 0 by the schedule) and the target: labels [B, S_local], or [B, S_local, 1 + D]
    (labels, then the D MTP targets) when the model prepared MTP targets (see `CPPipelineTargets`).
    """
    shards: list[dict[str, torch.Tensor]] = []
    contexts: list[Any] = []
    for start in range(0, input_ids.shape[0], microbatch_size):
        rows = slice(start, start + microbatch_size)
        ctx, shard = shard_batch_for_cp(
            model, {"input_ids": input_ids[rows], "labels": labels[rows]}, mesh=mesh, layout=layout
        )
        contexts.append(ctx)
        shards.append(shard)
    first = contexts[0]
    for index, ctx in enumerate(contexts[1:], start=1):
        same = (ctx.seq_len, ctx.padded_len) == (first.seq_len, first.padded_len)
        same = same and _same_tensor(ctx.doc_ids, first.doc_ids) and _same_tensor(ctx.positions, first.positions)
        if not same:
            raise ValueError(
                f"microbatch {index} has other document boundaries than microbatch 0; under pipeline x context "
                "parallelism one ring context serves every microbatch of a step, so their packing must match"
            )
    merged = {key: torch.cat([shard[key] for shard in shards]) for key in shards[0]}
    positions = merged.get("position_ids")
    if positions is not None and not bool((positions == first.positions.to(positions.device)).all()):
        raise ValueError(
            "the batch has per-row position ids that differ from the ring context's global positions; under pipeline "
            "x context parallelism a non-first stage receives hidden states only and takes its positions from the "
            "context, so such a batch is refused"
        )
    main, mtp = split_cp_targets(merged)
    target = main if mtp is None else torch.stack([main, *mtp], dim=-1)
    return first, merged, target


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(torch.equal(a, b))


class CPPipelineTargets:
    """The schedule's loss under pp x cp: unpacks a stacked target [B, S_local, 1 + D] (labels, then the MTP
    targets computed before sharding; the sequence stays on dim 1, where the schedule checks it) into
    `loss(output, labels, mtp_per_depth_targets=[...])`; a plain [B, S] target goes through unchanged."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if target.dim() == 3:
            return self.loss(output, target[..., 0], mtp_per_depth_targets=list(target[..., 1:].unbind(-1)))
        return self.loss(output, target)
