"""What every Gemma 4 model class is besides its modules: one base, `Gemma4PreTrainedModel`.

What it is for: the parts `Gemma4ForCausalLM` and `Gemma4ForConditionalGeneration` share, each with one job:
  - what a model declares to the infrastructure, in one place: the fp32 keep lists (am-precision),
    `get_capabilities(config)` (am-capabilities, seed-documented), and `am_contract()` (am-model-contract: the
    contiguous CP layout and its own CP attention with `get_cp_options()` and `cp_problems(...)`, the MoE marker and
    `apply_expert_parallel(ep_mesh)`), which every infrastructure package reads;
  - the LM head's output: `logits_and_loss` (soft-capped logits; the loss without CP or this rank's share under CP);
  - loading and saving like transformers (`from_pretrained` / `save_pretrained`, written in `checkpoint`);
  - `generate(...)`: transformers' `GenerationMixin` with our cache (`generation.Gemma4GenerationMixin`).
What it must not do: import the model modules (they import it), am-pipelining or am-capabilities, or hold checkpoint
logic itself (`checkpoint` does).

Embedding gradients under CP: each rank embeds its own shard of `input_ids` (an embedding is per token), so the
embedding (and the vision tower, through the image rows a rank consumes) receives the gradient of the local tokens;
`all_reduce_cp_gradients` then sums the ranks into the full-sequence gradient.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn

import am_moe
from am_context_parallel import ContiguousCPOptions, cp_token_mean_loss
from am_model_contract import (
    ContextParallelContract,
    ExpertParallelContract,
    ModelContract,
    TensorParallelContract,
    declared_tp_plan,
)
from am_moe import GroupedExperts, LoadBalancing
from am_precision import compute_lm_head_logits, prepare_for_final_backward, prepare_for_grad_accumulation

from . import checkpoint
from .attention import Gemma4Attention
from .backend import expert_parallel_options
from .config import is_moe_config, text_config_of, ties_word_embeddings
from .cp import active_ring_context
from .generation import Gemma4GenerationMixin
from .kernels import default_ring_kernel
from .moe import Gemma4MoE

__all__ = ["Gemma4PreTrainedModel", "causal_lm_loss", "gemma4_capabilities", "softcap_logits"]


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`cap · tanh(logits / cap)` when `cap` is set (Gemma's final logit soft-capping), else `logits`."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """transformers' causal-LM loss: token t predicts label t+1 (shift inside), mean over non-ignored labels, fp32."""
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1).to(logits.device), ignore_index=ignore_index
    )


def gemma4_capabilities(config: Any) -> dict[str, bool]:
    """Declared capabilities for am-capabilities: dense → PP, CP and TP; MoE → PP, CP, TP and EP
    (`apply_expert_parallel`). TP comes from the plan in `tp_plan.py`; am-capabilities checks its sizes at a tp.

    PP is not declared for variants with per-layer inputs or KV sharing (a stage would need token ids or another
    stage's K/V). Under PP the MoE layers keep padding out of routing through the `padding_mask` the pipeline's
    Gemma 4 stage forward passes to every layer (or, under CP, the ring context's document ids).
    """
    text = text_config_of(config)
    moe = is_moe_config(text)
    stage_local = not getattr(text, "hidden_size_per_layer_input", 0) and not getattr(text, "num_kv_shared_layers", 0)
    return {"supports_cp": True, "supports_pp": bool(stage_local), "supports_ep": moe, "supports_tp": True}


