"""`NemotronHForCausalLM`: the Nemotron-H causal LM — its parts and its math.

What it is for: the model's parts — `model` (the backbone), `lm_head`, `mtp` (the MTP depths) —, their init, and a
forward that reads as the model's math: resolve the inputs (`forward_inputs`, the one place), run the backbone, the
head, MTP and the loss (`loss.combined_causal_lm_loss`, one rule; `combined_loss` is that rule on any of the model's
outputs). Everything else the class is lives in its base, `pretrained.NemotronHPreTrainedModel`: what it declares to
the infrastructure (`am_contract()`, `get_capabilities`, the plans and hooks), transformers' basics, loading and
saving (`checkpoint`), and generation (`generation.NemotronHGenerationMixin`). The forward serves a plain model
(training, eval, generation with `NemotronHybridCache`) and a pruned pipeline stage (`pipeline_stage`). It accepts
what NeMo AutoModel's forward accepts (packed rows through `seq_idx` / `_packed_seq_ids` / THD `cu_seqlens` /
restarting `position_ids`, `padding_mask`, `causal_mask_mapping`, per-depth MTP inputs) with real semantics on its
own SDPA path: a packed row gives each document the logits it gets alone.
What it must not do: import am-pipelining or am-capabilities (they read `am_contract()`), mutate the
`BackendConfig` it receives, count the MTP loss into `loss` (see `outputs`), or tie the input and output
embeddings (the architecture has none; rejected).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn
from transformers import GenerationConfig

from am_precision import BackendConfig, initialize_linear_module, yield_fp32_model

from . import pipeline_stage
from ._init import weight_of
from .backbone import NemotronV3Model, move_buffers_
from .backend import resolve_backend
from .cache import NemotronHybridCache
from .config import NemotronConfig, as_hf_config, construction_dtype
from .forward_inputs import resolve_forward_inputs
from .loss import combined_causal_lm_loss, sum_over_items
from .mtp import MTPConfig, MTPModule
from .mtp_inputs import mtp_fusion_inputs
from .outputs import NemotronHCausalLMOutputWithPast, keep_positions, select_hidden_states, split_output
from .pretrained import NemotronHPreTrainedModel

__all__ = ["NemotronHForCausalLM"]


class NemotronHForCausalLM(NemotronHPreTrainedModel):
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
