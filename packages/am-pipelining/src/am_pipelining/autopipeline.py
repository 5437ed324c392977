"""`AutoPipeline`: one object that validates, splits, parallelizes and schedules a model, then runs steps.

It wraps `pipeline_model` (plan, split, parallelize, schedule) and adds what a training loop needs: `step()` with
per-kwarg chunking from the model's `get_pipeline_kwargs_chunk_dims` hook, the tied-embedding gradient sum after
every step, variable sequence lengths (`update_seq_len`), parameter counts per stage and a debug summary. Private
torch internals are reached only through `am_pipelining._compat`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from . import _compat
from .hf_utils import statically_defines, validate_hf_model_for_pipeline_support
from .planning import plan_pipeline
from .schedules import check_step_shapes, pipeline_model, reset_pp_stage_shapes
from .stages import _pipeline_axis
from .tied import sync_tied_embedding_grads

__all__ = ["AutoPipeline", "PipelineConfig", "PipelineInfo"]

logger = logging.getLogger(__name__)


@dataclass
class PipelineConfig:
    """Pipeline options as one dataclass (the mesh is passed separately)."""

    pp_schedule: str | None = "1f1b"
    pp_schedule_csv: str | None = None
    pp_microbatch_size: int = 1
    pp_batch_size: int = 1
    layers_per_stage: int | None = None
    round_virtual_stages_to_pp_multiple: str | None = None
    module_fqns_per_model_part: list[list[str]] | None = None
    patch_inner_model: bool = True
    patch_causal_lm_model: bool = True
    patch_stage_backward_maybe_with_nosync: bool = False
    """FSDP2 modules nested below a non-FSDP2 stage module (e.g. separately sharded experts) follow the stage's
    gradient-sync choice too (`AutoPipeline`'s `defer_fsdp_grad_sync`) instead of reducing every microbatch."""
    dtype: torch.dtype | None = None
    scale_grads_in_schedule: bool = False
    loss_fn: Callable[..., torch.Tensor] | None = None
    pp_seq_len: int | None = None
    stages_per_rank: int | None = field(default=None, kw_only=True)
    """Run exactly this many stages per rank (instead of `layers_per_stage`); see `plan_pipeline`."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PipelineInfo:
    enabled: bool = False
    schedule: Any = None
    has_first_stage: bool = False
    has_last_stage: bool = False
    model_parts: list[nn.Module] | None = None
    stages: list[Any] | None = field(default=None)


class AutoPipeline:
    """Pipeline-parallel training of an HF-style model on the `pp` axis of a DeviceMesh.

    Example::

        pipe = AutoPipeline(world_mesh=mesh, pp_schedule="1f1b", pp_microbatch_size=1, pp_batch_size=8)
        pipe.build(model, loss_fn=loss_fn)
        losses = pipe.step(input_ids, target=labels)   # also sums tied-embedding grads
        optimizer.step()

    Gradient sync with FSDP2 stages: `defer_fsdp_grad_sync=True` (default) reduce-scatters once after the last
    microbatch, False after every microbatch (lower peak memory, more communication; same gradients, needs a
    schedule without split backward). `patch_stage_backward_maybe_with_nosync=True` applies that choice to FSDP2
    modules nested below a non-FSDP2 stage module too (otherwise they reduce after every microbatch).

    Raises (constructor):
        ValueError: neither schedule nor CSV, batch not divisible by microbatch size, no mesh.
    """

    def __init__(
        self,
        world_mesh: Any = None,
        moe_mesh: Any = None,
        pp_axis_name: str = "pp",
        dp_axis_names: tuple[str, ...] | None = ("dp",),
        cp_axis_name: str | None = None,
        tp_axis_name: str | None = None,
        ep_axis_name: str | None = None,
        ep_shard_axis_names: tuple[str, ...] | None = None,
        pp_schedule: str | None = "1f1b",
        pp_schedule_csv: str | None = None,
        pp_microbatch_size: int = 1,
        pp_batch_size: int = 1,
        layers_per_stage: int | None = None,
        round_virtual_stages_to_pp_multiple: str | None = None,
        module_fqns_per_model_part: Sequence[Sequence[str]] | None = None,
        patch_inner_model: bool = True,
        patch_causal_lm_model: bool = True,
        patch_stage_backward_maybe_with_nosync: bool = False,
        defer_fsdp_grad_sync: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        scale_grads_in_schedule: bool = False,
        pp_seq_len: int | None = None,
        *,
        stages_per_rank: int | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        if world_mesh is None:
            raise ValueError("world_mesh must be provided (DeviceMesh with 'pp' axis)")
        self.pp_mesh = _pipeline_axis(world_mesh, pp_axis_name)
        # Everything that can be checked without the model is checked now; layers_per_stage needs the model's
        # layer count and is planned in build().
        plan_pipeline(
            None,
            self.pp_mesh.size(),
            pp_schedule,
            csv=pp_schedule_csv,
            stages_per_rank=stages_per_rank,
            num_stages=len(module_fqns_per_model_part) if module_fqns_per_model_part is not None else None,
            local_batch_size=pp_batch_size,
            microbatch_size=pp_microbatch_size,
            option_labels={
                "local_batch_size": f"pp_batch_size={pp_batch_size}",
                "microbatch_size": f"pp_microbatch_size={pp_microbatch_size}",
                "schedule": f"pp_schedule={pp_schedule!r}",
                "num_stages": "module_fqns_per_model_part",
            },
        )
        self.world_mesh = world_mesh
        self.moe_mesh = moe_mesh
        self.pp_axis_name = pp_axis_name
        self.dp_axis_names = dp_axis_names
        self.cp_axis_name = cp_axis_name
        self.tp_axis_name = tp_axis_name
        self.ep_axis_name = ep_axis_name
        self.ep_shard_axis_names = ep_shard_axis_names
        self.pp_schedule = pp_schedule
        self.pp_schedule_csv = pp_schedule_csv
        self.pp_microbatch_size = pp_microbatch_size
        self.pp_batch_size = pp_batch_size
        self.layers_per_stage = layers_per_stage
        self.round_virtual_stages_to_pp_multiple = round_virtual_stages_to_pp_multiple
        self.module_fqns_per_model_part = module_fqns_per_model_part
        self.patch_inner_model = patch_inner_model
        self.patch_causal_lm_model = patch_causal_lm_model
        self.patch_stage_backward_maybe_with_nosync = patch_stage_backward_maybe_with_nosync
        self.defer_fsdp_grad_sync = defer_fsdp_grad_sync
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self.scale_grads_in_schedule = scale_grads_in_schedule
        self.pp_seq_len = pp_seq_len
        self.stages_per_rank = stages_per_rank
        self.loss_fn = loss_fn
        self._info = PipelineInfo()
        self._model_config: Any = None

    @classmethod
    def from_config(cls, config: PipelineConfig, *, world_mesh: Any, **kwargs: Any) -> AutoPipeline:
        return cls(world_mesh=world_mesh, **config.to_dict(), **kwargs)

    # ---------------------------------------------------------------------------------------------------------

    def build(
        self,
        model: nn.Module,
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        parallelize_fn: Callable[..., Any] | None = None,
    ) -> AutoPipeline:
        """Validate, plan, split, parallelize each part and build the schedule; returns self.

        `loss_fn` defaults to the one given to the constructor (or `PipelineConfig.loss_fn`); giving both is an
        error unless they are the same object.
        """
        if loss_fn is not None and self.loss_fn is not None and loss_fn is not self.loss_fn:
            raise ValueError(
                "build(loss_fn=...) and the AutoPipeline / PipelineConfig loss_fn differ: give the loss function once."
            )
        loss_fn = loss_fn if loss_fn is not None else self.loss_fn
        if loss_fn is None:
            raise ValueError("loss_fn must be provided: the last stage computes loss_fn(output, target).")
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a PyTorch module, got {type(model).__name__}.")
        validate_hf_model_for_pipeline_support(model)
        schedule, parts, has_first, has_last, stages = pipeline_model(
            model,
            self.world_mesh,
            self.moe_mesh,
            pp_axis_name=self.pp_axis_name,
            dp_axis_names=self.dp_axis_names,
            cp_axis_name=self.cp_axis_name,
            tp_axis_name=self.tp_axis_name,
            ep_axis_name=self.ep_axis_name,
            ep_shard_axis_names=self.ep_shard_axis_names,
            layers_per_stage=self.layers_per_stage,
            pipeline_parallel_schedule_csv=self.pp_schedule_csv,
            pipeline_parallel_schedule=self.pp_schedule,
            microbatch_size=self.pp_microbatch_size,
            local_batch_size=self.pp_batch_size,
            device=self._device,
            loss_fn=loss_fn,
            parallelize_fn=parallelize_fn,
            module_fqns_per_model_part=self.module_fqns_per_model_part,
            patch_inner_model=self.patch_inner_model,
            patch_causal_lm_model=self.patch_causal_lm_model,
            scale_grads=self.scale_grads_in_schedule,
            round_to_pp_multiple=self.round_virtual_stages_to_pp_multiple,
            seq_len=self.pp_seq_len,
            tensor_dtype=self.dtype,
            stages_per_rank=self.stages_per_rank,
            patch_stage_backward_maybe_with_nosync=self.patch_stage_backward_maybe_with_nosync,
            reduce_grad_per_microbatch=not self.defer_fsdp_grad_sync,
        )
        self._info = PipelineInfo(True, schedule, has_first, has_last, parts, stages)
        self._model_config = getattr(model, "config", None)
        return self

    @property
    def info(self) -> PipelineInfo:
        return self._info

    @property
    def parts(self) -> list[nn.Module]:
        if self._info.model_parts is None:
            raise RuntimeError("Autopipeline not built. Call build() first.")
        return self._info.model_parts

    @property
    def device(self) -> torch.device:
        return self._device

    # ---------------------------------------------------------------------------------------------------------

    def _kwargs_chunk_spec(self, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        parts = self._info.model_parts or []
        if not parts or not kwargs or not statically_defines(parts[0], "get_pipeline_kwargs_chunk_dims"):
            return None
        first: Any = parts[0]
        dims = first.get_pipeline_kwargs_chunk_dims(kwargs) or {}
        if not dims:
            return None
        unknown = [key for key in dims if key not in kwargs]
        if unknown:
            raise ValueError(f"Model PP chunk hook returned unknown kwarg: {', '.join(unknown)}")
        replicate = _compat.replicate_chunk_spec()
        spec = {
            key: TensorChunkSpec(0) if isinstance(value, torch.Tensor) else replicate for key, value in kwargs.items()
        }
        return spec | {key: TensorChunkSpec(dim) for key, dim in dims.items()}

    def step(
        self,
        model_input: Any = None,
        *,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one schedule step, then sum tied-embedding gradients. Returns the last stage's output (or None).

        `model_input` goes only to ranks holding the first stage; `kwargs` (attention_mask, position_ids, pixel
        values, ...) reach every local stage, chunked along dim 0 unless the model's
        `get_pipeline_kwargs_chunk_dims(kwargs) -> {name: dim}` says otherwise. Pass `model_input` (and `target`) on
        every rank: with static shapes every rank checks them first and refuses another sequence length or batch
        (call `update_seq_len` first) instead of waiting on a send of the wrong size.
        """
        schedule = self._info.schedule
        if schedule is None:
            raise RuntimeError("AutoPipeline.build() must be called before running a PP schedule step")
        stages = self._info.stages or []
        check_step_shapes(stages, self.pp_batch_size // self.pp_microbatch_size, [model_input], target)
        args = (model_input,) if self._info.has_first_stage and model_input is not None else ()
        spec = self._kwargs_chunk_spec(kwargs)
        with _compat.kwargs_chunk_spec_override(schedule, spec):
            output = schedule.step(*args, target=target, losses=losses, **kwargs)
        sync_tied_embedding_grads(self.parts)
        return output

    def update_seq_len(self, seq_len: int) -> None:
        """Switch the stages' static shapes to a new sequence length (call before `step` for variable lengths)."""
        if self._info.schedule is None or self._info.stages is None:
            raise RuntimeError("AutoPipeline.build() must be called before update_seq_len()")
        if seq_len == self.pp_seq_len:
            return
        reset_pp_stage_shapes(
            self._info.schedule,
            self._info.stages,
            None,
            self.pp_microbatch_size,
            seq_len,
            tensor_dtype=self.dtype,
        )
        self.pp_seq_len = seq_len

    # ---------------------------------------------------------------------------------------------------------

    @staticmethod
    def _count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
        # `parameters()` yields a shared (tied) parameter once.
        return sum(param.numel() for param in model.parameters() if param.requires_grad or not trainable_only)

    def list_stage_modules(self) -> list[list[str]]:
        if self._info.model_parts is None:
            return []
        return [[name for name, _ in part.named_modules() if name] for part in self._info.model_parts]

    def get_stage_param_counts(self, trainable_only: bool = False) -> list[int]:
        """Parameters per local stage (each stage's own copy counted once)."""
        if self._info.model_parts is None:
            return []
        return [self._count_parameters(part, trainable_only) for part in self._info.model_parts]

    def get_total_param_count(self, trainable_only: bool = False) -> int:
        return sum(self.get_stage_param_counts(trainable_only))

    def pretty_print_stages(self, max_modules_per_stage: int = 16, trainable_only: bool = False) -> str:
        if not self._info.model_parts or not self._info.stages:
            return "<no stages>"
        lines = []
        parts, modules_per_stage = self._info.model_parts, self.list_stage_modules()
        for stage, part, modules in zip(self._info.stages, parts, modules_per_stage, strict=True):
            flags = ",".join(flag for flag, on in (("first", stage.is_first), ("last", stage.is_last)) if on)
            lines.append(f"Stage {stage.stage_index} ({flags}): params={self._count_parameters(part, trainable_only)}")
            lines.extend(f"  - {name}" for name in modules[:max_modules_per_stage])
            if len(modules) > max_modules_per_stage:
                lines.append("  - ...")
        return "\n".join(lines)

    def debug_summary(self) -> str:
        schedule = self._info.schedule
        pp_size = self.pp_mesh.size() if hasattr(self.pp_mesh, "size") else "?"
        return "\n".join(
            [
                f"PP degree: {pp_size}",
                f"Local stages: {len(self._info.stages or [])}",
                f"Schedule: {type(schedule).__name__ if schedule is not None else None}",
                f"n_microbatches: {self.pp_batch_size // self.pp_microbatch_size}",
                f"Total params: {self.get_total_param_count()} (trainable: {self.get_total_param_count(True)})",
            ]
        )

    def log_debug_summary(self) -> None:
        logger.info("%s", self.debug_summary())

    def visualize_current_schedule(self, filename: str | None = None) -> Any:
        """Timeline of the built schedule (see `schedule_picture`); written to `filename` (.svg/.png/.txt)."""
        from .schedule_picture import save_schedule_picture, schedule_timeline

        if self._info.schedule is None:
            raise RuntimeError("AutoPipeline.build() must be called before visualize_current_schedule()")
        timeline = schedule_timeline(self._info.schedule)
        if filename is not None:
            save_schedule_picture(timeline, filename)
        return timeline
