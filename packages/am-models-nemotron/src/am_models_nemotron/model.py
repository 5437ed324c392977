"""Nemotron-H model classes: `NemotronV3Model` (backbone), `NemotronHForCausalLM` (LM head, loss, MTP, generation,
pipeline-stage forward, checkpoints) and `NemotronHCausalLMOutputWithPast`.

What it is for: the forward of the whole model in three roles — a plain model (training, eval, generation through
transformers' `GenerationMixin` with `NemotronHybridCache`), and a pruned pipeline stage (hidden states arrive in
the `input_ids` slot, per-depth MTP embeddings travel between stages as extra positional tensors, the last stage
returns `(logits, *mtp_hidden, seq_idx_int32)`).
What it must not do: import am-pipelining or am-capabilities (they find the hooks by duck typing), mutate the
`BackendConfig` it receives, or tie the input and output embeddings (the architecture has none; rejected).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationConfig, GenerationMixin
from transformers.utils import ModelOutput

from am_models_nemotron._init import weight_of
from am_models_nemotron.attention import build_attention_mask
from am_models_nemotron.blocks import NemotronV3Block
from am_models_nemotron.cache import NemotronHybridCache
from am_models_nemotron.config import NemotronConfig, as_hf_config
from am_models_nemotron.loss import cross_entropy
from am_models_nemotron.moe import ExpertParallelHooks
from am_models_nemotron.mtp import MTPConfig, MTPModule, mtp_loss, roll_tensor, shift_labels
from am_precision import BackendConfig, initialize_linear_module, initialize_rms_norm_module, yield_fp32_model

__all__ = [
    "ModelClass",
    "NemotronHCausalLMOutputWithPast",
    "NemotronHForCausalLM",
    "NemotronV3Model",
    "default_backend",
]

# Keyword arguments that transformers' generate() or trainers pass and that change nothing here.
_IGNORED_KWARGS = frozenset(
    {"return_dict", "output_attentions", "num_items_in_batch", "position_ids", "cache_position"}
)


def default_backend() -> BackendConfig:
    """The plain-PyTorch backend this package implements: SDPA attention, torch linears, fp32 RMSNorm, torch experts."""
    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")


@dataclass
class NemotronHCausalLMOutputWithPast(ModelOutput):
    """Output of `NemotronHForCausalLM.forward` off the pipeline.

    loss: main next-token loss (+ `mtp_loss` when MTP ran); logits: [B, S_kept, V]; past_key_values: the cache when
    `use_cache`; hidden_states: (embeddings, after each layer..., final normed) when requested; mtp_per_depth_h: D
    hidden states [B, S, H] (training); mtp_loss: the scaled MTP term already included in `loss`.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    mtp_per_depth_h: tuple[torch.Tensor, ...] | None = None
    mtp_loss: torch.Tensor | None = None
    mtp_loss_scaling_factor: float | None = None


