"""Gemma 4 text decoder (`Gemma4TextModel`) and causal LM (`Gemma4ForCausalLM`), dense or MoE.

What it is for: the text stack of transformers' Gemma 4 — scaled embeddings, per-layer inputs (PLE), per-layer-type
RoPE (`Gemma4TextRotaryEmbedding`, proportional on full layers), mixed sliding/full layers keyed by their global
index in a `ModuleDict` (so pipeline stages keep stable names), final norm, tied LM head with logit soft-capping —
with the MoE path and the attention paths of this package (`moe.py`, `attention.py`).
Generation: `Gemma4ForCausalLM.generate(...)` (transformers' `GenerationMixin`, see `generation.py`) runs a prefill
and then one token per step through a `Gemma4HybridCache` (`cache.py`).
What it must not do: import am-pipelining or am-capabilities (it declares what they read: `config.layer_types`,
`rotary_emb(x, position_ids, layer_type)`, `layers["<i>"]`, `get_capabilities`, `am_contract`),
or create a KV cache unless asked (`use_cache=True` or a cache passed): training forwards pass none.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

from am_precision import BackendConfig

from .attention import SharedKVStates
from .backend import resolve_backend
from .cache import Gemma4HybridCache
from .config import validate_text_config
from .cp import active_ring_context
from .decoder import Gemma4DecoderLayer
from .layers import Gemma4RotaryEmbedding, is_backend_linear, is_backend_norm, make_linear, make_norm
from .masks import AttentionInputs
from .moe import Gemma4Experts, Gemma4Router
from .pretrained import Gemma4PreTrainedModel
from .tp_plan import CAUSAL_LM_TP_PLAN, TEXT_MODEL_TP_PLAN, tensor_parallel_problems

__all__ = ["Gemma4ForCausalLM", "Gemma4TextModel", "init_module_weights"]


@torch.no_grad()
def init_module_weights(module: nn.Module, *, std: float) -> None:
    """The init of one module's own tensors (not its children's), by type: transformers' Gemma 4 rules — normal(0,
    std) linear and embedding weights (zero bias, zero padding row), ones for norm weights and router scales, 1.0
    for a layer's scalar. `Gemma4TextModel.init_weights` applies it to every module; `sharded.init_units` per unit."""
    if is_backend_linear(module):
        nn.init.normal_(_tensor(module, "weight"), std=std)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.numel():
            nn.init.zeros_(bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=std)
        if module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    elif is_backend_norm(module):
        nn.init.ones_(_tensor(module, "weight"))
    elif isinstance(module, Gemma4Router):
        nn.init.ones_(module.scale)
        nn.init.ones_(module.per_expert_scale)
    elif isinstance(module, Gemma4Experts):
        nn.init.normal_(module.gate_up_proj, std=std)
        nn.init.normal_(module.down_proj, std=std)
    elif isinstance(module, Gemma4DecoderLayer):
        module.layer_scalar.fill_(1.0)


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    """`module.<name>` as a tensor (torch, TE and QuACK modules all hold their weights as parameters)."""
    value = getattr(module, name)
    assert isinstance(value, torch.Tensor), f"{type(module).__name__}.{name} is not a tensor"
    return value


_IGNORED_KWARGS = frozenset({"return_dict", "output_attentions", "cache_position", "num_items_in_batch"})


def reject_unknown_kwargs(kwargs: dict[str, Any], where: str) -> None:
    """Refuse keywords a forward does not read (transformers' `return_dict`, ... are accepted and have no effect)."""
    unknown = sorted(k for k in kwargs if k not in _IGNORED_KWARGS)
    if unknown:
        raise TypeError(f"{where} got unexpected keyword arguments {unknown}")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(f"{where}: output_attentions=True is not supported")


def _generation_cache(config: Any, past_key_values: Any, use_cache: bool | None) -> Gemma4HybridCache | None:
    """The cache of this forward: the one passed, a new one for `use_cache=True`, else None (training)."""
    if past_key_values is None:
        return Gemma4HybridCache(config) if use_cache else None
    if not isinstance(past_key_values, Gemma4HybridCache):
        raise TypeError(
            f"past_key_values is a {type(past_key_values).__name__}; am_models_gemma4 generates with a "
            "Gemma4HybridCache (pass use_cache=True to get one, or Gemma4HybridCache(model.config))"
        )
    return past_key_values


