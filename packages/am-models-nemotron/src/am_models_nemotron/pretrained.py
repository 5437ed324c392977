"""What `NemotronHForCausalLM` is besides its modules and its math: one base, `NemotronHPreTrainedModel`.

What it is for, each part with one job:
  - what the model declares to the infrastructure, in one place: the fp32 keep list (am-precision), the MoE
    balancing recipe (am-moe), the PP and TP plans, `get_capabilities(config)` (am-capabilities, seed-documented) and
    `am_contract()` (am-model-contract), with the hooks the contract and NeMo AutoModel's protocols name (context
    parallelism's options, batch preparation and limits; expert parallelism; the FSDP hooks; pipeline stages);
  - transformers' basics (the embeddings, gradient checkpointing; `device` and `dtype` are am-model-io's
    `OwnCacheGenerationHooks`') and loading and saving like transformers (`from_pretrained` / `save_pretrained`,
    written in `checkpoint` on am-model-io);
  - `generate(...)`: transformers' `GenerationMixin` with our hybrid cache (`generation.NemotronHGenerationMixin`).
What it must not do: build modules or compute (the subclass `model.NemotronHForCausalLM` holds the backbone, the LM
head, MTP, the forward and the loss), import am-pipelining or am-capabilities, or hold checkpoint logic itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Self

import torch
from torch import nn

import am_moe
from am_context_parallel import ContiguousCPOptions
from am_model_contract import (
    ContextParallelContract,
    ExpertParallelContract,
    ModelContract,
    PipelineContract,
    TensorParallelContract,
    declared_tp_plan,
)
from am_moe import GroupedExperts, LoadBalancing
from am_precision import BackendConfig, prepare_for_final_backward, prepare_for_grad_accumulation

from . import pipeline_stage
from .backbone import NemotronV3Model
from .backend import expert_parallel_options
from .config import NemotronConfig
from .cp import block_cp_problems, nemotron_cp_options, prepare_batch_for_cp
from .generation import NemotronHGenerationMixin
from .mtp import MTPConfig, MTPModule
from .tp_plan import CAUSAL_LM_TP_PLAN

__all__ = ["NemotronHPreTrainedModel"]


class NemotronHPreTrainedModel(nn.Module, NemotronHGenerationMixin):
    """The base of `NemotronHForCausalLM` (see the module docstring): declarations, hooks, basics, loading. The
    subclass builds `model` (the backbone), `lm_head` and `mtp`, and sets `config`, `nemotron_config`, `backend`,
    `mtp_config` and `compute_mtp_in_eval` and defines `combined_loss`; `num_mtp_depths` is the configured MTP depth
    count."""

    config: Any
    nemotron_config: NemotronConfig
    backend: BackendConfig
    model: NemotronV3Model
    lm_head: nn.Module | None
    mtp: MTPModule | None
    mtp_config: MTPConfig
    compute_mtp_in_eval: bool
    combined_loss: Callable[..., torch.Tensor]  # the training-loss rule, defined by the subclass (contract: pp.loss)

    # The same list as the backbone's (one source: the keep list is defined once, on NemotronV3Model).
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = NemotronV3Model._keep_in_fp32_modules_strict
    # The real model's balancing recipe, declared once on the backbone (see NemotronV3Model.moe_load_balancing).
    moe_load_balancing: ClassVar[LoadBalancing] = NemotronV3Model.moe_load_balancing
    _pp_plan: ClassVar[dict[str, tuple[list[str], list[str]]]] = {
        "model.embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "model.layers": (["hidden_states"], ["hidden_states"]),
        "model.norm": (["hidden_states"], ["hidden_states"]),
        "lm_head": (["hidden_states"], ["logits"]),
    }
    _is_stateful: ClassVar[bool] = True
    main_input_name: ClassVar[str] = "input_ids"
    supports_gradient_checkpointing: ClassVar[bool] = True

    _tp_plan: ClassVar[Any] = CAUSAL_LM_TP_PLAN  # am-tensor-parallel (tp_plan.py)

    @classmethod
    def get_capabilities(cls, config: Any) -> dict[str, bool]:
        """Capabilities for am-capabilities: PP and CP (contiguous) yes; EP when the config has MoE blocks
        (implemented by `apply_expert_parallel`); TP from the declared plan (`tp_plan.py`)."""
        has_moe = NemotronConfig.from_any(config).has_moe
        return {"supports_pp": True, "supports_ep": has_moe, "supports_tp": True, "supports_cp": True}

    def am_contract(self) -> ModelContract:
        """What this model offers the infrastructure (am-model-contract).

        - pp: its own forward is pipeline-aware (stages keep it); the last stage returns `(logits, *mtp_per_depth_h,
          seq_idx)` by these names (without MTP, bare logits); its loss is the model's rule (`combined_loss`).
        - cp: each rank one contiguous block (the Mamba2 recurrence passes its state rank to rank), with the MTP
          keys (`get_cp_options`), the shard-length and dropout limits (`cp_problems`) and the whole-sequence
          preparation before sharding (`prepare_batch_for_cp`: document ids, MTP inputs and targets).
        - ep: `apply_expert_parallel` when the config has MoE blocks.
        - tp: the declared plan (`tp_plan.py`; the Mamba2 mixers shard themselves).
        """
        moe = self.nemotron_config.has_moe
        # Without MTP the last stage returns bare logits (no seq_idx tail): declare what it really returns.
        outputs = ("logits", "mtp_per_depth_h", "seq_idx") if self.num_mtp_depths else ("logits",)
        return ModelContract(
            cp=ContextParallelContract(
                layout="contiguous",
                options=self.get_cp_options,
                problems=self.cp_problems,
                prepare=self.prepare_batch_for_cp,
            ),
            pp=PipelineContract(
                plan=self._pp_plan, keeps_own_forward=True, output_names=outputs, loss=self.combined_loss
            ),
            ep=ExpertParallelContract(is_moe=moe, apply=self.apply_expert_parallel if moe else None),
            tp=TensorParallelContract(plan=declared_tp_plan(self)),
        )

    @classmethod
    def from_config(cls, config: Any, backend: BackendConfig | None = None, **kwargs: Any) -> Self:
        """Build a randomly initialized model from a config (as the constructor; kwargs are its keyword options)."""
        return cls(config, backend, **kwargs)

    # transformers' basics

    def get_input_embeddings(self) -> nn.Module | None:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """Non-reentrant activation checkpointing of every backbone block (idempotent; parameter names unchanged)."""
        if gradient_checkpointing_kwargs and gradient_checkpointing_kwargs.get("use_reentrant", False):
            raise ValueError(
                "Only non-reentrant checkpointing is supported (pipeline stages call autograd.grad on their inputs); "
                "pass use_reentrant=False or nothing."
            )
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(self.model.gradient_checkpointing)

    @property
    def num_mtp_depths(self) -> int:
        """MTP depths D from the config (also on pipeline stages whose `mtp` module was pruned)."""
        return int(self.mtp_config.num_layers) if self.mtp_config.enabled else 0

    # Loading and saving (transformers' names; the logic is `checkpoint`'s, imported lazily: it imports this module)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: Any, backend: BackendConfig | None = None, **kwargs: Any
    ) -> Self:
        """Load an HF-format folder or hub id (config.json + safetensors, single or sharded) tensor by tensor.

        transformers' keywords: `torch_dtype` / `dtype` (fp32-pinned tensors stay fp32), `device_map` (None, "cpu"
        or one device; splitting is refused), `revision`, `config`, `cache_dir`, `token`, `local_files_only`,
        `force_download`; other keywords are the constructor's. See `checkpoint.load_pretrained`.
        """
        from .checkpoint import load_pretrained

        return load_pretrained(cls, pretrained_model_name_or_path, backend=backend, **kwargs)

    def save_pretrained(
        self,
        save_directory: Any,
        *,
        max_shard_size: int | str | None = "5GB",
        safe_serialization: bool = True,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write config.json + safetensors in NVIDIA's naming (shards + index above `max_shard_size`; only
        `safe_serialization=True`); `state_dict` (full tensors) replaces the model's own, e.g. the gathered experts
        of an expert-parallel model. See `checkpoint.save_pretrained`."""
        from .checkpoint import save_pretrained

        save_pretrained(
            self,
            save_directory,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            state_dict=state_dict,
        )

    # The infrastructure's duck-typed hooks (am-pipelining, am-context-parallel, am-capabilities, the trainer)

    def get_cp_options(self) -> ContiguousCPOptions:
        """What `make_cp_batch_and_ctx(mesh, batch, model=self)` shards besides the defaults: the MTP keys."""
        return nemotron_cp_options(mtp=self.num_mtp_depths > 0)

    def prepare_batch_for_cp(
        self, batch: dict[str, Any], *, labels_shifted: bool = False, ignore_index: int = -100
    ) -> dict[str, Any]:
        """The batch, ready to shard (`cp.prepare_batch_for_cp`): next-token `labels`, `_packed_seq_ids`, `padding_mask`
        and, while MTP runs, the per-depth MTP inputs and targets. Call it before `make_cp_batch_and_ctx(mesh, batch,
        model=model)`; `labels_shifted`: the batch's labels are already the next-token targets."""
        depths = self.num_mtp_depths if (self.training or self.compute_mtp_in_eval) else 0
        return prepare_batch_for_cp(batch, mtp_depths=depths, labels_shifted=labels_shifted, ignore_index=ignore_index)

    def cp_problems(self, *, seq_len: int, local_seq_len: int, cp_size: int) -> list[str]:
        """What the blocks that will run (the decoder's, and the MTP depths' when MTP runs in this mode) cannot honour
        on contiguous shards of `local_seq_len` tokens (`cp.block_cp_problems`, the rule the forward enforces again):
        a shard shorter than the Mamba conv halo, attention dropout while training. am-context-parallel's
        `model_cp_problems` calls it before any collective."""
        del seq_len, cp_size
        mtp_runs = self.mtp is not None and (self.training or self.compute_mtp_in_eval)
        blocks = [*self.model.layers.values(), *(self.mtp.layers if self.mtp is not None and mtp_runs else [])]
        return block_cp_problems(blocks, seqlen=local_seq_len, training=self.training)

    def apply_expert_parallel(self, ep_mesh: Any, *, dispatcher: str | None = None) -> list[GroupedExperts]:
        """Shard every routed expert (backbone and MTP) over the 1-D `ep_mesh` and switch the MoE layers to
        all-to-all dispatch (`am_moe.apply_expert_parallel`: routing and `e_score_correction_bias` stay replicated);
        returns the sharded `GroupedExperts`. NOTE: apply after pipeline splitting and before FSDP2.

        The dispatcher and its knobs are the backend's (`BackendConfig.dispatcher`, `dispatcher_num_sms`,
        `dispatcher_async_dispatch`, `dispatcher_share_token_dispatcher`; `backend.expert_parallel_options`);
        `dispatcher` overrides the name with any am-moe dispatcher (e.g. "torch_token", DeepEP's token-level protocol
        in plain torch).

        Raises:
            ValueError: before any collective: no MoE block, or am_moe's refusals (all listed).
        """
        if not self.nemotron_config.has_moe:
            raise ValueError(
                f"{type(self).__name__}: expert parallelism needs MoE blocks, but this config has none (block kinds "
                f"{sorted(set(self.nemotron_config.layers_block_type))}); use ep=1"
            )
        return am_moe.apply_expert_parallel(
            self, ep_mesh, **expert_parallel_options(self.backend, dispatcher=dispatcher)
        )

    def prepare_for_grad_accumulation(self, pp_enabled: bool = False) -> None:
        """With `backend.enable_fsdp_optimizations`: before the first backward of an optimizer step, defer every FSDP
        unit's reduce-scatter and resharding (am_precision.prepare_for_grad_accumulation; a no-op under pipeline
        parallelism, whose schedules already defer it, and without the option)."""
        if self.backend.enable_fsdp_optimizations:
            prepare_for_grad_accumulation(self, pp_enabled=pp_enabled)

    def prepare_for_final_backward(self, pp_enabled: bool = False) -> None:
        """With `backend.enable_fsdp_optimizations`: before the last backward of an optimizer step, turn the
        reduce-scatter and resharding back on (am_precision.prepare_for_final_backward)."""
        if self.backend.enable_fsdp_optimizations:
            prepare_for_final_backward(self, pp_enabled=pp_enabled)

    def customize_pipeline_stage_modules(
        self, module_names_per_stage: list[list[str]], *, layers_prefix: str = "model.", text_model: Any = None
    ) -> list[list[str]]:
        """am-pipelining's hook: a copy of the per-stage module names with `mtp` appended to the last stage
        (`layers_prefix` / `text_model`: am-pipelining passes them; this model's module names need neither)."""
        names = [list(stage) for stage in module_names_per_stage]
        if self.mtp is not None and names and "mtp" not in names[-1]:
            names[-1].append("mtp")
        return names

    def get_pipeline_stage_metas(
        self, *, is_first: bool, microbatch_size: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """am-pipelining's hook: meta tensors of this stage's inputs and outputs (`pipeline_stage.stage_metas`)."""
        return pipeline_stage.stage_metas(
            self, is_first=is_first, microbatch_size=microbatch_size, seq_len=seq_len, dtype=dtype
        )

    def get_pipeline_kwargs_chunk_dims(self, kwargs: dict[str, Any]) -> dict[str, int]:
        """am-pipelining's hook: per-sample tensors in `kwargs` are split into micro-batches along dim 0."""
        return {name: 0 for name in pipeline_stage.PER_SAMPLE_KWARGS if isinstance(kwargs.get(name), torch.Tensor)}
