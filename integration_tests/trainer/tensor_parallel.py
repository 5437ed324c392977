"""Tensor parallelism (TP) in the reference trainer: what `--tp` refuses, its plan, applying it, and the shards that
a model's own modules hold.

Mesh: pp x dp x cp x tp, tp innermost (the tp ranks of a group are consecutive global ranks: on GPUs, the same node's
fastest links). Every rank of a tp group holds the same pipeline stage and reads the same rows of the batch; ep is
still carved out of the dp x cp ranks (per tp coordinate), so FSDP2, EP and the loss work as without TP within one
tp coordinate.
Order (trainer/loop.py's `build`, torchtitan's): the pipeline split -> `apply_tensor_parallel_to_parts` (each part:
am-tensor-parallel's plan, validated once on the whole model, restricted to the modules the part holds) -> experts
over ep -> FSDP2 over dp x cp on top of the TP DTensors (2-D (dp_cp, tp) parameters) -> materialization. All of it
runs on the meta model: each rank then allocates and fills its own TP shards only (trainer/build.py; the Mamba2
mixer's plain shards through its `tensor_parallel_shard_state`), never a whole stage.
Options (in the plan: `TensorParallelPlan.sequence_parallel` / `.loss_parallel`, recorded in summary.json):
`--sequence-parallel` puts the residual stream and its norms on sequence shards between the TP regions (modules the
model declares "sequence_gather", e.g. routed MoE blocks, run on whole sequences); `--loss-parallel` keeps the head's
vocabulary shard and the loss is `vocab_parallel_cross_entropy` (step_parts' `TokenSumLoss(vocab_mesh=)`). Both need
--pp 1. CP composes (ring attention and Mamba2 state passing over the cp group run on this rank's heads), and so does
activation checkpointing (recomputation replays the same collectives in the same order on every tp rank).
Exactness: every tp rank computes the same loss (the head's logits are gathered, or the vocabulary-parallel loss is
all-reduced), so the logged loss counts tp rank 0 only (BatchStep); the TP collectives make each parameter's
gradient the single-process one. Gradients of parameters that TP leaves whole are identical on the tp ranks (the
regions' inputs all-reduce their gradient; "sequence_gather" modules compute the same on every tp rank), so the
gradient norm counts them once; DTensor shards count through their mesh; the plain-tensor shards of modules that shard
themselves (Nemotron-H's Mamba2 mixer, am-tensor-parallel's "module" style) are summed over tp (`tp_local_names`,
step_parts' `clip_grad_norm`). Checkpoints keep those shards under per-tp-rank keys (`rename_tp_local`) and the HF
export re-assembles them through the module's `tensor_parallel_full_state` (trainer/export.py).
What it must not do: decide another axis's rules, or name a model class (the plan and the hooks come from the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from trainer.config import RunConfig


def tensor_parallel_problems(cfg: RunConfig, model: nn.Module) -> list[str]:
    """Every reason `--tp` cannot run `model` as asked (at tp 1: only `--sequence-parallel` / `--loss-parallel`
    asked without it): am-tensor-parallel's `tp_problems` with those two options (a declared plan must exist;
    heads, KV heads, intermediate and vocabulary sizes must divide by tp; experts stay whole under TP, so their
    counts are ep's rule; a transformers MoE plan's experts are kept whole: `_run_plan`), the options with --pp > 1
    or a sequence length tp does not divide, --compile, and a module that shards itself without a way to
    re-assemble its shards (needed by checkpoints and the HF export). Reads the model only (a preset on the meta
    device); before any process group."""
    flags = [f"--{name.replace('_', '-')}" for name in ("sequence_parallel", "loss_parallel") if getattr(cfg, name)]
    if cfg.tp <= 1:
        return [
            f"{flag} shards over the tp ranks, but --tp is {cfg.tp}: add --tp N (N > 1) or drop {flag}"
            for flag in flags
        ]
    from am_tensor_parallel import FULL_STATE_METHOD, match_plan, tp_problems

    where = f"--tp {cfg.tp}: {type(model).__name__}"
    plan = _run_plan(model)
    found = tp_problems(model, cfg.tp, plan, sequence_parallel=cfg.sequence_parallel, loss_parallel=cfg.loss_parallel)
    problems = [f"{where}: {problem}" for problem in found]
    if flags and cfg.pp > 1:  # a stage boundary would carry sequence shards / a stage's plan is restricted: untested
        problems.append(
            f"{' and '.join(flags)} with --pp {cfg.pp}: the pipeline's stage boundaries carry whole plain tensors "
            f"(not sequence shards) and the last stage's loss is not vocabulary-parallel: run them with --pp 1"
        )
    if cfg.sequence_parallel and cfg.seq_len >= 1 and cfg.seq_len % cfg.tp:
        problems.append(
            f"--sequence-parallel shards the sequence over --tp {cfg.tp}, but --seq-len {cfg.seq_len} is not a "
            f"multiple of {cfg.tp}: choose a --seq-len divisible by {cfg.tp}"
        )
    if cfg.compile:  # what --tp does not compose with yet: refused up front, with the reason
        problems.append(
            f"--tp {cfg.tp}: --compile is not run over DTensor (TP) layers: torch.compile would trace the regions' "
            "redistribute hooks and DTensor collectives, which no test runs on this CPU/gloo stack; drop --compile "
            "with --tp"
        )
    modules = dict(model.named_modules())
    styles, _ = match_plan(model, plan or {})
    for name, style in styles.items():
        if style == "module" and not callable(getattr(modules[name], FULL_STATE_METHOD, None)):
            problems.append(
                f"{where}: {name} ({type(modules[name]).__name__}) shards itself (style 'module') but has no "
                f"`{FULL_STATE_METHOD}` to re-assemble its shards for checkpoints and the HF export: run --tp 1"
            )
    return problems


def tensor_parallel_plan(cfg: RunConfig, model: nn.Module) -> Any:
    """The frozen `TensorParallelPlan` of the whole model at `--tp` (None at tp 1); call after
    `tensor_parallel_problems` found none."""
    if cfg.tp <= 1:
        return None
    from am_tensor_parallel import plan_tensor_parallel

    return plan_tensor_parallel(
        model,
        tp=cfg.tp,
        plan=_run_plan(model),
        sequence_parallel=cfg.sequence_parallel,
        loss_parallel=cfg.loss_parallel,
    )


def _run_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's declared plan with its experts whole (am-tensor-parallel's `experts_whole`: transformers'
    `moe_tp_experts` dropped, the MoE block run whole on whole sequences), as our models declare theirs: experts are
    split by --ep, never by --tp. None: the model declares no plan."""
    from am_tensor_parallel import declared_plan, experts_whole

    declared = declared_plan(model)
    return experts_whole(declared) if declared else None


