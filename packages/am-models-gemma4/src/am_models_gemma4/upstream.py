"""NeMo AutoModel's Gemma 4 MoE names and calling conventions, over this package's own classes.

What it is for: code written against `nemo_automodel.components.models.gemma4_moe` keeps working —
`Gemma4MoEDecoderLayer(config, layer_idx, moe_config=None, backend=None)`, `Gemma4Gate(text_config,
enable_routing_replay=False)` returning `(weights, indices, aux_loss)`, `Gemma4MoEStateDictAdapter(config,
moe_config=None, backend=None, dtype=torch.float32)` with `from_hf` / `to_hf`, `Gemma4MoETextModelBackend(config,
backend=None, *, moe_config=None, moe_overrides=None)` and upstream's CP entry point `prepare_model_inputs_for_cp`.
Every name here is a thin layer over `decoder`, `moe`, `model`, `state_dict_adapter` and am-context-parallel.
What it must not do: hold a second implementation of anything (layers, routing, renaming, sharding), accept an
option and ignore it (upstream's MoE settings are checked against the config by `config.check_moe_config` and
refused when they disagree), or be imported by the core modules (this is a layer over them, not part of them).

Deliberate differences (README "Coming from NeMo AutoModel"): the per-expert scale stays in the router (transformers'
layout) instead of being folded into the experts' down projections; there is no `MoEConfig` (the MoE is built from the
text config); `prepare_model_inputs_for_cp` is a function of the model, not a method.
"""

from __future__ import annotations

import logging
import re
from typing import Any, NamedTuple

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask

from am_context_parallel import ContiguousLayout
from am_context_parallel.mesh import cp_rank
from am_context_parallel.upstream import make_contiguous_shard_cp_batch_and_ctx
from am_precision import fp32_keep_rules, match_keep_rule

from .config import check_moe_config, text_config_of
from .cp import active_ring_context
from .decoder import Gemma4DecoderLayer
from .model import Gemma4ForCausalLM, Gemma4TextModel
from .moe import Gemma4Router
from .state_dict_adapter import Gemma4StateDictAdapter

__all__ = [
    "Gemma4ContiguousSharder",
    "Gemma4Gate",
    "Gemma4MoEDecoderLayer",
    "Gemma4MoEStateDictAdapter",
    "Gemma4MoETextModelBackend",
    "ShardLayout",
    "prepare_model_inputs_for_cp",
]

_logger = logging.getLogger(__name__)


class Gemma4MoEDecoderLayer(Gemma4DecoderLayer):
    """Upstream's MoE decoder layer: our `Gemma4DecoderLayer` (same parameters, same forward) built from
    `(config, layer_idx, moe_config=None, backend=None)`.

    Raises:
        ValueError: the config is dense, or `moe_config` disagrees with it (every field named).
    """

    def __init__(self, config: Any, layer_idx: int, moe_config: Any = None, backend: Any = None) -> None:
        check_moe_config(config, moe_config)
        super().__init__(config, layer_idx, backend=backend)


