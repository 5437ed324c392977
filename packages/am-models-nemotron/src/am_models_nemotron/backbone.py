"""`NemotronV3Model`: the Nemotron-H backbone — token embedding, the hybrid blocks, the final norm.

What it is for: running the blocks over [B, S, H] hidden states with one resolved `BatchLayout` (documents,
padding, masks) so every block gets exactly the inputs it reads, optionally collecting the hidden states in
transformers' convention, with activation checkpointing. Any of `embed_tokens`, `layers`, `norm` may be None or
partial on a pipeline stage.
What it must not do: own the LM head, the loss or MTP (`model.NemotronHForCausalLM`), or take a layout from anywhere
but `resolve_batch_layout` (one rule for packing and masks).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from am_moe import LoadBalancing
from am_precision import BackendConfig, initialize_rms_norm_module

from ._init import reset_linear_
from .backend import resolve_backend
from .blocks import NemotronBlock
from .config import NemotronConfig
from .cp import block_cp_problems, resolve_layout
from .inputs import BatchLayout, pop_layout_kwargs
from .tp_plan import BACKBONE_TP_PLAN

__all__ = ["NemotronV3Model", "move_buffers_"]


@torch.no_grad()
def move_buffers_(module: nn.Module, device: torch.device | str) -> None:
    """Put every buffer of `module` on `device` (a meta buffer is allocated there, uninitialized)."""
    for sub in module.modules():
        for name, buffer in list(sub._buffers.items()):
            if buffer is None:
                continue
            moved = torch.empty_like(buffer, device=device) if buffer.is_meta else buffer.to(device)
            sub._buffers[name] = moved


class NemotronV3Model(nn.Module):
    """Backbone: `embed_tokens`, `layers` (ModuleDict keyed by global index), final `norm`.

    Args:
        config: transformers `NemotronHConfig`, an NVIDIA config, any attribute object, a dict or a `NemotronConfig`.
        backend: kernel choices, resolved by `resolve_backend` (None: `default_backend()`). Never mutated.
        device / dtype: construction device and parameter dtype (fp32-pinned tensors stay fp32).
    """

    # The fp32-pinned tensors, listed once for the package: the router's `e_score_correction_bias` and each Mamba
    # mixer's `_fp32_params` holder (A_log, dt_bias, D). Casting (am-precision), checkpoints and the state dict
    # adapter all derive from it.
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["e_score_correction_bias", "_fp32_params"]
    # The real model's balancing recipe (Megatron-Bridge's NemotronH provider: expert bias, update rate 1e-3, and
    # the sequence-level aux loss, coefficient 1e-4; router in fp32). Declared, not applied: the layers start with
    # balancing off (forward and gradients are transformers'); a trainer applies it with
    # `am_moe.configure_load_balancing(model, type(model).moe_load_balancing)`.
    moe_load_balancing: ClassVar[LoadBalancing] = LoadBalancing(bias_update_rate=1e-3, seq_aux_loss_coeff=1e-4)

    _tp_plan: ClassVar[Any] = BACKBONE_TP_PLAN  # am-tensor-parallel (tp_plan.py; each mixer class declares its own)

    def __init__(
        self,
        config: Any,
        backend: BackendConfig | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        cfg = NemotronConfig.from_any(config)
        self.config = cfg
        self.backend = resolve_backend(backend, owner=type(self).__name__)
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleDict(
            {
                str(i): NemotronBlock(cfg, i, backend=self.backend, device=device, dtype=dtype)
                for i in range(cfg.num_hidden_layers)
            }
        )
        self.norm: nn.Module | None = initialize_rms_norm_module(
            self.backend.rms_norm, cfg.hidden_size, eps=cfg.layer_norm_epsilon, device=device, dtype=dtype
        )
        self.gradient_checkpointing = False

    @torch.no_grad()
    def initialize_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Embedding normal(0, initializer_range), norms ones, every block's own init (present modules only).

        buffer_device: where the buffers (the routers' `e_score_correction_bias`) are (re)created before their init,
        e.g. the device a meta-built model was `to_empty`-ed onto. None keeps them where they are.
        """
        cfg = self.config
        if buffer_device is not None:
            move_buffers_(self, buffer_device)
        if self.embed_tokens is not None:
            nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=cfg.initializer_range)
        reset_linear_(self.norm)
        for layer in self.layers.values():
            layer.init_weights(  # type: ignore[operator]
                num_hidden_layers=cfg.num_hidden_layers, rescale_prenorm_residual=cfg.rescale_prenorm_residual
            )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        causal_mask_mapping: dict[str, Any] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: Any = None,
        cache_position: torch.Tensor | None = None,
        layout: BatchLayout | None = None,
        all_hidden_states: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Hidden states [B, S, H] after the final norm (before it on stages without `norm`).

        input_ids: [B, S] token ids, or [B, S, H] hidden states on a non-first pipeline stage. attention_mask: [B,
        past + S] 1/0, or a 4-D mask; causal_mask_mapping: {"full_attention": 4-D mask, "linear_attention": [B, S]}.
        kwargs: the packing inputs of `inputs.LAYOUT_KWARGS` (seq_idx, _packed_seq_ids, position_ids, padding_mask,
        qkv_format, cu_seqlens, cu_seqlens_padded, max_seqlen...), resolved by `resolve_batch_layout`; or pass an
        already resolved `layout`. Inside an entered `RingAttentionContext` (contiguous layout) the blocks run
        context-parallel (`cp`). all_hidden_states: a list to append the block inputs and the final state to.

        Raises:
            TypeError: unknown keyword arguments. ValueError: see `resolve_batch_layout`; a `cache_position` that is
            not the cache's next positions.
        """
        layout_kwargs = pop_layout_kwargs(kwargs)
        if kwargs:
            raise TypeError(f"{type(self).__name__}.forward got unexpected keyword arguments {sorted(kwargs)}.")
        hidden = self.embed(input_ids, inputs_embeds)
        batch, seqlen = hidden.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if cache_position is not None:
            expected = torch.arange(past, past + seqlen, device=cache_position.device)
            if cache_position.reshape(-1).shape != expected.shape or not torch.equal(
                cache_position.reshape(-1), expected
            ):
                raise ValueError(
                    f"cache_position={cache_position.tolist()} must be the cache's next positions {expected.tolist()} "
                    "(the Mamba states only continue the cached sequence)."
                )
        if layout is None:
            layout = resolve_layout(
                owner=type(self).__name__,
                batch=batch,
                seqlen=seqlen,
                device=hidden.device,
                past_length=past,
                attention_mask=attention_mask,
                causal_mask_mapping=causal_mask_mapping,
                **layout_kwargs,
                cp_problems=lambda _cp: block_cp_problems(self.layers.values(), seqlen=seqlen, training=self.training),
            )
        elif layout_kwargs or attention_mask is not None or causal_mask_mapping is not None:
            raise TypeError("pass either a resolved layout or the raw masks / packing inputs, not both.")
        inputs = layout.block_inputs(hidden, past_length=past, cache=past_key_values)
        checkpointing = self.gradient_checkpointing and self.training and past_key_values is None
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
        """[B, S, H]: `inputs_embeds`, the embedding of `input_ids`, or the hidden states a pipeline stage received."""
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