def _check_cached_inputs(attention_mask: Any, *, ring: Any, packed: bool) -> None:
    """Refuse, listing every problem, the inputs a cached (generation) forward cannot honour."""
    problems = []
    if ring is not None:
        problems.append("a context-parallel ring context is entered: generate with cp=1, outside `with ctx():`")
    if packed:
        problems.append(
            "_packed_seq_ids (packed documents) were given: generate each sequence in its own row with an "
            "attention_mask"
        )
    if isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() != 2):
        problems.append(
            "attention_mask is a 4-D mask or a {layer_type: mask} mapping: pass the 2-D [B, past + S] mask "
            "(1 = token, 0 = padding); the cached steps build their own masks"
        )
    if problems:
        raise ValueError("these inputs cannot be combined with a KV cache:\n  - " + "\n  - ".join(problems))


class Gemma4TextModel(nn.Module):
    """The decoder stack: input_ids `[B, S]` → last hidden state `[B, S, H]`.

    Attention masks: `attention_mask` `[B, S]` (1 = token, 0 = padding) or `padding_mask` (True = padding), and/or
    `_packed_seq_ids` `[B, S]` (document ids, 0 = padding) for packed sequences; a 4-D mask is passed to every
    layer as is. `vision_group_ids` `[B, S]` (-1 = text) makes image tokens attend to each other on sliding layers
    (`use_bidirectional_attention="vision"`). Under CP (an entered context from `make_cp_batch_and_ctx(..., model=)`,
    contiguous shards) every layer runs the ring instead.

    Generation: with `use_cache=True` or a `Gemma4HybridCache` in `past_key_values`, the K/V of this forward are
    appended to the cache and the new tokens attend to the cached ones; `attention_mask` then covers the cached and
    new tokens `[B, past + S]` (or the new ones `[B, S]`), and positions default to `past .. past + S - 1`.
    """

    _tp_plan: ClassVar[Any] = TEXT_MODEL_TP_PLAN  # am-tensor-parallel reads it like transformers' `_tp_plan`
    tensor_parallel_problems = tensor_parallel_problems  # and calls this before any collective (tp_plan.py)

    def __init__(self, config: Any, *, backend: BackendConfig | None = None) -> None:
        super().__init__()
        validate_text_config(config)
        backend = resolve_backend(backend, owner=type(self).__name__)
        self.backend = backend
        if getattr(config, "_attn_implementation", None) is None:
            # Pipeline stages build transformers' masks from this config; "sdpa" gives 4-D boolean masks, which our
            # layers read (None would make transformers skip padding masks).
            config._attn_implementation = "sdpa"
        self.config = config
        hidden = int(config.hidden_size)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = Gemma4TextScaledWordEmbedding(
            config.vocab_size, hidden, self.padding_idx, embed_scale=hidden**0.5
        )
        self.layers = nn.ModuleDict(
            {
                str(index): Gemma4DecoderLayer(config, index, backend=backend)
                for index in range(config.num_hidden_layers)
            }
        )
        self.norm = make_norm(hidden, eps=config.rms_norm_eps, backend=backend)
        self.rotary_emb = Gemma4RotaryEmbedding(config, fused=bool(backend is not None and backend.rope_fusion))
        self.hidden_size_per_layer_input = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.hidden_size_per_layer_input:
            ple = config.num_hidden_layers * self.hidden_size_per_layer_input
            self.embed_tokens_per_layer = Gemma4TextScaledWordEmbedding(
                config.vocab_size_per_layer_input,
                ple,
                self.padding_idx,
                embed_scale=self.hidden_size_per_layer_input**0.5,
            )
            self.per_layer_input_scale = 2.0**-0.5
            self.per_layer_model_projection = make_linear(hidden, ple, bias=False, backend=backend)
            self.per_layer_model_projection_scale = hidden**-0.5
            self.per_layer_projection_norm = make_norm(
                self.hidden_size_per_layer_input, eps=config.rms_norm_eps, backend=backend
            )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' initialization: normal(0, initializer_range) weights, ones for norms and scales."""
        std = float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            init_module_weights(module, std=std)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_per_layer_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token-identity part of PLE: `[B, S]` → `[B, S, L, H_ple]`."""
        return self.embed_tokens_per_layer(input_ids).reshape(
            *input_ids.shape, self.config.num_hidden_layers, self.hidden_size_per_layer_input
        )

    def project_per_layer_inputs(self, inputs_embeds: torch.Tensor, per_layer_inputs: torch.Tensor) -> torch.Tensor:
        """Context part of PLE combined with the token part: `(norm(proj(x)/sqrt(H)) + ple) / sqrt(2)`."""
        projection = self.per_layer_model_projection(inputs_embeds) * self.per_layer_model_projection_scale
        projection = projection.reshape(
            *inputs_embeds.shape[:-1], self.config.num_hidden_layers, self.hidden_size_per_layer_input
        )
        return (self.per_layer_projection_norm(projection) + per_layer_inputs) * self.per_layer_input_scale

    def pipeline_default_position_ids(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """am-pipelining's hook for a stage that receives hidden states `[B, S_local, H]` only: under context
        parallelism the entered ring context's global positions of this rank's tokens (`[1, S_local]` int64), so the
        rotary embeddings of every stage match the unsharded model's; None otherwise (positions 0 .. S - 1)."""
        ring = active_ring_context()
        return None if ring is None else ring.positions.view(1, -1).to(hidden_states.device)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | dict[str, torch.Tensor | None] | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        per_layer_inputs: torch.Tensor | None = None,
        use_cache: bool | None = None,
        *,
        padding_mask: torch.Tensor | None = None,
        _packed_seq_ids: torch.Tensor | None = None,
        vision_group_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """input_ids `[B, S]` (or inputs_embeds `[B, S, H]`) → `last_hidden_state` `[B, S, H]` (and the cache, when
        generating, as `past_key_values`)."""
        reject_unknown_kwargs(kwargs, "Gemma4TextModel.forward")
        cache = _generation_cache(self.config, past_key_values, use_cache)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.embed_tokens(input_ids)
        if self.hidden_size_per_layer_input:
            if per_layer_inputs is None:
                if input_ids is None:
                    raise ValueError("per-layer inputs (PLE) need input_ids or precomputed per_layer_inputs")
                per_layer_inputs = self.get_per_layer_inputs(input_ids)
            per_layer_inputs = self.project_per_layer_inputs(inputs_embeds, per_layer_inputs)
        position_ids, attention_inputs, external_mask, padding_mask = self._positions_and_masks(
            inputs_embeds, attention_mask, position_ids, padding_mask, _packed_seq_ids, vision_group_ids, cache
        )

        position_embeddings = {
            layer_type: self.rotary_emb(inputs_embeds, position_ids, layer_type)
            for layer_type in sorted(set(self.config.layer_types))
        }
        shared_kv_states = SharedKVStates()  # KV-shared layers read what their store layer publishes here
        hidden_states = inputs_embeds
        for key, layer in self.layers.items():
            layer_type = self.config.layer_types[int(key)]
            hidden_states = layer(
                hidden_states,
                per_layer_inputs[:, :, int(key), :] if per_layer_inputs is not None else None,
                position_embeddings=position_embeddings[layer_type],
                shared_kv_states=shared_kv_states,
                attention_mask=external_mask.get(layer_type) if isinstance(external_mask, dict) else external_mask,
                attention_inputs=attention_inputs,
                padding_mask=padding_mask,
                past_key_values=cache,
            )
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        # `past_key_values` is our Gemma4HybridCache, not a transformers `Cache`
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=cache)  # type: ignore[arg-type]

    def _positions_and_masks(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: Any,
        position_ids: torch.Tensor | None,
        padding_mask: torch.Tensor | None,
        packed_seq_ids: torch.Tensor | None,
        vision_group_ids: torch.Tensor | None,
        cache: Gemma4HybridCache | None,
    ) -> tuple[torch.Tensor, AttentionInputs | None, Any, torch.Tensor | None]:
        """Every way a caller describes positions and masks, normalized once per forward.

        Returns `(position_ids [B or 1, S], attention_inputs, external_mask, padding_mask [B, S] True = pad)`:
        `attention_inputs` for our masks (documents from `_packed_seq_ids`, else from the 2-D `attention_mask` /
        `padding_mask`; under CP the ring context's global positions and document ids; while generating the
        cache's past length), or None with `external_mask`, a 4-D mask or transformers' `{layer_type: mask}`
        mapping handed to the layers as is (pipeline stages).
        """
        seq, device = inputs_embeds.shape[1], inputs_embeds.device
        ring = active_ring_context()
        if cache is not None:
            _check_cached_inputs(attention_mask, ring=ring, packed=packed_seq_ids is not None)
            past = cache.get_seq_length()
            if attention_mask is None and padding_mask is not None:
                attention_mask = ~padding_mask.bool()
            real = cache.step_mask(attention_mask, seq)  # [B, past + S] True = token, or None: nothing padded
            if position_ids is None:
                position_ids = torch.arange(past, past + seq, device=device).unsqueeze(0)
            doc_ids = None if real is None else real.long()
            inputs = AttentionInputs(
                seq_len=seq, device=device, doc_ids=doc_ids, vision_group_ids=vision_group_ids, past_length=past
            )
            return position_ids, inputs, None, None if real is None else ~real[:, -seq:]

        external_mask = None
        if isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() == 4):
            external_mask = attention_mask
        elif attention_mask is not None and padding_mask is None:
            padding_mask = ~attention_mask.bool()
        if ring is not None:
            if vision_group_ids is not None:
                raise NotImplementedError(
                    "bidirectional attention among image tokens (use_bidirectional_attention='vision') is not "
                    "supported under context parallelism; train this variant with cp=1"
                )
            doc_ids = ring.doc_ids
            if position_ids is None:
                position_ids = ring.positions.view(1, -1)
        else:
            doc_ids = packed_seq_ids
            if doc_ids is None and padding_mask is not None:
                doc_ids = (~padding_mask.bool()).long()
        if doc_ids is not None:
            padding_mask = doc_ids == 0
        if position_ids is None:
            position_ids = torch.arange(seq, device=device).unsqueeze(0)
        if external_mask is not None:
            return position_ids, None, external_mask, padding_mask
        attention = AttentionInputs(
            seq_len=seq, device=device, doc_ids=doc_ids, vision_group_ids=vision_group_ids, ring=ring
        )
        return position_ids, attention, None, padding_mask


