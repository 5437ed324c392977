"""`NemotronHForCausalLM`: the Nemotron-H causal LM — backbone, LM head, next-token loss, multi-token prediction,
generation, pipeline-stage forward and checkpoints.

What it is for: the model's parts — `model` (the backbone), `lm_head`, `mtp` (the MTP depths) — and a forward that
reads as the model's math: resolve the inputs (`forward_inputs`, one place), run the backbone, the head, MTP and the
loss (`loss.combined_causal_lm_loss`, one rule). What the infrastructure reads is declared once, in `am_contract()`
(am-model-contract: pipeline outputs and forward, contiguous context parallelism, expert parallelism); its hooks and
the others (the training loss, generation, checkpoints) are one-line methods over plain functions in the module of
their concept. The forward serves a plain model (training, eval, generation through
`generation.NemotronHGenerationMixin`, the GenerationMixin hooks, with `NemotronHybridCache`) and a pruned pipeline
stage (`pipeline_stage`). It accepts what NeMo AutoModel's forward accepts (packed rows through `seq_idx` /
`_packed_seq_ids` / THD `cu_seqlens` / restarting `position_ids`, `padding_mask`, `causal_mask_mapping`, per-depth
MTP inputs) with real semantics on its own SDPA path: a packed row gives each document the logits it gets alone.
What it must not do: import am-pipelining or am-capabilities (they read `am_contract()`), mutate the
`BackendConfig` it receives, count the MTP loss into `loss` (see `outputs`), or tie the input and output
embeddings (the architecture has none; rejected).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Self, cast

import torch
from torch import nn
from transformers import GenerationConfig

import am_moe
from am_context_parallel import ContiguousCPOptions
from am_model_contract import (
    ContextParallelContract,
    ExpertParallelContract,
    ModelContract,
    PipelineContract,
    TensorParallelContract,
)
from am_moe import GroupedExperts, LoadBalancing
from am_precision import (
    BackendConfig,
    initialize_linear_module,
    prepare_for_final_backward,
    prepare_for_grad_accumulation,
    yield_fp32_model,
)

from . import pipeline_stage
from ._init import weight_of
from .backbone import NemotronV3Model, move_buffers_
from .backend import expert_parallel_options, resolve_backend
from .cache import NemotronHybridCache
from .config import NemotronConfig, as_hf_config, construction_dtype
from .cp import block_cp_problems, nemotron_cp_options, prepare_batch_for_cp
from .forward_inputs import resolve_forward_inputs
from .generation import NemotronHGenerationMixin
from .loss import combined_causal_lm_loss, sum_over_items
from .mtp import MTPConfig, MTPModule
from .mtp_inputs import mtp_fusion_inputs
from .outputs import NemotronHCausalLMOutputWithPast, keep_positions, select_hidden_states, split_output
from .tp_plan import CAUSAL_LM_TP_PLAN

__all__ = ["NemotronHForCausalLM"]


class NemotronHForCausalLM(nn.Module, NemotronHGenerationMixin):
    """Nemotron-H causal LM with optional multi-token prediction.

    Args:
        config: transformers `NemotronHConfig`, a NVIDIA remote-code config, any attribute object or a dict.
        backend: kernel choices; None: `default_backend()` (plain PyTorch). A `BackendConfig` runs as asked or is
            refused by `resolve_backend` (one ValueError naming every value that cannot run here). Never mutated.
        dtype: parameter dtype at construction (fp32-pinned tensors are fp32 regardless); None: the config's
            `torch_dtype` / `dtype` (as NeMo AutoModel builds it), or torch's default dtype when the config has none.
        device: construction device ("meta" defers allocation; then load a checkpoint with `assign=True`, or
            `to_empty(...)` and `initialize_weights(buffer_device=...)`).
        num_nextn_predict_layers: overrides the config's MTP depth count (0 disables MTP).
        mtp_loss_scaling_factor: weight of the mean MTP depth loss.
        mtp_use_repeated_layer: one physical MTP depth applied at every depth.

    Raises:
        NotImplementedError: `tie_word_embeddings=True`.
        ValueError: invalid config or backend choices that cannot run here (all listed).
    """

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
          seq_idx)` by these names (without MTP, bare logits).
        - cp: each rank one contiguous block (the Mamba2 recurrence passes its state rank to rank), with the MTP
          keys (`get_cp_options`) and the shard-length and dropout limits (`cp_problems`).
        - ep: `apply_expert_parallel` when the config has MoE blocks.
        - tp: the declared plan (`tp_plan.py`; the Mamba2 mixers shard themselves).
        """
        moe = self.nemotron_config.has_moe
        return ModelContract(
            cp=ContextParallelContract(layout="contiguous", options=self.get_cp_options, problems=self.cp_problems),
            pp=PipelineContract(
                plan=self._pp_plan, keeps_own_forward=True, output_names=("logits", "mtp_per_depth_h", "seq_idx")
            ),
            ep=ExpertParallelContract(is_moe=moe, apply=self.apply_expert_parallel if moe else None),
            tp=TensorParallelContract(plan=self._tp_plan),
        )

    def __init__(
        self,
        config: Any,
        backend: BackendConfig | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        num_nextn_predict_layers: int | None = None,
        mtp_loss_scaling_factor: float = 0.1,
        mtp_use_repeated_layer: bool = False,
    ) -> None:
        super().__init__()
        hf_config = as_hf_config(config)
        cfg = NemotronConfig.from_any(hf_config)
        if cfg.tie_word_embeddings:
            raise NotImplementedError(
                f"{type(self).__name__} has separate input and output embeddings and does not support "
                "tie_word_embeddings=True; set tie_word_embeddings=False in the config (Nemotron-H checkpoints are "
                "untied)."
            )
        self.config = hf_config
        self.nemotron_config = cfg
        dtype = construction_dtype(hf_config) if dtype is None else dtype
        self.backend = resolve_backend(backend, owner=type(self).__name__)
        self.model = NemotronV3Model(cfg, self.backend, device=device, dtype=dtype)
        self.lm_head: nn.Module | None = initialize_linear_module(
            self.backend.linear, cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype
        )
        self.mtp_config = MTPConfig.from_config(
            cfg,
            num_nextn_predict_layers=num_nextn_predict_layers,
            loss_scaling_factor=mtp_loss_scaling_factor,
            use_repeated_layer=mtp_use_repeated_layer,
        )
        self.mtp: MTPModule | None = (
            MTPModule(cfg, self.mtp_config, backend=self.backend, device=device, dtype=dtype)
            if self.mtp_config.enabled
            else None
        )
        self.compute_mtp_in_eval = False
        self.generation_config = GenerationConfig.from_model_config(hf_config)
        if torch.device(device or "cpu").type != "meta":
            self.initialize_weights(dtype=dtype)

    @classmethod
    def from_config(cls, config: Any, backend: BackendConfig | None = None, **kwargs: Any) -> NemotronHForCausalLM:
        """Build a randomly initialized model from a config (as the constructor; kwargs are its keyword options)."""
        return cls(config, backend, **kwargs)

    # Basics

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        for param in self.parameters():
            if param.is_floating_point():
                return param.dtype
        return torch.float32

    def get_input_embeddings(self) -> nn.Module | None:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    @torch.no_grad()
    def initialize_weights(
        self, buffer_device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """Random init sampled in fp32, then cast once to `dtype` (default: the current dtype; pinned stay fp32).

        buffer_device: where buffers are (re)created before their init (after `to_empty` of a meta-built model);
        None keeps them in place.
        """
        cfg = self.nemotron_config
        if buffer_device is not None:
            move_buffers_(self, buffer_device)
        with yield_fp32_model(self, restore_dtype=dtype):
            self.model.initialize_weights()
            if self.lm_head is not None:
                nn.init.normal_(weight_of(self.lm_head), mean=0.0, std=cfg.initializer_range)
            if self.mtp is not None:
                for layer in self.mtp.layers:
                    layer.init_weights(  # type: ignore[operator]
                        num_hidden_layers=cfg.num_hidden_layers, rescale_prenorm_residual=cfg.rescale_prenorm_residual
                    )

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
        cls,
        pretrained_model_name_or_path: Any,
        backend: BackendConfig | None = None,
        *,
        torch_dtype: Any = None,
        dtype: Any = None,
        device_map: Any = None,
        device: torch.device | str | None = None,
        revision: str | None = None,
        **kwargs: Any,
    ) -> Self:
        """Load an HF-format folder or hub id (config.json + safetensors, single or sharded) tensor by tensor.

        transformers' keywords: `torch_dtype` / `dtype` (fp32-pinned tensors stay fp32), `device_map` (None, "cpu"
        or one device; splitting is refused), `revision`, `config`, `cache_dir`, `token`, `local_files_only`,
        `force_download`; other keywords are the constructor's. See `checkpoint.load_pretrained`.
        """
        from .checkpoint import load_pretrained

        options = {"torch_dtype": torch_dtype, "dtype": dtype, "device_map": device_map, "revision": revision}
        return load_pretrained(cls, pretrained_model_name_or_path, backend=backend, device=device, **options, **kwargs)

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

    def combined_loss(
        self,
        output: Any,
        labels: torch.Tensor,
        *,
        loss_fn: Any = None,
        labels_shifted: bool = False,
        seq_idx: torch.Tensor | None = None,
        scaling_factor: float | None = None,
        mtp_per_depth_targets: Sequence[torch.Tensor] | None = None,
        ignore_index: int = -100,
    ) -> torch.Tensor:
        """THE training loss of one of this model's outputs: next-token loss + scaled MTP loss.

        output: the forward's output, a last pipeline stage's tuple `(logits, *D MTP hidden states, int32 seq_idx
        [B, S])`, or bare logits. labels: [B, S], unshifted unless `labels_shifted` (the pipeline's convention). MTP
        counts while training (or with `compute_mtp_in_eval`); seq_idx defaults to the stage tuple's tail; the
        output's `mtp_per_depth_targets` (context parallelism) are used unless given; scaling_factor: default
        `mtp_config.loss_scaling_factor`. The rule itself is `loss.combined_causal_lm_loss`.
        """
        logits, mtp_hidden, output_seq_idx, output_targets = split_output(output, mtp_depths=self.num_mtp_depths)
        seq_idx = output_seq_idx if seq_idx is None else seq_idx
        mtp_per_depth_targets = output_targets if mtp_per_depth_targets is None else mtp_per_depth_targets
        return combined_causal_lm_loss(
            logits,
            labels,
            mtp_per_depth_h=mtp_hidden if (self.training or self.compute_mtp_in_eval) else [],
            lm_head=self.lm_head,
            mtp_loss_scaling_factor=self.mtp_config.loss_scaling_factor if scaling_factor is None else scaling_factor,
            seq_idx=seq_idx,
            loss_fn=loss_fn,
            labels_shifted=labels_shifted,
            mtp_per_depth_targets=mtp_per_depth_targets,
            ignore_index=ignore_index,
        ).loss

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

    # Forward

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *mtp_embed_inputs: torch.Tensor,
        attention_mask: torch.Tensor | dict[str, Any] | None = None,
        causal_mask_mapping: dict[str, Any] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: NemotronHybridCache | None = None,
        use_cache: bool | None = None,
        cache_position: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        mtp_per_depth_input_ids: Sequence[torch.Tensor] | torch.Tensor | None = None,
        mtp_per_depth_position_ids: Sequence[torch.Tensor] | torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | int | Sequence[int] | None = None,
        return_dict: bool | None = None,
        compute_logits: bool = True,
        shift_labels: torch.Tensor | None = None,
        mtp_per_depth_targets: Sequence[torch.Tensor] | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """Causal LM forward (NeMo AutoModel's signature; every accepted input takes effect or is refused).

        input_ids: [B, S] ids ([T] with qkv_format="thd"), or [B, S, H] hidden states on a non-first pipeline stage
        (then `mtp_embed_inputs` are the D per-depth embeddings [B, S, H] the previous stage sent; off the pipeline
        they are precomputed per-depth MTP embeddings). attention_mask: [B, past + S] (1 keep, 0 pad), a 4-D mask, or
        a transformers mask mapping. causal_mask_mapping: {"full_attention": [B, 1, S, past + S] mask for the
        attention layers, "linear_attention": [B, S] for the Mamba layers}. labels: [B, S] unshifted (the loss
        shifts by one; positions and targets that are padding are ignored). padding_mask: [B, S] True = padding
        (excluded from MoE routing, zeroed in Mamba, never attended to).
        Packed rows (documents reset the Mamba state and conv window, attention is document-masked, targets and MTP
        inputs never cross a document): `seq_idx` [B, S] document ids, `_packed_seq_ids` [B, S] (1-based, 0 = pad),
        `qkv_format="thd"` with `cu_seqlens` [N + 1] (+ `cu_seqlens_padded`, `max_seqlen`) on one row, or
        `position_ids` that restart at each document. The attention has no positional encoding, so positions matter
        only as document starts. mtp_per_depth_input_ids: D [B, S] ids (already shifted, e.g. before CP sharding)
        instead of shifting `input_ids`; mtp_per_depth_position_ids: their positions (shape-checked; NoPE).
        output_hidden_states: None -> `config.output_hidden_states`; True, an index or indices (transformers).
        num_items_in_batch (kwarg): the loss becomes the cross-entropy sum / num_items_in_batch (transformers).
        shift_labels: [B, S] next-token targets already shifted (transformers' name; instead of `labels`);
        mtp_per_depth_targets: D [B, S] MTP targets (or [B, D, S]) precomputed with them; both come from
        `prepare_batch_for_cp` under context parallelism, and the targets are kept on the output for `combined_loss`.

        Context parallelism: inside the `RingAttentionContext` of `make_cp_batch_and_ctx(mesh, batch, model=model)`
        (contiguous layout; prepare the batch with `prepare_batch_for_cp` first) this rank's block runs exactly its
        rows of the single-process forward: ring attention, Mamba2 state passing, MTP from the pre-shifted inputs.
        `labels` (shifted here), a cache, THD boundaries and explicit masks are refused there, on every rank, before
        any transfer; `loss` is then this rank's share (a local mean; use `combined_loss` with a global-count
        `loss_fn` for the global loss). cp_size / cp_rank (kwargs): must match the entered context (1 / 0 outside).

        Returns:
            Off the pipeline: `NemotronHCausalLMOutputWithPast` (a tuple with `return_dict=False`); `loss` is the
            next-token loss only, `mtp_loss` separate. Pipeline stages: see `pipeline_stage`.

        Raises:
            TypeError: unknown keyword arguments. ValueError: every invalid or contradictory input (one message).
        """
        inputs = resolve_forward_inputs(
            self,
            input_ids=input_ids,
            mtp_embed_inputs=mtp_embed_inputs,
            attention_mask=attention_mask,
            causal_mask_mapping=causal_mask_mapping,
            inputs_embeds=inputs_embeds,
            labels=labels,
            shift_labels=shift_labels,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_ids=position_ids,
            padding_mask=padding_mask,
            mtp_per_depth_input_ids=mtp_per_depth_input_ids,
            mtp_per_depth_targets=mtp_per_depth_targets,
            logits_to_keep=logits_to_keep,
            compute_logits=compute_logits,
            kwargs=kwargs,
        )
        if inputs.pipeline_stage:
            return pipeline_stage.stage_forward(self, inputs, mtp_embed_inputs, mtp_per_depth_input_ids)
        layout = inputs.layout
        reference = inputs.input_ids if inputs.input_ids is not None else inputs.inputs_embeds
        assert reference is not None
        assert self.lm_head is not None

        # h = backbone(x); logits = lm_head(h)
        cache = past_key_values
        if use_cache and cache is None:
            cache = NemotronHybridCache(self.nemotron_config, reference.shape[0], self.dtype, reference.device)
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        hidden_list: list[torch.Tensor] | None = [] if output_hidden_states not in (False, None, []) else None
        hidden = self.model(
            inputs.input_ids,
            inputs_embeds=inputs.inputs_embeds,
            past_key_values=cache,
            cache_position=cache_position,
            layout=layout,
            all_hidden_states=hidden_list,
        )
        if cache is not None:
            cache.has_previous_state = True
            cache.seen_tokens += reference.shape[1]
        if compute_logits:
            logits = self.lm_head(keep_positions(hidden, logits_to_keep))
        else:
            logits = hidden.new_empty(*hidden.shape[:-1], 0)

        # MTP depth d: h_d = mtp_d(h_{d-1}, embedding of the token d + 1 places ahead)
        mtp_hidden: list[torch.Tensor] | None = None
        if inputs.mtp_runs:
            assert self.mtp is not None
            embeds = mtp_fusion_inputs(
                depths=self.num_mtp_depths,
                embed_tokens=self.model.embed_tokens,
                input_ids=inputs.input_ids,
                inputs_embeds=inputs.inputs_embeds,
                seq_idx=layout.seq_idx,
                embeds=mtp_embed_inputs,
                per_depth_input_ids=mtp_per_depth_input_ids,
                per_depth_position_ids=mtp_per_depth_position_ids,
            )
            mtp_hidden = self.mtp(hidden, embed_inputs=embeds, **layout.block_inputs(hidden))

        # loss: next-token cross entropy; mtp_loss: the scaled MTP term (reported apart, see `combined_loss`)
        loss = mtp_loss = None
        if inputs.targets is not None:
            combined = combined_causal_lm_loss(
                logits,
                inputs.targets,
                mtp_per_depth_h=mtp_hidden,
                lm_head=self.lm_head,
                mtp_loss_scaling_factor=self.mtp_config.loss_scaling_factor,
                seq_idx=layout.seq_idx,
                loss_fn=sum_over_items(inputs.num_items_in_batch) if inputs.num_items_in_batch is not None else None,
                labels_shifted=inputs.labels_shifted,
                mtp_per_depth_targets=inputs.per_depth_targets,
                # padding is never a target, nor predicts one (under CP already applied before sharding)
                padding_mask=layout.padding_mask if layout.cp is None else None,
            )
            loss, mtp_loss = combined.lm_loss, combined.mtp_loss

        output = NemotronHCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=cast(Any, cache) if use_cache or past_key_values is not None else None,
            hidden_states=cast(Any, select_hidden_states(hidden_list, output_hidden_states)),
            mtp_per_depth_h=mtp_hidden,
            mtp_loss=mtp_loss,
            mtp_loss_scaling_factor=self.mtp_config.loss_scaling_factor if mtp_hidden is not None else None,
            mtp_per_depth_targets=inputs.per_depth_targets,
        )
        return output.to_tuple() if return_dict is False else output