class Gemma4Gate(Gemma4Router):
    """Upstream's gate calling convention over our router: `gate(x [T, H], token_mask=None, cp_mesh=None)` →
    `(weights [T, K] in x.dtype, indices [T, K] int64, None)`.

    Where the per-expert scale goes: upstream folds `per_expert_scale` into the experts' down projections when
    loading, so its gate weights are the renormalized top-k probabilities. Here (transformers' layout) the scale
    stays a router parameter and is multiplied into the returned weights: the experts are linear in their weight, so
    `experts(x, indices, weights · s)` with unscaled down projections equals upstream's `experts(x, indices, weights)`
    with `down · s`. The returned weights are exactly `Gemma4Router.forward`'s (cast to x.dtype, as upstream).
    Parameters and state-dict keys are the router's (`proj.weight`, `scale`, `per_expert_scale`).

    token_mask / cp_mesh: upstream reads them only for the auxiliary loss, which Gemma 4 does not have
    (`aux_loss_coeff=0`), so they do not change routing (per token) here either; padding tokens are kept out by the
    experts (`Gemma4MoE` passes the mask to them). The mask's shape is checked.

    Raises:
        ValueError: the config is dense (no `enable_moe_block`).
        NotImplementedError: `enable_routing_replay=True`.
    """

    def __init__(self, text_config: Any, enable_routing_replay: bool = False) -> None:
        if enable_routing_replay:
            raise NotImplementedError(
                "Gemma4Gate(enable_routing_replay=True): routing replay is not implemented in am_models_gemma4; "
                "pass enable_routing_replay=False"
            )
        check_moe_config(text_config)
        super().__init__(text_config_of(text_config))

    def forward(  # type: ignore[override]  # upstream's gate returns a third (aux loss) element
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None, cp_mesh: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        del cp_mesh  # no auxiliary loss to reduce over the CP group
        if token_mask is not None and token_mask.shape != x.shape[:-1]:
            raise ValueError(f"token_mask has shape {tuple(token_mask.shape)}; expected {tuple(x.shape[:-1])}")
        weights, indices = super().forward(x)
        return weights.to(x.dtype), indices, None


class Gemma4MoEStateDictAdapter:
    """Upstream's `(config, moe_config=None, backend=None, dtype=torch.float32)` over `Gemma4StateDictAdapter`.

    `from_hf` gives our names with transformers' tensors and layouts (the per-expert scale is NOT folded into the
    down projections: our checkpoints are transformers' checkpoints, so `to_hf` writes back the scale a checkpoint
    had and `to_hf(from_hf(sd))` reproduces `sd` exactly). `dtype` (None: keep the checkpoint's dtypes) casts the
    floating tensors `from_hf` returns; the router's tensors and RoPE buffers stay fp32 (pinned, as in the model).

    Raises:
        ValueError: the config is dense, or `moe_config` disagrees with it.
    """

    def __init__(
        self, config: Any, moe_config: Any = None, backend: Any = None, dtype: torch.dtype | None = torch.float32
    ) -> None:
        check_moe_config(config, moe_config)
        if backend is not None:  # the layout does not depend on it
            _logger.info(
                "%s runs its own PyTorch kernels; backend=%r changes only the MoE routing (gate_precision, "
                "fake_balanced_gate, fake_gate_noise)",
                type(self).__name__,
                backend,
            )
        self.config = config
        self.moe_config = moe_config
        self.backend = backend
        self.dtype = dtype

    def _cast(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.dtype is None or not tensor.is_floating_point():
            return tensor
        # the model classes' keep lists, read by am-precision's one rule (what loading and casting the model apply)
        pinned = match_keep_rule(key, fp32_keep_rules(Gemma4ForCausalLM)) is not None
        return tensor.to(torch.float32 if pinned else self.dtype)

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], device_mesh: Any = None, **kwargs: Any) -> dict[str, Any]:
        """transformers' keys (any prefix) → ours. Expert parallelism shards after loading
        (`model.apply_expert_parallel(ep_mesh)`), so `device_mesh` must be None."""
        if device_mesh is not None or kwargs:
            raise ValueError(
                f"Gemma4MoEStateDictAdapter.from_hf: device_mesh={device_mesh!r} and options {sorted(kwargs)} are not "
                "supported; load the full state dict, then call model.apply_expert_parallel(ep_mesh)"
            )
        return {key: self._cast(key, t) for key, t in Gemma4StateDictAdapter.from_hf(hf_state_dict).items()}

    def to_hf(
        self,
        state_dict: dict[str, Any],
        exclude_key_regex: str | None = None,
        quantization: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Our keys → transformers' (full tensors; gather EP-sharded experts first), without the keys that match
        `exclude_key_regex`."""
        if quantization or kwargs:
            raise ValueError(
                f"Gemma4MoEStateDictAdapter.to_hf: quantization={quantization!r} and options {sorted(kwargs)} are not "
                "supported; pass quantization=False"
            )
        out = Gemma4StateDictAdapter.to_hf(state_dict)
        if exclude_key_regex is not None:
            pattern = re.compile(exclude_key_regex)
            out = {key: t for key, t in out.items() if not pattern.match(key)}
        return out

    def convert_single_tensor_to_hf(self, fqn: str, tensor: Any, **kwargs: Any) -> list[tuple[str, Any]]:
        """`[(transformers_key, tensor)]` for one of our tensors (empty when excluded)."""
        return list(self.to_hf({fqn: tensor}, **kwargs).items())


class Gemma4MoETextModelBackend(Gemma4TextModel):
    """Upstream's MoE text model: our `Gemma4TextModel` built from `(config, backend=None, *, moe_config=None,
    moe_overrides=None)` and called with upstream's keywords. Its layers are `Gemma4DecoderLayer`s (the class
    `Gemma4MoEDecoderLayer` extends; same parameters and forward).

    Raises:
        ValueError: the config is dense, or `moe_config` / `moe_overrides` disagree with it (every field named).
    """

    def __init__(
        self, config: Any, backend: Any = None, *, moe_config: Any = None, moe_overrides: dict[str, Any] | None = None
    ) -> None:
        check_moe_config(config, moe_config, overrides=moe_overrides)
        super().__init__(config, backend=backend)

    def forward(  # type: ignore[override]  # upstream's keywords; ours reach the base forward through **kwargs
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: Any = None,
        position_ids: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        cp_enabled: bool = False,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """`[B, S]` ids (or `[B, S, H]` embeddings) → `last_hidden_state [B, S, H]`.

        cache_position `[S]`: positions when `position_ids` is None (transformers' rule). mm_token_type_ids `[B, S]`:
        image tokens attend to each other on sliding layers when the config says
        `use_bidirectional_attention="vision"` (else the mask is causal, as upstream). cp_enabled must say whether a
        CP ring context is entered (`make_cp_batch_and_ctx(..., model=)`); CP itself follows the context.

        Raises:
            ValueError: pixel_values given (this text model embeds no images: pass the image-merged inputs_embeds,
                as Gemma4ForConditionalGeneration does), or cp_enabled disagrees with the entered context.
        """
        problems = []
        if pixel_values is not None:
            problems.append(
                "pixel_values: the text backend embeds no images; pass inputs_embeds with the images merged"
            )
        ring_entered = active_ring_context() is not None
        if bool(cp_enabled) != ring_entered:
            problems.append(
                f"cp_enabled={cp_enabled} but a CP ring context is {'' if ring_entered else 'not '}entered; CP follows "
                "the context from make_cp_batch_and_ctx(..., model=model)"
            )
        if problems:
            raise ValueError("Gemma4MoETextModelBackend.forward:\n  - " + "\n  - ".join(problems))
        if position_ids is None and cache_position is not None:
            position_ids = cache_position.unsqueeze(0)
        if (
            mm_token_type_ids is not None
            and getattr(self.config, "use_bidirectional_attention", None) == "vision"
            and "vision_group_ids" not in kwargs
        ):
            device = (input_ids if input_ids is not None else inputs_embeds).device  # type: ignore[union-attr]
            kwargs["vision_group_ids"] = get_block_sequence_ids_for_mask(mm_token_type_ids, device=device)
        return super().forward(
            input_ids,
            attention_mask,
            position_ids,
            past_key_values,
            inputs_embeds,
            use_cache=use_cache,
            padding_mask=padding_mask,
            **kwargs,
        )


class ShardLayout(NamedTuple):
    """Sequence length of a batch before and after CP padding (upstream's `ShardLayout`)."""

    original_seq_len: int
    padded_seq_len: int


class Gemma4ContiguousSharder:
    """Upstream's model-owned sharder interface over am-context-parallel's contiguous shard with the model's options:
    `shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0) -> (context_factory, batch,
    ShardLayout)` and `local_token_global_indices(cp_mesh, padded_len, device)` (`[padded_len / C]` int64).

    Unlike upstream's aux-only shard (embeddings computed on the full sequence, then sliced in the forward), every
    sequence tensor is sharded, input_ids included: each rank embeds its own tokens (see `cp.py`).
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def shard_batch(
        self, cp_mesh: Any, tp_mesh: Any, batch: dict[str, Any], *, loss_mask: Any = None, padding_token_id: int = 0
    ) -> tuple[Any, dict[str, Any], ShardLayout]:
        seq_len = int(batch["input_ids"].shape[1])
        ctx, batch = make_contiguous_shard_cp_batch_and_ctx(
            cp_mesh, tp_mesh, batch, loss_mask, padding_token_id, options=self.model.get_cp_options()
        )
        padded = int(getattr(ctx, "padded_len", seq_len))
        return ctx, batch, ShardLayout(seq_len, padded)

    def local_token_global_indices(
        self, cp_mesh: Any, padded_len: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        layout = ContiguousLayout(cp_size=int(cp_mesh.size()), cp_rank=cp_rank(cp_mesh))
        return layout.local_indices(padded_len, device=device)


def prepare_model_inputs_for_cp(model: Any, batch: dict[str, Any], *, num_chunks: int = 1) -> dict[str, Any]:
    """Upstream's `model.prepare_model_inputs_for_cp(batch, *, num_chunks=1)` as a function of the model:
    `{"cp_sharder": Gemma4ContiguousSharder(model)}`. Consumes nothing from `batch` (it is only checked).

    Our models declare their layout instead of carrying the method (`make_cp_batch_and_ctx(mesh, batch,
    model=model)` shards the same way and is what the trainer calls); this function serves code that expects
    upstream's sharder.

    Raises:
        ValueError: no input_ids in `batch` (upstream's message), or num_chunks != 1 (THD chunks are not used).
    """
    if batch.get("input_ids") is None:
        raise ValueError("prepare_model_inputs_for_cp requires input_ids.")
    if num_chunks != 1:
        raise ValueError(f"num_chunks={num_chunks}: Gemma 4 shards contiguously without THD chunks; pass num_chunks=1")
    return {"cp_sharder": Gemma4ContiguousSharder(model)}
