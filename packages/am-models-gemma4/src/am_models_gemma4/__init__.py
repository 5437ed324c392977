"""Gemma 4 (dense and MoE, sliding + full attention) in PyTorch with model-owned context parallelism.

Text decoder and causal LM (`model`), the vision-language model around HF's vision tower (`vlm`), the MoE block
(`moe`), attention with ring CP (`attention`, `cp`, `kernels`), generation with a KV cache (`generation`, `cache`),
HF checkpoint conversion (`state_dict_adapter`, `checkpoint`). Importing this package never imports am-pipelining,
am-capabilities or transformer_engine.

One root name per thing; NeMo AutoModel's other spellings (`Gemma4Gate`, ...) are in `am_models_gemma4.upstream`.
"""

from __future__ import annotations

from ._version import __version__
from .attention import Gemma4Attention, SharedKVStates
from .backend import backend_problems, resolve_backend
from .cache import Gemma4HybridCache
from .checkpoint import hf_file_layout, load_sharded_checkpoint
from .config import (
    is_moe_config,
    layer_head_dim,
    layer_num_kv_heads,
    moe_intermediate_size,
    text_config_of,
    validate_text_config,
)
from .cp import active_ring_context
from .decoder import Gemma4DecoderLayer
from .kernels import BlockSparseAttentionKernel, default_ring_kernel
from .layers import Gemma4RMSNorm
from .masks import AttentionInputs, build_attention_mask
from .model import Gemma4ForCausalLM, Gemma4TextModel
from .moe import Gemma4Experts, Gemma4MoE, Gemma4Router, apply_routing_backend
from .pretrained import Gemma4PreTrainedModel, causal_lm_loss, gemma4_capabilities, softcap_logits
from .sharded import init_units, materialize_sharded, meta_twin, restore_constructed_buffers_
from .state_dict_adapter import Gemma4StateDictAdapter
from .vlm import Gemma4ForConditionalGeneration, Gemma4Model

__all__ = [
    "backend_problems",
    "resolve_backend",
    # models
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "Gemma4Model",
    "Gemma4TextModel",
    "Gemma4DecoderLayer",
    "Gemma4Attention",
    "Gemma4MoE",
    "Gemma4Router",
    "apply_routing_backend",
    "Gemma4Experts",
    "Gemma4PreTrainedModel",
    "Gemma4RMSNorm",
    # attention inputs
    "AttentionInputs",
    "SharedKVStates",
    "build_attention_mask",
    # generation
    "Gemma4HybridCache",
    # context parallelism
    "active_ring_context",
    "BlockSparseAttentionKernel",
    "default_ring_kernel",
    # checkpoints
    "Gemma4StateDictAdapter",
    # real size: meta build, seeded per-rank materialization, sharded checkpoint loading
    "init_units",
    "materialize_sharded",
    "meta_twin",
    "restore_constructed_buffers_",
    "load_sharded_checkpoint",
    "hf_file_layout",
    # config and helpers
    "causal_lm_loss",
    "gemma4_capabilities",
    "is_moe_config",
    "layer_head_dim",
    "layer_num_kv_heads",
    "moe_intermediate_size",
    "softcap_logits",
    "text_config_of",
    "validate_text_config",
    "__version__",
]
