"""`NemotronHForCausalLM`: the Nemotron-H causal LM — backbone, LM head, next-token loss, multi-token prediction,
generation, pipeline-stage forward and checkpoints.

What it is for: the forward of the whole model in three roles — a plain model (training, eval, generation through
transformers' `GenerationMixin` with `NemotronHybridCache`), and a pruned pipeline stage (`pipeline_stage`). It
accepts what NeMo AutoModel's forward accepts (packed rows through `seq_idx` / `_packed_seq_ids` / THD
`cu_seqlens` / restarting `position_ids`, `padding_mask`, `causal_mask_mapping`, per-depth MTP inputs) with real
semantics on its own SDPA path: a packed row gives each document the logits it gets alone.
What it must not do: import am-pipelining or am-capabilities (they find the hooks by duck typing), mutate the
`BackendConfig` it receives, count the MTP loss into `loss` (see `outputs`), or tie the input and output
embeddings (the architecture has none; rejected).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin

from am_context_parallel import ContiguousCPOptions
from am_precision import BackendConfig, initialize_linear_module, yield_fp32_model

from ._init import weight_of
from .backbone import NemotronV3Model, move_buffers_
from .backend import default_backend, resolve_backend
from .cache import NemotronHybridCache
from .config import NemotronConfig, as_hf_config
from .cp import (
    ContextParallelLimits,
    NemotronCPContext,
    cp_kwarg_problems,
    nemotron_cp_options,
    prepare_batch_for_cp,
    resolve_layout,
)
from .cp import prepare_mtp_inputs_for_cp as _prepare_mtp_inputs_for_cp
from .generation import NemotronGenerationMixin
from .inputs import pop_layout_kwargs
from .loss import cross_entropy
from .moe import ExpertParallelHooks
from .mtp import MTPConfig, MTPModule
from .mtp_inputs import mtp_fusion_inputs
from .outputs import (
    NemotronHCausalLMOutputWithPast,
    NemotronLossMixin,
    combined_causal_lm_loss,
    select_hidden_states,
)
from .pipeline_stage import NemotronPipelineMixin
from .pretrained import NemotronPretrainedMixin

__all__ = [
    "ModelClass",
    "NemotronHCausalLMOutputWithPast",
    "NemotronHForCausalLM",
    "NemotronV3Model",
    "default_backend",
]

# Keyword arguments of transformers' generate() / Trainer that this forward takes but whose only value here is "off".
_CP_KWARGS = ("cp_rank", "cp_size")


class NemotronHForCausalLM(
    ContextParallelLimits,
    ExpertParallelHooks,
    NemotronPipelineMixin,
    NemotronGenerationMixin,
    NemotronLossMixin,
    NemotronPretrainedMixin,
    nn.Module,
    GenerationMixin,
):
    """Nemotron-H causal LM with optional multi-token prediction.

    Args:
        config: transformers `NemotronHConfig`, a NVIDIA remote-code config, any attribute object or a dict.
        backend: kernel choices; None: `default_backend()` (plain PyTorch). Any `BackendConfig` — including
            `BackendConfig()` with its machine-dependent defaults — is mapped to the choices implemented here by
            `resolve_backend` (one logged line when something changes). Never mutated.
        dtype: parameter dtype at construction (fp32-pinned tensors are fp32 regardless).
        device: construction device ("meta" defers allocation; then load a checkpoint with `assign=True`, or
            `to_empty(...)` and `initialize_weights(buffer_device=...)`).
        num_nextn_predict_layers: overrides the config's MTP depth count (0 disables MTP).
        mtp_loss_scaling_factor: weight of the mean MTP depth loss.
        mtp_use_repeated_layer: one physical MTP depth applied at every depth.

    Raises:
        NotImplementedError: `tie_word_embeddings=True`.
        ValueError: invalid config or backend choices that cannot be resolved (all listed).
    """

    # The same list as the backbone's (one source: the keep list is defined once, on NemotronV3Model).
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = NemotronV3Model._keep_in_fp32_modules_strict
    _pp_keep_self_forward: ClassVar[bool] = True
    pipeline_output_names: ClassVar[tuple[str, ...]] = ("logits", "mtp_per_depth_h", "seq_idx")
    """What each position of the last pipeline stage's tuple is (am-pipelining reads it by these names; the MTP
    hidden states take every position between logits and seq_idx). Without MTP the last stage returns bare logits."""
    _pp_plan: ClassVar[dict[str, tuple[list[str], list[str]]]] = {
        "model.embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "model.layers": (["hidden_states"], ["hidden_states"]),
        "model.norm": (["hidden_states"], ["hidden_states"]),
        "lm_head": (["hidden_states"], ["logits"]),
    }
    _is_stateful: ClassVar[bool] = True
    main_input_name: ClassVar[str] = "input_ids"
    supports_gradient_checkpointing: ClassVar[bool] = True

    # am-context-parallel: each rank one contiguous block (the Mamba2 recurrence passes its state rank to rank).
    _cp_layout: ClassVar[str] = "contiguous"

    @classmethod
    def get_capabilities(cls, config: Any) -> dict[str, bool]:
        """Capabilities for am-capabilities: PP and CP (contiguous) yes; EP when the config has MoE blocks
        (implemented by `apply_expert_parallel`); no TP."""
        has_moe = NemotronConfig.from_any(config).has_moe
        return {"supports_pp": True, "supports_ep": has_moe, "supports_tp": False, "supports_cp": True}

    def __init__(
        self,
        config: Any,
        backend: BackendConfig | None = None,
        *,
        dtype: torch.dtype = torch.float32,
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
            MTPModule.for_config(cfg, self.mtp_config, backend=self.backend, device=device, dtype=dtype)
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

    # ------------------------------------------------------------------------------------------------------------
    # Basics
    # ------------------------------------------------------------------------------------------------------------

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

    # ------------------------------------------------------------------------------------------------------------
    # Context parallelism (am-context-parallel's contiguous path, declared by `_cp_layout`)
    # ------------------------------------------------------------------------------------------------------------

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

    prepare_mtp_inputs_for_cp = _prepare_mtp_inputs_for_cp  # upstream's hook name (cp.py)

    # ------------------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------------------

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
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if kwargs.pop("output_attentions", None):
            raise ValueError("output_attentions is not supported (SDPA does not return attention weights).")
        cp_kwargs = {name: kwargs.pop(name) for name in _CP_KWARGS if name in kwargs}
        layout_kwargs = pop_layout_kwargs(kwargs)
        if kwargs:
            raise TypeError(f"{type(self).__name__}.forward got unexpected keyword arguments {sorted(kwargs)}.")
        if isinstance(attention_mask, dict):  # transformers passes its mask mapping as attention_mask
            if causal_mask_mapping is not None:
                raise ValueError("got a mask mapping as attention_mask and causal_mask_mapping; pass one of them")
            causal_mask_mapping, attention_mask = attention_mask, None
        if layout_kwargs.get("qkv_format") == "thd":  # one packed row may come as [T] / [T, H]
            input_ids = input_ids[None] if input_ids is not None and input_ids.dim() == 1 else input_ids
            inputs_embeds = (
                inputs_embeds[None] if inputs_embeds is not None and inputs_embeds.dim() == 2 else inputs_embeds
            )
            labels = labels[None] if labels is not None and labels.dim() == 1 else labels
        if position_ids is not None:
            layout_kwargs["position_ids"] = position_ids
        if padding_mask is not None:
            layout_kwargs["padding_mask"] = padding_mask
        if labels is not None and shift_labels is not None:
            raise ValueError("pass labels (unshifted) or shift_labels (already shifted), not both")

        reference = input_ids if input_ids is not None else inputs_embeds
        if reference is None:
            raise ValueError("input_ids must be provided if inputs_embeds is not provided.")
        seqlen = reference.shape[1]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        mtp_runs = self.mtp is not None and past_key_values is None and not use_cache
        mtp_runs = mtp_runs and (self.training or self.compute_mtp_in_eval)
        per_depth_given = bool(mtp_embed_inputs) or mtp_per_depth_input_ids is not None

        def cp_problems(cp: NemotronCPContext) -> list[str]:
            problems = self.cp_problems(seq_len=seqlen * cp.size, local_seq_len=seqlen, cp_size=cp.size)
            problems += cp_kwarg_problems(cp_kwargs, cp.size, cp.rank)
            if labels is not None:
                problems.append(
                    "labels would be shifted here, across block edges; prepare the batch with "
                    "model.prepare_batch_for_cp before sharding and pass its labels as shift_labels (or compute the "
                    "loss with model.combined_loss(out, labels, labels_shifted=True))"
                )
            if use_cache or past_key_values is not None:
                problems.append("a generation cache cannot be combined with context parallelism")
            first_stage = self.model.embed_tokens is not None
            needs_ids = mtp_runs or (self._is_pipeline_stage() and self.num_mtp_depths > 0)
            if needs_ids and first_stage and not per_depth_given:
                problems.append(
                    "MTP needs mtp_per_depth_input_ids shifted on the whole sequence before sharding "
                    "(model.prepare_batch_for_cp)"
                )
            if shift_labels is not None and mtp_runs and mtp_per_depth_targets is None:
                problems.append("the MTP loss needs mtp_per_depth_targets from model.prepare_batch_for_cp")
            return problems

        layout = resolve_layout(
            owner=type(self).__name__,
            batch=reference.shape[0],
            seqlen=seqlen,
            device=reference.device,
            past_length=past,
            attention_mask=attention_mask,
            causal_mask_mapping=causal_mask_mapping,
            layout_kwargs=layout_kwargs,
            cp_problems=cp_problems,
        )
        if layout.cp is None and cp_kwarg_problems(cp_kwargs, 1, 0):
            raise ValueError(
                "; ".join(cp_kwarg_problems(cp_kwargs, 1, 0)) + ": context parallelism runs inside the "
                "RingAttentionContext of make_cp_batch_and_ctx(mesh, batch, model=model), after "
                "model.prepare_batch_for_cp(batch)."
            )
        if self._is_pipeline_stage():
            return self._stage_forward(
                input_ids, mtp_embed_inputs, layout=layout, per_depth_input_ids=mtp_per_depth_input_ids
            )

        cache = past_key_values
        if use_cache and cache is None:
            cache = NemotronHybridCache(self.nemotron_config, reference.shape[0], self.dtype, reference.device)
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        hidden_list: list[torch.Tensor] | None = [] if output_hidden_states not in (False, None, []) else None
        hidden = self.model(
            input_ids,
            inputs_embeds=inputs_embeds,
            past_key_values=cache,
            cache_position=cache_position,
            layout=layout,
            all_hidden_states=hidden_list,
        )
        if cache is not None:
            cache.has_previous_state = True

        assert self.lm_head is not None
        keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
        if labels is not None and not keep_all:
            raise ValueError(
                f"logits_to_keep={logits_to_keep!r} cannot be combined with labels: the loss needs the logits of every "
                "position. Pass logits_to_keep=0 (the default) when computing a loss."
            )
        if compute_logits:
            logits = self.lm_head(hidden if keep_all else _keep(hidden, logits_to_keep))
        else:
            if labels is not None:
                raise ValueError("compute_logits=False cannot be combined with labels (the loss needs logits).")
            logits = hidden.new_empty(*hidden.shape[:-1], 0)

        mtp_hidden: list[torch.Tensor] | None = None
        if mtp_runs:
            assert self.mtp is not None
            embeds = mtp_fusion_inputs(
                depths=self.num_mtp_depths,
                embed_tokens=self.model.embed_tokens,
                input_ids=input_ids,
                inputs_embeds=inputs_embeds,
                seq_idx=layout.seq_idx,
                embeds=mtp_embed_inputs,
                per_depth_input_ids=mtp_per_depth_input_ids,
                per_depth_position_ids=mtp_per_depth_position_ids,
            )
            mtp_hidden = self.mtp(hidden, embed_inputs=embeds, **layout.block_inputs(hidden))
        elif per_depth_given or mtp_per_depth_targets is not None:
            raise ValueError("per-depth MTP inputs were given but MTP does not run (no MTP, eval, or a cache).")

        depth_targets = _per_depth(mtp_per_depth_targets)
        loss = mtp_term = None
        targets = labels if labels is not None else shift_labels
        if targets is not None:
            combined = combined_causal_lm_loss(
                logits,
                targets,
                mtp_per_depth_h=mtp_hidden,
                lm_head=self.lm_head,
                mtp_loss_scaling_factor=self.mtp_config.loss_scaling_factor,
                seq_idx=layout.seq_idx,
                loss_fn=_sum_over(num_items_in_batch) if num_items_in_batch is not None else None,
                labels_shifted=shift_labels is not None,
                mtp_per_depth_targets=depth_targets,
                # padding is never a target, nor predicts one (under CP already applied before sharding)
                padding_mask=layout.padding_mask if layout.cp is None else None,
            )
            loss, mtp_term = combined.lm_loss, combined.mtp_loss

        output = NemotronHCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=cast(Any, cache) if use_cache or past_key_values is not None else None,
            hidden_states=cast(Any, select_hidden_states(hidden_list, output_hidden_states)),
            mtp_per_depth_h=mtp_hidden,
            mtp_loss=mtp_term,
            mtp_loss_scaling_factor=self.mtp_config.loss_scaling_factor if mtp_hidden is not None else None,
            mtp_per_depth_targets=depth_targets,
        )
        if return_dict is False:
            return output.to_tuple()
        return output


def _per_depth(value: Sequence[torch.Tensor] | torch.Tensor | None) -> list[torch.Tensor] | None:
    """D tensors from a sequence or a [B, D, S] tensor."""
    if value is None:
        return None
    return list(value.unbind(1)) if isinstance(value, torch.Tensor) else list(value)


def _sum_over(count: Any) -> Any:
    """transformers' `num_items_in_batch` normalization: cross-entropy sum over non-ignored targets / count."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = (targets != -100).sum()
        return cross_entropy(logits, targets, empty_is_zero=True) * valid / count

    return loss


def _keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep]
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
    return hidden[:, -logits_to_keep:]


ModelClass = NemotronHForCausalLM
