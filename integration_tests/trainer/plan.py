"""The run plan: every layout decision of one training run, made once by `validate()` and then only read.

What it is for: `RunPlan` is frozen data (torchtitan's `ParallelDims`, grown to the whole layout): the mesh sizes and
axis order, am-pipelining's `PipelinePlan` (None at pp 1), am-moe's `ExpertParallelPlan` (None at ep 1), the CP
layout, pad multiple and local sequence length, the precision policy, whether FSDP2 wraps the model, the
microbatching, the attention implementation, how the router's auxiliary loss is handled and the MoE load
balancing. `make_plan` is the one function that decides them (called by `validate()`, before any process group); the
build and step functions of trainer/loop.py read the plan and never the raw options again, and summary.json
records `plan.to_json()`.
`ValidatedRun` carries the plan together with what is not layout (the model spec, the model validation checked, the
data, the folder to resume).
What it must not do: touch torch.distributed, or decide a rule that another module owns (it asks am-pipelining,
am-moe, am-context-parallel and the trainer's config for their rules; the problems are theirs to report).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from trainer.config import RunConfig
    from trainer.data import Corpus
    from trainer.models import ModelSpec


@dataclass(frozen=True)
class Precision:
    """What `--dtype` means: `storage` of parameters, gradients and optimizer state; `compute` of forward and
    backward (activations, the dtype sent between pipeline stages); `reduce` of FSDP2's gradient reduction."""

    storage: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    warning: str | None = None

    def to_json(self) -> dict[str, str]:
        """{"storage", "compute", "reduce"}: the dtypes' names ("float32", "bfloat16")."""
        return {key: str(getattr(self, key)).removeprefix("torch.") for key in ("storage", "compute", "reduce")}


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


@dataclass(frozen=True)
class RouterAuxPlan:
    """A transformers MoE model's router load-balancing loss over the global batch (trainer/step_parts.py's
    `RouterAuxLoss`): `num_experts` E and `top_k` of its router, and `coef`, its weight in the objective (0.0 when
    the model's config leaves the term out: the router statistics then give the expert imbalance only)."""

    num_experts: int
    top_k: int
    coef: float


