"""Sequence sharding and ring attention for context parallelism (CP), in plain PyTorch.

Layouts (`layouts`), batch sharding with upstream's padding semantics (`batch`), what a model declares to get the
contiguous path (`model_protocol`), THD conversion (`thd`), the ring attention over point-to-point sends (`ring`,
with pluggable per-chunk `kernels`), the context that routes attention to the ring (`context`, `hf`), upstream's
torch-style entry points on top of it (`train_context`) and the loss/gradient reduction of a CP step (`training`).
Importing this package never imports transformers, transformer_engine or flash_attn.
"""

from __future__ import annotations

from ._version import __version__
from .batch import (
    _synthesize_single_document_seq_ids,
    make_contiguous_shard_cp_batch_and_ctx,
    make_cp_batch_and_ctx,
)
from .context import RingAttentionContext, current_ring_context
from .hf import (
    RING_ATTENTION_NAME,
    hf_ring_attention_forward,
    register_ring_attention,
    routed_hf_attention,
)
from .kernels import (
    AttentionKernel,
    FlashCPUAttentionKernel,
    TorchAttentionKernel,
    merge_partial_attention,
    select_kernel,
)
from .layouts import (
    ContiguousLayout,
    IdentityLayout,
    Layout,
    LoadBalancedLayout,
    PackedLayout,
    pad_sequence_dim,
)
from .model_protocol import CP_LAYOUTS, ContiguousCPOptions, cp_local_seq_len, model_cp_options, model_cp_problems
from .ring import ring_attention
from .ring_setup import ring_plan
from .ring_stats import RingCommStats, count_ring_bytes
from .thd import make_cp_batch_for_te, process_input_for_thd, split_batch_into_thd_chunks
from .train_context import (
    attach_context_parallel_hooks,
    attach_cp_sdpa_hooks,
    create_context_parallel_ctx,
    get_train_context,
    unshard_context_parallel_tensor,
)
from .training import all_reduce_cp_gradients, cp_token_mean_loss

__all__ = [
    # layouts
    "ContiguousLayout",
    "IdentityLayout",
    "Layout",
    "LoadBalancedLayout",
    "PackedLayout",
    "pad_sequence_dim",
    # batch sharding (upstream names)
    "_synthesize_single_document_seq_ids",
    "make_contiguous_shard_cp_batch_and_ctx",
    "make_cp_batch_and_ctx",
    "make_cp_batch_for_te",
    "process_input_for_thd",
    "split_batch_into_thd_chunks",
    # what a model declares for the contiguous path
    "CP_LAYOUTS",
    "ContiguousCPOptions",
    "model_cp_options",
    "model_cp_problems",
    "cp_local_seq_len",
    # ring attention
    "AttentionKernel",
    "FlashCPUAttentionKernel",
    "RingCommStats",
    "TorchAttentionKernel",
    "count_ring_bytes",
    "merge_partial_attention",
    "ring_attention",
    "ring_plan",
    "select_kernel",
    # attention context and HF integration
    "RING_ATTENTION_NAME",
    "RingAttentionContext",
    "current_ring_context",
    "hf_ring_attention_forward",
    "register_ring_attention",
    "routed_hf_attention",
    # upstream's torch-style entry points (train_context.py)
    "attach_context_parallel_hooks",
    "attach_cp_sdpa_hooks",
    "create_context_parallel_ctx",
    "get_train_context",
    "unshard_context_parallel_tensor",
    # training step
    "all_reduce_cp_gradients",
    "cp_token_mean_loss",
    "__version__",
]