@dataclass(frozen=True)
class TPLocal:
    """The plain-tensor parameters of a part that hold this tp rank's shard (their shapes differ from the unsharded
    model's), by name, and this rank's tp coordinate."""

    rank: int
    names: frozenset[str]


_TP_LOCAL_ATTR = "_am_tp_local"  # set on each part by `apply_tensor_parallel_to_parts` (survives FSDP2's wrap)


def apply_tensor_parallel_to_parts(parts: list[nn.Module], *, plan: Any, tp_mesh: Any) -> None:
    """Shard every model part over `tp_mesh` with the run's validated `plan` (restricted, for a pipeline stage, to
    the modules it holds: names are kept by the stage split). Records the part's plain-tensor shards (`TPLocal`).
    Collective over tp (DTensor placement)."""
    from torch.distributed.tensor import DTensor

    from am_tensor_parallel import apply_tensor_parallel

    for part in parts:
        modules = dict(part.named_modules())
        shapes = {name: tuple(p.shape) for name, p in part.named_parameters()}
        if all(name in modules for name in plan.styles):
            apply_tensor_parallel(part, tp_mesh, plan=plan)  # the whole model: the plan as validated
        else:
            held = {name: style for name, style in plan.styles.items() if name in modules}
            apply_tensor_parallel(
                part, tp_mesh, plan=held, sequence_parallel=plan.sequence_parallel, loss_parallel=plan.loss_parallel
            )
        local = frozenset(
            name
            for name, p in part.named_parameters()
            if not isinstance(p, DTensor) and name in shapes and tuple(p.shape) != shapes[name]
        )
        setattr(part, _TP_LOCAL_ATTR, TPLocal(rank=tp_mesh.get_local_rank(), names=local))


def tp_local_names(part: nn.Module) -> TPLocal | None:
    """The part's plain-tensor TP shards (None: no TP, or none held)."""
    local = getattr(part, _TP_LOCAL_ATTR, None)
    return local if local is not None and local.names else None


def tp_local_parameters(parts: list[nn.Module]) -> set[int]:
    """`id`s of the parameters (as they are now: after FSDP2's wrap) that hold a plain-tensor TP shard."""
    found: set[int] = set()
    for part in parts:
        local = tp_local_names(part)
        if local is not None:
            found |= {id(p) for name, p in part.named_parameters() if name in local.names}
    return found


def rename_tp_local(part: nn.Module, model_state: dict[str, Any], optim_state: dict[str, Any], *, back: bool) -> None:
    """Give the plain-tensor TP shards per-tp-rank keys in a checkpoint (`name` -> `name@tp<r>`, in the model state
    and in the flattened optimizer state: `state.<name>.<key>`, `param_groups.<name>.<key>`), or take them back
    (`back`). The tp ranks hold different tensors under one name, which torch.distributed.checkpoint would otherwise
    keep once. In place."""
    local = tp_local_names(part)
    if local is None:
        return
    suffix = f"@tp{local.rank}"
    pairs = [(name, name + suffix) for name in local.names]
    if back:
        pairs = [(new, old) for old, new in pairs]
    for old, new in pairs:
        if old in model_state:
            model_state[new] = model_state.pop(old)
        for kind in ("state.", "param_groups."):
            for key in [k for k in optim_state if k.startswith(f"{kind}{old}.")]:
                optim_state[f"{kind}{new}{key[len(kind) + len(old) :]}"] = optim_state.pop(key)


__all__ = [
    "TPLocal",
    "apply_tensor_parallel_to_parts",
    "rename_tp_local",
    "tensor_parallel_plan",
    "tensor_parallel_problems",
    "tp_local_names",
    "tp_local_parameters",
]
