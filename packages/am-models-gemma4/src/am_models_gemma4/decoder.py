"""One Gemma 4 decoder layer: attention, dense GeGLU MLP, optional MoE block, per-layer input, `layer_scalar`.

What it is for: the residual wiring of transformers' `Gemma4TextDecoderLayer` (same parameter and buffer names
except the MoE block, which lives under `moe.` — see `moe.py`), callable both from our text model (with
`attention_inputs`) and from a pipeline stage forward that passes transformers' masks:
`layer(hidden, per_layer_input, shared_kv_states=..., position_embeddings=..., attention_mask=..., position_ids=...,
padding_mask=...)`. Padding never reaches the experts: the MoE block reads `padding_mask` (True = pad) — given by the
text model, or by a pipeline stage forward — and, when a stage passes none under context parallelism, the entered
ring context's document ids (0 = padding), the same rule the text model applies.
While generating, the text model passes its `Gemma4HybridCache` as `past_key_values` (with `attention_inputs`).
What it must not do: accept another kind of cache (transformers' `DynamicCache` lays out K/V differently).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextMLP

from am_precision import BackendConfig

from .attention import Gemma4Attention
from .backend import resolve_backend
from .cache import Gemma4HybridCache
from .cp import active_ring_context
from .layers import make_linear, make_norm
from .masks import AttentionInputs
from .moe import Gemma4MoE

__all__ = ["Gemma4DecoderLayer"]


def _moe_padding_mask(
    padding_mask: torch.Tensor | None, hidden_states: torch.Tensor, attention_inputs: AttentionInputs | None
) -> torch.Tensor | None:
    """The `[B, S]` padding mask (True = pad) the MoE block must honour: the given one; else, for a layer called
    without `attention_inputs` (a pipeline stage) inside an entered CP ring context, the ring's document ids == 0;
    else None (no padding)."""
    if padding_mask is not None or attention_inputs is not None:
        return padding_mask
    ring = active_ring_context()
    doc_ids = None if ring is None else ring.doc_ids
    if doc_ids is None:
        return None
    tokens = tuple(hidden_states.shape[:2])
    pads = (doc_ids == 0).reshape(-1, doc_ids.shape[-1])
    if pads.shape[-1] != tokens[1] or pads.shape[0] not in (1, tokens[0]):
        raise ValueError(
            f"the entered CP ring context has document ids of shape {tuple(doc_ids.shape)} but this layer runs "
            f"{tokens} [B, S_local] tokens: enter the context of exactly this micro-batch, or pass padding_mask"
        )
    return pads.expand(tokens)


class Gemma4DecoderLayer(nn.Module):
    """`x += post_attn_norm(attn(input_norm(x)))`; `x += post_ff_norm(mlp(pre_ff_norm(x)) [+ MoE])`; `x *= scalar`.

    With the MoE block the feed-forward output is `post_ff_norm_1(mlp(...)) + post_ff_norm_2(moe(pre_ff_norm_2(x),
    router_input=x))` — the router sees the un-normalized residual. With per-layer inputs (PLE, E-series) a gated
    projection of `per_layer_input` `[B, S, H_ple]` is added before the scalar.
    """

    def __init__(self, config: Any, layer_idx: int, *, backend: BackendConfig | None = None) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx]
        backend = resolve_backend(backend, owner=type(self).__name__)
        self.self_attn = Gemma4Attention(config, layer_idx, backend=backend)
        self.mlp = Gemma4TextMLP(config, layer_idx)
        if backend is not None and backend.linear != "torch":  # the same names, built by the backend
            for name in ("gate_proj", "up_proj", "down_proj"):
                proj = getattr(self.mlp, name)
                setattr(self.mlp, name, make_linear(proj.in_features, proj.out_features, bias=False, backend=backend))
        self.input_layernorm = make_norm(hidden, eps=eps, backend=backend)
        self.post_attention_layernorm = make_norm(hidden, eps=eps, backend=backend)
        self.pre_feedforward_layernorm = make_norm(hidden, eps=eps, backend=backend)
        self.post_feedforward_layernorm = make_norm(hidden, eps=eps, backend=backend)
        self.layer_scalar: torch.Tensor
        self.register_buffer("layer_scalar", torch.ones(1))
        # te_fp8: the layer's Transformer Engine modules compute in FP8 inside this recipe's autocast.
        self.te_fp8 = backend.te_fp8 if backend is not None else None

        self.hidden_size_per_layer_input = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.hidden_size_per_layer_input:
            self.act_fn = ACT2FN[config.hidden_activation]
            ple = self.hidden_size_per_layer_input
            self.per_layer_input_gate = make_linear(hidden, ple, bias=False, backend=backend)
            self.per_layer_projection = make_linear(ple, hidden, bias=False, backend=backend)
            self.post_per_layer_input_norm = make_norm(hidden, eps=eps, backend=backend)

        self.enable_moe_block = bool(getattr(config, "enable_moe_block", False))
        if self.enable_moe_block:
            self.moe = Gemma4MoE(config, backend=backend)
            self.post_feedforward_layernorm_1 = make_norm(hidden, eps=eps, backend=backend)
            self.post_feedforward_layernorm_2 = make_norm(hidden, eps=eps, backend=backend)
            self.pre_feedforward_layernorm_2 = make_norm(hidden, eps=eps, backend=backend)

    def forward(
        self,
        hidden_states: torch.Tensor,
        per_layer_input: torch.Tensor | None = None,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        shared_kv_states: Any = None,
        attention_mask: torch.Tensor | None = None,
        attention_inputs: AttentionInputs | None = None,
        padding_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """hidden_states `[B, S, H]` → `[B, S, H]`; padding_mask `[B, S]` (True = pad) keeps pads out of the MoE.

        past_key_values: None (training), or the text model's `Gemma4HybridCache` while generating. With
        `backend.te_fp8` the layer runs inside `te_fp8.maybe_te_autocast()`.
        """
        del position_ids, kwargs  # positions arrive as position_embeddings; extra HF kwargs are not needed
        if past_key_values is not None and not isinstance(past_key_values, Gemma4HybridCache):
            raise TypeError(
                f"past_key_values is a {type(past_key_values).__name__}; am_models_gemma4 layers read and write only "
                "a Gemma4HybridCache (pass None for training, or generate through Gemma4ForCausalLM)"
            )
        fp8 = self.te_fp8.maybe_te_autocast() if self.te_fp8 is not None else contextlib.nullcontext()
        with fp8:
            residual = hidden_states
            hidden_states = self.self_attn(
                self.input_layernorm(hidden_states),
                position_embeddings,
                attention_mask=attention_mask,
                shared_kv_states=shared_kv_states,
                attention_inputs=attention_inputs,
                cache=past_key_values,
            )
            hidden_states = residual + self.post_attention_layernorm(hidden_states)

            residual = hidden_states
            feed_forward = self.mlp(self.pre_feedforward_layernorm(hidden_states))
            if self.enable_moe_block:
                experts = self.moe(
                    self.pre_feedforward_layernorm_2(residual),
                    router_input=residual,
                    padding_mask=_moe_padding_mask(padding_mask, residual, attention_inputs),
                )
                feed_forward = self.post_feedforward_layernorm_1(feed_forward) + self.post_feedforward_layernorm_2(
                    experts
                )
            hidden_states = residual + self.post_feedforward_layernorm(feed_forward)

            if self.hidden_size_per_layer_input:
                if per_layer_input is None:
                    raise ValueError(
                        f"layer {self.layer_idx} has per-layer inputs (hidden_size_per_layer_input="
                        f"{self.hidden_size_per_layer_input}) but per_layer_input is None; call it through the text "
                        "model"
                    )
                residual = hidden_states
                gated = self.act_fn(self.per_layer_input_gate(hidden_states)) * per_layer_input
                hidden_states = residual + self.post_per_layer_input_norm(self.per_layer_projection(gated))
            return hidden_states * self.layer_scalar