class Gemma4PreTrainedModel(nn.Module, Gemma4GenerationMixin):
    """The base of the Gemma 4 model classes (see the module docstring). A subclass sets `config`, builds its
    modules and an `lm_head`, and calls `_init_generation_config(config)` in its `__init__`."""

    # The fp32-pinned tensors (casting and checkpoint loading derive from them): the MoE router's proj, scale and
    # per-expert scale, and the RoPE inv_freq buffers. Substrings of names: they match under `model.language_model.`.
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["router"]
    _keep_in_fp32_modules: ClassVar[list[str]] = ["rotary_emb"]
    # Gemma 4's balancing recipe: none is published. transformers' Gemma 4 has no router auxiliary loss (it only
    # returns router logits) and NeMo AutoModel trains its MoE with gate_bias_update_factor=0 and aux_loss_coeff=0;
    # the softmax router has no selection bias. So the recipe is all off; the aux losses and z-loss of
    # `am_moe.configure_load_balancing` work on its router when asked for, a bias update is refused.
    moe_load_balancing: ClassVar[LoadBalancing] = LoadBalancing()
    supports_gradient_checkpointing = True  # recomputation is exact, dense and MoE (trainer parity at dp 2 x ep 2)
    config: Any
    model: Any  # the subclass's: Gemma4TextModel, or Gemma4Model (text model as `language_model`)
    lm_head: nn.Linear

    @classmethod
    def get_capabilities(cls, config: Any) -> dict[str, bool]:
        return gemma4_capabilities(config)

    def am_contract(self) -> ModelContract:
        """What this model offers the infrastructure (am-model-contract): contiguous CP shards with the model's own
        ring attention (`get_cp_options`, `cp_problems`); for a MoE config, `apply_expert_parallel`; the class's TP plan
        (`tp_plan.py`; None for the vision-language model)."""
        moe = is_moe_config(self.config)
        return ModelContract(
            cp=ContextParallelContract(
                layout="contiguous", owns_attention=True, options=self.get_cp_options, problems=self.cp_problems
            ),
            ep=ExpertParallelContract(is_moe=moe, apply=self.apply_expert_parallel if moe else None),
            tp=TensorParallelContract(plan=declared_tp_plan(self)),
        )

    def get_cp_options(self) -> ContiguousCPOptions:
        """What `make_cp_batch_and_ctx(mesh, batch, model=model)` reads: the block-sparse ring kernel
        (`default_ring_kernel` for the batch's device); input_ids required, since each rank embeds its own shard
        (per-layer inputs and image positions come from the token ids); transformers' attention is not routed (the
        vision tower keeps its own attention on whole images). Forward AND backward run inside `with ctx():`."""
        return ContiguousCPOptions(kernel=default_ring_kernel, primary_keys=("input_ids",))

    def cp_problems(self, *, seq_len: int, local_seq_len: int, cp_size: int) -> list[str]:
        """What this model cannot honour under CP, asked before any collective (am-context-parallel's
        `model_cp_problems`): each decoder attention layer's `cp_problem()` (attention dropout while training), the
        rule its forward enforces. Sequence lengths set no limit: the ring fetches whichever ranks a sliding window
        reaches, however short the shards; image batches with `use_bidirectional_attention="vision"` are refused at
        forward time (they depend on the batch, not the configuration)."""
        del seq_len, local_seq_len, cp_size
        where: dict[str, list[str]] = {}  # one line per problem, naming every layer that has it
        for name, module in self.named_modules():
            problem = module.cp_problem() if isinstance(module, Gemma4Attention) else None
            if problem is not None:
                where.setdefault(problem, []).append(name)
        return [f"{problem} (in {', '.join(names)})" for problem, names in where.items()]

    def apply_expert_parallel(self, ep_mesh: Any, *, dispatcher: str | None = None) -> list[GroupedExperts]:
        """Shard every layer's experts over the 1-D `ep_mesh` (rank r owns experts [r*E/ep, (r+1)*E/ep)) and switch
        them to all-to-all dispatch; returns the sharded `GroupedExperts` (none on a pipeline stage without MoE
        layers). Routers and the dense MLP stay replicated. Collective over `ep_mesh` (the weights are scattered from
        its first rank). A trainer calls it; am-capabilities refuses ep_size > 1 to a model without it.

        The dispatcher and its knobs are the backend's (`BackendConfig.dispatcher`, `dispatcher_num_sms`,
        `dispatcher_async_dispatch`, `dispatcher_share_token_dispatcher`; "torch" without a backend);
        `dispatcher` overrides the name with any am-moe dispatcher (e.g. "torch_token", DeepEP's token-level protocol
        in plain torch).

        NOTE: apply after pipeline splitting and before FSDP2 (`am_moe.fully_shard_experts`, then `fully_shard`).

        Raises:
            ValueError: before any collective, when the config has no MoE block (`enable_moe_block`), num_experts is
                not divisible by the ep size, the mesh is not 1-D, or the experts are already sharded (all listed).
        """
        if not is_moe_config(self.config):
            raise ValueError(
                f"{type(self).__name__}: expert parallelism needs the MoE block, but this config has "
                "enable_moe_block=False (a dense Gemma 4); use ep=1"
            )
        backends = [m.backend for m in self.modules() if isinstance(m, Gemma4MoE)]  # one backend for every layer
        options = expert_parallel_options(backends[0] if backends else None, dispatcher=dispatcher)
        return am_moe.apply_expert_parallel(self, ep_mesh, **options)

    def tie_weights(self) -> None:
        """Point `lm_head.weight` at the text embedding when `tie_word_embeddings` (`config.ties_word_embeddings`). A
        pipeline stage holding only one of the two (the other is None) is left alone: am-pipelining keeps the copies
        equal."""
        head, embed = self.lm_head, getattr(getattr(self.model, "language_model", self.model), "embed_tokens", None)
        if ties_word_embeddings(self.config) and head is not None and embed is not None:
            head.weight = embed.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()  # the text embedding, in either model

    def prepare_for_grad_accumulation(self, pp_enabled: bool = False) -> None:
        """With `backend.enable_fsdp_optimizations` (upstream's MoE FSDP hook): before the first backward of an
        optimizer step, defer every FSDP unit's reduce-scatter and resharding (`am_precision.fsdp_sync`; a no-op
        under pipeline parallelism, without the option, or without a backend)."""
        backend = getattr(self.model, "language_model", self.model).backend  # the text model's
        if backend is not None and backend.enable_fsdp_optimizations:
            prepare_for_grad_accumulation(self, pp_enabled=pp_enabled)

    def prepare_for_final_backward(self, pp_enabled: bool = False) -> None:
        """With `backend.enable_fsdp_optimizations`: before the last backward of an optimizer step, turn the
        reduce-scatter and resharding back on (`am_precision.fsdp_sync`)."""
        backend = getattr(self.model, "language_model", self.model).backend
        if backend is not None and backend.enable_fsdp_optimizations:
            prepare_for_final_backward(self, pp_enabled=pp_enabled)

    def logits_and_loss(
        self, hidden: torch.Tensor, labels: torch.Tensor | None, *, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states `[B, S, H]` → soft-capped logits `[B, S or logits_to_keep, V]` and, with labels, the
        loss: transformers' (labels unshifted, shifted inside) without CP; under CP (inside the context of
        `make_cp_batch_and_ctx`) labels are ALREADY shifted and the loss is this rank's share of the global token
        mean (`cp_token_mean_loss`), so sum gradients over the CP group."""
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:, :]
        # compute_lm_head_logits runs the head in its compute dtype (FSDP2's param_dtype under mixed precision), so
        # an fp32 final norm output meets a bf16 head
        head_logits = compute_lm_head_logits(self.lm_head, hidden).logits
        logits = softcap_logits(head_logits, getattr(text_config_of(self.config), "final_logit_softcapping", None))
        if labels is None:
            return logits, None
        ring = active_ring_context()
        if ring is not None:
            return logits, cp_token_mean_loss(logits, labels, group=ring.group)[0]
        return logits, causal_lm_loss(logits, labels)

    @classmethod
    def from_config(cls, config: Any, *, device: torch.device | str | None = None, **kwargs: Any) -> Self:
        """A randomly initialized model from a config (`cls(config, **kwargs)`); `device="meta"` builds the full
        model without storage (then shard it and use `sharded.materialize_sharded` or `load_sharded_checkpoint`)."""
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return cls(config, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike[str], **kwargs: Any) -> Self:
        """transformers' `from_pretrained` (folder or hub id; `torch_dtype` / `dtype`, `device_map`, `revision`,
        `config`, ...): `checkpoint.load_pretrained`, where every keyword is documented."""
        return checkpoint.load_pretrained(cls, pretrained_model_name_or_path, **kwargs)

    save_pretrained = checkpoint.save_pretrained  # (self, save_directory, *, max_shard_size, safe_serialization, ...)