class Gemma4ForCausalLM(Gemma4PreTrainedModel):
    """Text-only Gemma 4 with a (tied) LM head: `logits = softcap(lm_head(model(...)))` `[B, S, V]`.

    Checkpoints: `from_pretrained` / `save_pretrained` read and write transformers' `Gemma4ForCausalLM` folders.
    Generation: `generate(...)` (transformers' `GenerationMixin`) with a `Gemma4HybridCache`.
    """

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan: ClassVar[Any] = CAUSAL_LM_TP_PLAN

    def __init__(self, config: Any, *, backend: BackendConfig | None = None) -> None:
        super().__init__()
        if getattr(config, "text_config", None) is not None:
            raise ValueError(
                f"Gemma4ForCausalLM needs a text config (Gemma4TextConfig); got {type(config).__name__} with a "
                "text_config, a vision-language checkpoint: use Gemma4ForConditionalGeneration"
            )
        self.config = config
        self.model = Gemma4TextModel(config, backend=backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self._init_generation_config(config)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        per_layer_inputs: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits `[B, S, V]` (fp32 soft-capped when configured) and, with labels, the loss.

        Without CP, labels are unshifted (transformers' convention: shifted inside). Under CP (inside the context
        of `make_cp_batch_and_ctx`) labels are ALREADY shifted, as the CP batch contract requires, and `loss` is
        this rank's share of the global token mean (`cp_token_mean_loss`); sum gradients over the CP group.
        With `use_cache=True` or a `Gemma4HybridCache` in `past_key_values` the output carries the cache.
        """
        outputs = self.model(
            input_ids,
            attention_mask,
            position_ids,
            past_key_values,
            inputs_embeds,
            per_layer_inputs,
            use_cache,
            **kwargs,
        )
        logits, loss = self.logits_and_loss(outputs.last_hidden_state, labels, logits_to_keep=logits_to_keep)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)