@dataclass(frozen=True)
class RunPlan:
    """The layout of one run, decided once before any process group (see the module docstring).

    Mesh: `mesh_axes` in order (outermost first) with `mesh_shape`; ep is carved out of dp x cp (adds no ranks);
    "tp" joins the axes, innermost, when `tp` > 1 (a run without TP keeps its 3-axis mesh); `tensor_parallel` is
    am-tensor-parallel's frozen `TensorParallelPlan` of the whole model (None at tp 1; trainer/tensor_parallel.py).
    Sequence: every sequence of `seq_len` tokens is padded to a multiple of `pad_multiple` x cp and sharded over cp
    (`cp_layout` "contiguous" or "load_balanced", None at cp 1); `local_seq_len` tokens per rank and sequence.
    Batch: `global_batch` sequences per step, `local_batch` per dp replica, in `microbatches` of `microbatch_size`.
    """

    pp: int
    dp: int
    cp: int
    ep: int
    tp: int
    pipeline: Any  # am_pipelining.PipelinePlan | None (None: pp 1)
    expert_parallel: Any  # am_moe.ExpertParallelPlan | None (None: ep 1)
    cp_layout: str | None
    pad_multiple: int
    seq_len: int
    local_seq_len: int
    dtype: str
    precision: Precision
    fsdp: bool
    fsdp_grouping: str  # "decoder layers", "_no_split_modules" or "root" (trainer/parallel.py's apply_fsdp)
    global_batch: int
    local_batch: int
    microbatch_size: int
    microbatches: int
    num_layers: int | None  # decoder layers am-pipelining finds (None: none found; pp 1 only)
    attn_implementation: str | None
    moe: bool  # the model computes experts through am-moe (its expert load is counted per step)
    router_aux: RouterAuxPlan | None  # pp 1: step_parts.RouterAuxLoss; pp > 1: trainer/router_aux_pipeline.py
    tensor_parallel: Any = None  # am_tensor_parallel.TensorParallelPlan | None (None: tp 1)
    # am_moe.LoadBalancing of the model's am-moe routers: its recipe under the --moe-* options (trainer/moe_balance.py);
    # None for a model without them
    moe_balancing: Any = None
    # --fsdp-optimizations (BackendConfig.enable_fsdp_optimizations, pp 1 with FSDP2): the model's
    # prepare_for_grad_accumulation / prepare_for_final_backward hooks drive FSDP2's sync (trainer/batch_step.py)
    fsdp_optimizations: bool = False

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return ("pp", "dp", "cp", "tp") if self.tp > 1 else ("pp", "dp", "cp")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp, self.cp, self.tp) if self.tp > 1 else (self.pp, self.dp, self.cp)

    @property
    def is_pipeline(self) -> bool:
        """The one spelling of "is this a pipeline run": a pipeline plan exists (pp > 1)."""
        return self.pipeline is not None

    def layout(self) -> dict[str, Any]:
        """The layout that runs, as summary.json's `layout`: mesh sizes, the CP layout, and the pipeline plan's
        stages, placement, layer split and microbatches (pp 1: one stage holding every layer, microbatches =
        gradient-accumulation steps)."""
        layout: dict[str, Any] = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep, "tp": self.tp}
        layout["cp_layout"] = self.cp_layout
        if self.pipeline is not None:
            return layout | {k: v for k, v in self.pipeline.layout().items() if k != "pp"}
        return layout | {
            "schedule": None,
            "placement": None,
            "stages": 1,
            "stages_per_rank": 1,
            "layers": self.num_layers,
            "layers_per_stage": [self.num_layers] if self.num_layers is not None else None,
            "rank_stages": [[0]],
            "microbatch_size": self.microbatch_size,
            "microbatches": self.microbatches,
        }

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data of the whole plan (summary.json's `plan`)."""
        from trainer.moe_balance import balancing_json

        ep = self.expert_parallel
        router = self.router_aux
        return {
            "mesh": {"axes": list(self.mesh_axes), "shape": list(self.mesh_shape), "ep": self.ep, "tp": self.tp},
            "pipeline": self.layout() if self.is_pipeline else None,
            "expert_parallel": (
                {"data_parallel_size": ep.data_parallel_size, "ep": ep.ep, "expert_dp": ep.expert_dp} if ep else None
            ),
            "context_parallel": {
                "layout": self.cp_layout,
                "pad_multiple": self.pad_multiple,
                "seq_len": self.seq_len,
                "local_seq_len": self.local_seq_len,
            },
            "precision": {"dtype": self.dtype} | self.precision.to_json(),
            "fsdp": self.fsdp,
            "fsdp_grouping": self.fsdp_grouping if self.fsdp else None,
            "fsdp_optimizations": self.fsdp_optimizations,
            "batch": {
                "global_batch": self.global_batch,
                "local_batch": self.local_batch,
                "microbatch_size": self.microbatch_size,
                "microbatches": self.microbatches,
            },
            "is_pipeline": self.is_pipeline,
            "num_layers": self.num_layers,
            "attn_implementation": self.attn_implementation,
            "moe": self.moe,
            "router_aux": (
                {"num_experts": router.num_experts, "top_k": router.top_k, "coef": router.coef} if router else None
            ),
            # am-tensor-parallel's record of the plan: tp, flags, every module's style, the head counts it divides
            "tensor_parallel": self.tensor_parallel.describe() if self.tensor_parallel is not None else None,
            "moe_balancing": balancing_json(self.moe_balancing),
        }


@dataclass(frozen=True)
class ValidatedRun:
    """What `validate()` returns: the plan, and what travels with it but is not layout: the model `spec`, the
    `model` the checks ran on (a preset's on the meta device, without weights: the run builds the real one; a
    `--model-path` folder's loaded fp32 weights, which the run uses), the `corpus` (training and held-out tokens) and
    the checkpoint folder to resume."""

    plan: RunPlan
    spec: ModelSpec
    model: nn.Module
    corpus: Corpus
    resume_dir: Path | None


def uses_fsdp(precision: Precision, *, dp: int, cp: int) -> bool:
    """Whether the model parts are wrapped with FSDP2: when sharded over dp x cp, and whenever the compute dtype is
    not the storage dtype (mixed precision: FSDP2's cast-on-forward, over a mesh of one rank if need be)."""
    return dp * cp > 1 or precision.compute != precision.storage


def make_plan(
    cfg: RunConfig,
    model: nn.Module,
    *,
    pipeline: Any,
    expert_parallel: Any,
    cp_layout: str | None,
    pad_multiple: int,
    num_layers: int | None,
    router_aux: tuple[int, int, float, bool] | None,
    tensor_parallel: Any = None,
    moe_balancing: Any = None,
) -> RunPlan:
    """The plan of a run `validate()` accepted: `cfg`'s sizes, the plans validation made (`pipeline`,
    `expert_parallel`), the CP facts it read from the model, and the model's own declarations (attention, FSDP2
    grouping, experts). `router_aux` is step_parts' `router_aux_spec(model)`; `tensor_parallel` the validated
    `TensorParallelPlan` (trainer/tensor_parallel.py's `tensor_parallel_plan`, None at tp 1); `moe_balancing` is
    trainer/moe_balance.py's `balancing_plan(cfg, model)` (None: no am-moe routers)."""
    from am_context_parallel import cp_local_seq_len
    from trainer.expert_parallel import has_experts
    from trainer.models import attn_implementation
    from trainer.parallel import fsdp_grouping

    precision = PRECISIONS[cfg.dtype]
    router = None
    if router_aux is not None:
        experts, top_k, coef, in_objective = router_aux
        router = RouterAuxPlan(num_experts=experts, top_k=top_k, coef=coef if in_objective else 0.0)
    return RunPlan(
        pp=cfg.pp,
        dp=cfg.dp,
        cp=cfg.cp,
        ep=cfg.ep,
        tp=cfg.tp,
        pipeline=pipeline,
        expert_parallel=expert_parallel,
        cp_layout=cp_layout if cfg.cp > 1 else None,
        pad_multiple=pad_multiple,
        seq_len=cfg.seq_len,
        local_seq_len=cp_local_seq_len(model, seq_len=cfg.seq_len, cp_size=cfg.cp),
        dtype=cfg.dtype,
        precision=precision,
        fsdp=uses_fsdp(precision, dp=cfg.dp, cp=cfg.cp),
        fsdp_grouping=fsdp_grouping(model),
        global_batch=cfg.global_batch,
        local_batch=cfg.local_batch,
        microbatch_size=cfg.microbatch_size,
        microbatches=cfg.local_batch // cfg.microbatch_size,
        num_layers=num_layers,
        attn_implementation=attn_implementation(model),
        moe=has_experts(model),
        router_aux=router,
        tensor_parallel=tensor_parallel,
        moe_balancing=moe_balancing,
        fsdp_optimizations=cfg.fsdp_optimizations,
    )


__all__ = [
    "PRECISIONS",
    "Precision",
    "RouterAuxPlan",
    "RunPlan",
    "ValidatedRun",
    "make_plan",
    "uses_fsdp",
]