class NemotronV3Model(nn.Module):
    """Backbone: `embed_tokens`, `layers` (ModuleDict keyed by global index), final `norm`.

    Any of the three may be None / partial on a pipeline stage. forward(...) -> hidden states [B, S, H].
    """

    # The fp32-pinned tensors, listed once for the package: the router's `e_score_correction_bias` and each Mamba
    # mixer's `_fp32_params` holder (A_log, dt_bias, D). Casting (am-precision), checkpoints and the state dict
    # adapter all derive from it.
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["e_score_correction_bias", "_fp32_params"]

    def __init__(
        self,
        config: NemotronConfig,
        *,
        backend: BackendConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            config.vocab_size, config.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleDict(
            {
                str(i): NemotronV3Block(config, i, backend=backend, device=device, dtype=dtype)
                for i in range(config.num_hidden_layers)
            }
        )
        self.norm: nn.Module | None = initialize_rms_norm_module(
            backend.rms_norm, config.hidden_size, eps=config.layer_norm_epsilon, device=device, dtype=dtype
        )
        self.gradient_checkpointing = False

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """Embedding normal(0, initializer_range), norms ones, every block's own init (present modules only)."""
        cfg = self.config
        if self.embed_tokens is not None:
            nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=cfg.initializer_range)
        reset = getattr(self.norm, "reset_parameters", None)
        if callable(reset):
            reset()
        for layer in self.layers.values():
            layer.init_weights(  # type: ignore[operator]
                num_hidden_layers=cfg.num_hidden_layers, rescale_prenorm_residual=cfg.rescale_prenorm_residual
            )

    def block_inputs(
        self,
        hidden_states: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        cache: NemotronHybridCache | None = None,
    ) -> dict[str, Any]:
        """The per-block inputs (masks, seq_idx, cache) for hidden states [B, S, H] and a [B, past+S] 2-D mask."""
        batch, seqlen = hidden_states.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        mamba_mask = None
        attn_mask: torch.Tensor | None = None
        if attention_mask is not None and attention_mask.dim() == 4:
            attn_mask = attention_mask  # already built by the caller (bool, True = attend, or additive float)
        else:
            if attention_mask is not None:
                has_padding = bool((attention_mask[:, -seqlen:] == 0).any())
                if has_padding and seqlen > 1:
                    mamba_mask = attention_mask[:, -seqlen:].to(hidden_states.dtype)
                if has_padding and padding_mask is None:
                    padding_mask = attention_mask[:, -seqlen:] == 0
            attn_mask = build_attention_mask(
                batch_size=batch,
                query_length=seqlen,
                past_length=past,
                attention_mask=attention_mask,
                seq_idx=seq_idx,
                device=hidden_states.device,
            )
        return {
            "attention_mask": attn_mask,
            "mamba_mask": mamba_mask,
            "padding_mask": padding_mask,
            "seq_idx": seq_idx,
            "cache": cache,
        }

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        cache: NemotronHybridCache | None = None,
        all_hidden_states: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids: [B, S] token ids, or [B, S, H] hidden states on a non-first pipeline stage."""
        hidden = self.embed(input_ids, inputs_embeds)
        inputs = self.block_inputs(
            hidden, attention_mask=attention_mask, padding_mask=padding_mask, seq_idx=seq_idx, cache=cache
        )
        checkpointing = self.gradient_checkpointing and self.training and cache is None
        for layer in self.layers.values():
            if all_hidden_states is not None:
                all_hidden_states.append(hidden)
            if checkpointing:
                hidden = checkpoint(functools.partial(layer, **inputs), hidden, use_reentrant=False)
            else:
                hidden = layer(hidden, **inputs)
        if self.norm is not None:
            hidden = self.norm(hidden)
        if all_hidden_states is not None:
            all_hidden_states.append(hidden)
        return hidden

    def embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        if inputs_embeds is not None:
            if input_ids is not None:
                raise ValueError(
                    "got both input_ids and inputs_embeds; pass exactly one (token ids [B, S], or embeddings [B, S, H])"
                )
            return inputs_embeds
        if input_ids is None:
            raise ValueError("input_ids must be provided if inputs_embeds is not provided.")
        if self.embed_tokens is None:
            if not input_ids.is_floating_point():
                raise ValueError(
                    "This pipeline stage has no embed_tokens, so it expects the previous stage's hidden states "
                    f"[B, S, H] in the input_ids slot, got an integer tensor of shape {tuple(input_ids.shape)}."
                )
            return input_ids
        if input_ids.is_floating_point():
            raise ValueError(
                f"input_ids must hold token ids, got a floating tensor of shape {tuple(input_ids.shape)}; pass "
                "embeddings as inputs_embeds."
            )
        return self.embed_tokens(input_ids)


class NemotronHForCausalLM(ExpertParallelHooks, nn.Module, GenerationMixin):
    """Nemotron-H causal LM with optional multi-token prediction.

    Args:
        config: transformers `NemotronHConfig`, a NVIDIA remote-code config, any attribute object or a dict.
        backend: kernel choices; default `default_backend()`. Never mutated.
        dtype: parameter dtype at construction (fp32-pinned tensors are fp32 regardless).
        device: construction device ("meta" defers allocation; then load a checkpoint with `assign=True`).
        num_nextn_predict_layers: overrides the config's MTP depth count (0 disables MTP).
        mtp_loss_scaling_factor: weight of the mean MTP depth loss.
        mtp_use_repeated_layer: one physical MTP depth applied at every depth.

    Raises:
        NotImplementedError: `tie_word_embeddings=True`.
        ValueError: invalid config or unsupported backend choices (all listed).
    """

    # The same list as the backbone's (one source: the keep list is defined once, on NemotronV3Model).
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = NemotronV3Model._keep_in_fp32_modules_strict
    _pp_keep_self_forward: ClassVar[bool] = True
    _pp_plan: ClassVar[dict[str, tuple[list[str], list[str]]]] = {
        "model.embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "model.layers": (["hidden_states"], ["hidden_states"]),
        "model.norm": (["hidden_states"], ["hidden_states"]),
        "lm_head": (["hidden_states"], ["logits"]),
    }
    _is_stateful: ClassVar[bool] = True
    main_input_name: ClassVar[str] = "input_ids"
    supports_gradient_checkpointing: ClassVar[bool] = True

    @classmethod
    def get_capabilities(cls, config: Any) -> dict[str, bool]:
        """Capabilities for am-capabilities: PP yes; EP when the config has MoE blocks (`apply_expert_parallel`);
        TP and CP not yet."""
        has_moe = NemotronConfig.from_any(config).has_moe
        return {"supports_pp": True, "supports_ep": has_moe, "supports_tp": False, "supports_cp": False}

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
        self.backend = backend if backend is not None else default_backend()
        self.model = NemotronV3Model(cfg, backend=self.backend, device=device, dtype=dtype)
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

    @property
    def num_mtp_depths(self) -> int:
        """MTP depths D from the config (also on pipeline stages whose `mtp` module was pruned)."""
        return self.mtp_config.num_layers if self.mtp_config.enabled else 0

    def get_input_embeddings(self) -> nn.Module | None:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def get_experts_implementation(self) -> dict[str, str]:
        """GenerationMixin hook: our experts have one implementation, nothing to switch while decoding."""
        return {}

    def set_experts_implementation(self, implementation: Any) -> None:
        """GenerationMixin hook (no-op, see `get_experts_implementation`)."""

    @torch.no_grad()
    def initialize_weights(self, *, dtype: torch.dtype | None = None) -> None:
        """Random init sampled in fp32 (then cast once to `dtype`, default the current dtype; pinned stay fp32)."""
        cfg = self.nemotron_config
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
        return self.model.gradient_checkpointing

    # ------------------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------------------

    def _is_pipeline_stage(self) -> bool:
        return (
            self.lm_head is None
            or self.model.embed_tokens is None
            or len(self.model.layers) != self.nemotron_config.num_hidden_layers
        )

    def _mtp_embeddings(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> list[torch.Tensor]:
        """Depth d's fusion input: the embedding of the ids rolled left d + 1 times (zero fill)."""
        depths = self.num_mtp_depths
        if input_ids is not None and not input_ids.is_floating_point():
            if self.model.embed_tokens is None:
                raise ValueError("MTP embeddings need embed_tokens, which this pipeline stage does not hold.")
            return [self.model.embed_tokens(roll_tensor(input_ids, -(d + 1), dim=-1)) for d in range(depths)]
        if inputs_embeds is None:
            raise ValueError("MTP needs token ids or inputs_embeds to build its per-depth inputs.")
        return [roll_tensor(inputs_embeds, -(d + 1), dim=1) for d in range(depths)]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *mtp_embed_inputs: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: NemotronHybridCache | None = None,
        use_cache: bool | None = None,
        seq_idx: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        compute_logits: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Causal LM forward.

        input_ids: [B, S] ids, or [B, S, H] hidden states on a non-first pipeline stage (then `mtp_embed_inputs`
        are the D per-depth embeddings [B, S, H] sent by the previous stage). attention_mask: [B, S] (1 keep, 0 pad)
        or [B, past + S] while generating. labels: [B, S] unshifted (the loss shifts by one). seq_idx: [B, S]
        document ids of packed rows (also accepted as `_packed_seq_ids`, 1-based with 0 = padding).

        Returns:
            Off the pipeline: `NemotronHCausalLMOutputWithPast`. Pipeline stages: the first / middle stage returns
            hidden [B, S, H] (and the D MTP embeddings when MTP is configured); the last stage returns logits
            [B, S, V] (and D MTP hidden states plus an int32 seq_idx [B, S] when MTP is configured).
        """
        packed_ids = kwargs.pop("_packed_seq_ids", None)
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions is not supported (SDPA does not return attention weights).")
        unknown = sorted(set(kwargs) - _IGNORED_KWARGS)
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward got unexpected keyword arguments {unknown}.")
        if packed_ids is not None:
            if seq_idx is None:
                seq_idx = packed_ids.to(torch.int32)
            if padding_mask is None:
                padding_mask = packed_ids == 0

        if self._is_pipeline_stage():
            return self._stage_forward(
                input_ids, mtp_embed_inputs, attention_mask=attention_mask, seq_idx=seq_idx, padding_mask=padding_mask
            )
        if mtp_embed_inputs:
            raise TypeError("Extra positional tensors (MTP embeddings) are only accepted by pruned pipeline stages.")

        cache = past_key_values
        if seq_idx is not None and (cache is not None or use_cache):
            raise ValueError(
                "seq_idx / _packed_seq_ids (packed rows) cannot be combined with a generation cache; generate each "
                "sequence in its own row with an attention_mask instead."
            )
        if use_cache and cache is None:
            reference = input_ids if input_ids is not None else inputs_embeds
            assert reference is not None
            cache = NemotronHybridCache(
                self.nemotron_config, reference.shape[0], dtype=self.dtype, device=reference.device
            )
        hidden_list: list[torch.Tensor] | None = [] if output_hidden_states else None
        hidden = self.model(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            padding_mask=padding_mask,
            seq_idx=seq_idx,
            cache=cache,
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
            kept = hidden if keep_all else _keep(hidden, logits_to_keep)
            logits = self.lm_head(kept)
        else:
            if labels is not None:
                raise ValueError("compute_logits=False cannot be combined with labels (the loss needs logits).")
            logits = hidden.new_empty(*hidden.shape[:-1], 0)

        loss = None
        if labels is not None:
            targets = shift_labels(labels, 1, seq_idx=seq_idx)
            loss = cross_entropy(logits, targets, ignore_index=-100)

        mtp_hidden: list[torch.Tensor] | None = None
        mtp_term = None
        mtp_active = self.mtp is not None and cache is None and (self.training or self.compute_mtp_in_eval)
        if mtp_active:
            assert self.mtp is not None
            embeds = self._mtp_embeddings(input_ids, inputs_embeds)
            block_inputs = self.model.block_inputs(
                hidden, attention_mask=attention_mask, padding_mask=padding_mask, seq_idx=seq_idx
            )
            mtp_hidden = self.mtp(hidden, embed_inputs=embeds, **block_inputs)
            if labels is not None:
                mtp_term = mtp_loss(
                    mtp_hidden,
                    labels=labels,
                    lm_head=self.lm_head,
                    scaling_factor=self.mtp_config.loss_scaling_factor,
                    seq_idx=seq_idx,
                )
                assert loss is not None
                loss = loss + mtp_term

        return NemotronHCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=cache if use_cache or past_key_values is not None else None,
            hidden_states=tuple(hidden_list) if hidden_list is not None else None,
            mtp_per_depth_h=tuple(mtp_hidden) if mtp_hidden is not None else None,
            mtp_loss=mtp_term,
            mtp_loss_scaling_factor=self.mtp_config.loss_scaling_factor if mtp_hidden is not None else None,
        )

    def _stage_forward(
        self,
        input_ids: torch.Tensor | None,
        mtp_embed_inputs: tuple[torch.Tensor, ...],
        *,
        attention_mask: torch.Tensor | None,
        seq_idx: torch.Tensor | None,
        padding_mask: torch.Tensor | None,
    ) -> Any:
        """Pipeline-stage contract (see `forward`). MTP depths travel and run whatever the train/eval mode, so a
        stage's output arity always equals `get_pipeline_stage_metas`."""
        depths = self.num_mtp_depths
        hidden = self.model(input_ids, attention_mask=attention_mask, padding_mask=padding_mask, seq_idx=seq_idx)
        if depths and self.model.embed_tokens is not None:
            assert input_ids is not None
            mtp_embed_inputs = tuple(self._mtp_embeddings(input_ids, None))
        if depths and len(mtp_embed_inputs) != depths:
            raise ValueError(
                f"This pipeline stage expects {depths} MTP embedding tensors after the hidden states, got "
                f"{len(mtp_embed_inputs)}."
            )
        if self.lm_head is None:
            return (hidden, *mtp_embed_inputs) if depths else hidden
        logits = self.lm_head(hidden)
        if not depths:
            return logits
        if self.mtp is None:
            raise ValueError("The last pipeline stage must hold the `mtp` module (customize_pipeline_stage_modules).")
        block_inputs = self.model.block_inputs(
            hidden, attention_mask=attention_mask, padding_mask=padding_mask, seq_idx=seq_idx
        )
        mtp_hidden = self.mtp(hidden, embed_inputs=mtp_embed_inputs, **block_inputs)
        if seq_idx is not None:
            tail = seq_idx.to(torch.int32)
        else:
            tail = torch.zeros(hidden.shape[:2], dtype=torch.int32, device=hidden.device)
        return (logits, *mtp_hidden, tail)

    # ------------------------------------------------------------------------------------------------------------
    # Pipeline hooks (duck-typed by am-pipelining)
    # ------------------------------------------------------------------------------------------------------------

    def customize_pipeline_stage_modules(
        self, module_names_per_stage: list[list[str]], *, layers_prefix: str = "model.", text_model: Any = None
    ) -> list[list[str]]:
        """Copy of the per-stage module names with `mtp` appended to the last stage when the model has MTP."""
        names = [list(stage) for stage in module_names_per_stage]
        if self.mtp is not None and names and "mtp" not in names[-1]:
            names[-1].append("mtp")
        return names

    def get_pipeline_stage_metas(
        self, *, is_first: bool, microbatch_size: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Meta tensors of this stage's inputs and outputs (arity 1 + D, last stage 1 + D + int32 seq_idx tail)."""
        cfg = self.nemotron_config
        depths = self.num_mtp_depths
        meta = torch.device("meta")

        def hidden() -> torch.Tensor:
            return torch.empty(microbatch_size, seq_len, cfg.hidden_size, dtype=dtype, device=meta, requires_grad=True)

        if is_first:
            inputs: tuple[torch.Tensor, ...] = (torch.empty(microbatch_size, seq_len, dtype=torch.long, device=meta),)
        else:
            inputs = (hidden(), *(hidden() for _ in range(depths)))
        if self.lm_head is None:
            outputs: tuple[torch.Tensor, ...] = (hidden(), *(hidden() for _ in range(depths)))
        else:
            logits = torch.empty(microbatch_size, seq_len, cfg.vocab_size, dtype=dtype, device=meta, requires_grad=True)
            outputs = (logits,)
            if depths:
                tail = torch.empty(microbatch_size, seq_len, dtype=torch.int32, device=meta)
                outputs = (logits, *(hidden() for _ in range(depths)), tail)
        return inputs, outputs

    def get_pipeline_kwargs_chunk_dims(self, kwargs: dict[str, Any]) -> dict[str, int]:
        """Per-sample tensors in `kwargs` are split into micro-batches along dim 0."""
        names = ("attention_mask", "seq_idx", "padding_mask", "_packed_seq_ids")
        return {name: 0 for name in names if isinstance(kwargs.get(name), torch.Tensor)}

    # ------------------------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------------------------

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        past_key_values: Any = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """First call: the whole prompt and a fresh `NemotronHybridCache` (replacing a transformers cache); later
        calls: only the last token."""
        if not isinstance(past_key_values, NemotronHybridCache):
            past_key_values = NemotronHybridCache(
                self.nemotron_config, input_ids.shape[0], dtype=self.dtype, device=input_ids.device
            )
        if past_key_values.has_previous_state:
            return {
                "input_ids": input_ids[:, -1:],
                "attention_mask": attention_mask,
                "past_key_values": past_key_values,
                "use_cache": True,
                "logits_to_keep": 1,
            }
        model_inputs: dict[str, Any] = {
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "use_cache": True,
            "logits_to_keep": 1,
        }
        if inputs_embeds is not None:
            model_inputs["inputs_embeds"] = inputs_embeds
        else:
            model_inputs["input_ids"] = input_ids
        return model_inputs

    def _reorder_cache(self, past_key_values: NemotronHybridCache, beam_idx: torch.LongTensor) -> NemotronHybridCache:
        past_key_values.reorder_cache(beam_idx)
        return past_key_values

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: Any,
        backend: BackendConfig | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **model_kwargs: Any,
    ) -> NemotronHForCausalLM:
        """Load an HF-format folder (config.json + safetensors, single or sharded). See `checkpoint.load_pretrained`."""
        from am_models_nemotron.checkpoint import load_pretrained

        return load_pretrained(cls, path, backend=backend, dtype=dtype, device=device, **model_kwargs)

    def save_pretrained(
        self, path: Any, *, max_shard_size: int | None = None, state_dict: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Write config.json + safetensors in NVIDIA's naming; `state_dict` (full tensors) replaces the model's own,
        e.g. the gathered experts of an expert-parallel model. See `checkpoint.save_pretrained`."""
        from am_models_nemotron.checkpoint import save_pretrained

        save_pretrained(self, path, max_shard_size=max_shard_size, state_dict=state_dict)


def _keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep]
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
    return hidden[:, -logits_to_keep:]


ModelClass = NemotronHForCausalLM
