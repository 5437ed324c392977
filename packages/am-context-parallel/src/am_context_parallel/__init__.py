"""Sequence sharding and ring attention for context parallelism (CP), in plain PyTorch.

Layouts (`layouts`), batch sharding with upstream's padding semantics (`batch`: `make_cp_batch_and_ctx`, the one
entry point), what a model declares to get the contiguous path (`model_protocol`), THD conversion (`thd`), the ring
attention over point-to-point sends (`ring`, with pluggable per-chunk `kernels`), the context that routes a model's
attention to the ring (`context`, `hf`) and checks that every attention layer reached it (`coverage`), the
loss/gradient reduction of a CP step (`training`), and the one multi-token-prediction loss term (`mtp_loss`). NeMo
AutoModel's other spellings (torch-style entry points, Gemma 4's contiguous shard, the model-less
`make_cp_batch_and_ctx`) live in `am_context_parallel.upstream`, which
this package's core never imports. Importing this package never imports transformers, transformer_engine or
flash_attn.
"""

from __future__ import annotations

from ._version import __version__
from .batch import make_cp_batch_and_ctx
from .context import RingAttentionContext, current_ring_context
from .coverage import cp_attention_problems
from .hf import RING_ATTENTION_NAME, hf_ring_attention_forward, register_ring_attention
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
from .mtp_loss import MTPLossOutput, mtp_loss, mtp_targets, shift_packed_tensor
from .ring import ring_attention
from .ring_setup import ring_plan
from .ring_stats import RingCommStats, count_ring_bytes
from .thd import make_cp_batch_for_te, process_input_for_thd, split_batch_into_thd_chunks
from .training import all_reduce_cp_gradients, cp_token_mean_loss

__all__ = [
    # the multi-token-prediction loss term (one implementation: am-pipelining and the models call it)
    "mtp_loss",
    "mtp_targets",
    "shift_packed_tensor",
    "MTPLossOutput",
    # layouts
    "ContiguousLayout",
    "IdentityLayout",
    "Layout",
    "LoadBalancedLayout",
    "PackedLayout",
    "pad_sequence_dim",
    # the entry point, and the THD conversion (upstream names)
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
    # can the package show that every attention of a model goes through the ring?
    "cp_attention_problems",
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
    # training step
    "all_reduce_cp_gradients",
    "cp_token_mean_loss",
    "__version__",
]
