"""am-precision: the dtype policy for LLM training.

fp32-pinned modules (`_keep_in_fp32_modules[_strict]`), bf16 casts that never round pinned tensors (also under
FSDP2), an fp32 RMSNorm, backend selection (`BackendConfig`), Transformer Engine FP8 recipes and TE module subclasses,
the lm-head projection, and a report to check the fp32 contract.

Importing this package never imports transformer_engine or transformers; both are optional extras (`te`, `hf`)
imported only by the functions that need them.
"""

from __future__ import annotations

from ._version import __version__
from .attention import RUNNABLE_ATTN_BACKENDS, AttentionKernel, attention_backend_problem, eager_attention
from .backend import (
    ATTN_BACKENDS,
    DISPATCHER_BACKENDS,
    EXPERTS_BACKENDS,
    FP8_RECIPES,
    LINEAR_BACKENDS,
    RMS_NORM_BACKENDS,
    ROPE_BACKENDS,
    BackendConfig,
    TEFp8Config,
)
from .backend_options import CUDA_GRAPH_MODULES, CudaGraphConfig, MoKBackendConfig
from .casting import (
    cast_frozen_modules_to_compute_dtype,
    cast_model_to_dtype,
    is_dtensor,
    yield_fp32_model,
)
from .flags import (
    HAVE_DEEP_EP,
    HAVE_GMM,
    HAVE_TE,
    HAVE_UCCL_EP,
    get_is_first_microbatch,
    get_is_optim_step,
    is_tensor_unallocated,
    set_is_first_microbatch,
    set_is_optim_step,
    te_usable,
)
from .fsdp_sync import fsdp_units, prepare_for_final_backward, prepare_for_grad_accumulation
from .keep_rules import KeepRule, canonical_name, fp32_keep_rules, match_keep_rule
from .lm_head import compute_lm_head_logits
from .modules import Float32RMSNorm, initialize_linear_module, initialize_rms_norm_module
from .report import Fp32Report, TensorPrecision, assert_fp32_contract, fp32_report
from .rope import fused_rope, get_rope_config, quack_rope
from .runtime import backend_runtime_problems
from .te_modules import TEModuleClasses, te_module_classes, with_te_behaviours

__all__ = [
    # backend selection
    "BackendConfig",
    "TEFp8Config",
    "CudaGraphConfig",
    "MoKBackendConfig",
    "CUDA_GRAPH_MODULES",
    "ATTN_BACKENDS",
    "LINEAR_BACKENDS",
    "RMS_NORM_BACKENDS",
    "ROPE_BACKENDS",
    "EXPERTS_BACKENDS",
    "DISPATCHER_BACKENDS",
    "FP8_RECIPES",
    # flags
    "HAVE_TE",
    "HAVE_DEEP_EP",
    "HAVE_UCCL_EP",
    "HAVE_GMM",
    "te_usable",
    "get_is_first_microbatch",
    "set_is_first_microbatch",
    "get_is_optim_step",
    "set_is_optim_step",
    "is_tensor_unallocated",
    # what this machine can run
    "backend_runtime_problems",
    # attention kernels
    "AttentionKernel",
    "RUNNABLE_ATTN_BACKENDS",
    "attention_backend_problem",
    "eager_attention",
    # modules
    "Float32RMSNorm",
    "initialize_linear_module",
    "initialize_rms_norm_module",
    # keep rules and casting
    "KeepRule",
    "fp32_keep_rules",
    "match_keep_rule",
    "canonical_name",
    "cast_model_to_dtype",
    "cast_frozen_modules_to_compute_dtype",
    "yield_fp32_model",
    "is_dtensor",
    # fp32 contract report
    "fp32_report",
    "assert_fp32_contract",
    "Fp32Report",
    "TensorPrecision",
    # lm head and rope
    "compute_lm_head_logits",
    "fused_rope",
    "quack_rope",
    # FSDP gradient accumulation (enable_fsdp_optimizations)
    "fsdp_units",
    "prepare_for_final_backward",
    "prepare_for_grad_accumulation",
    "get_rope_config",
    # Transformer Engine modules with the short-circuit and is_first_microbatch behaviours (subclasses; no patching)
    "te_module_classes",
    "TEModuleClasses",
    "with_te_behaviours",
    "__version__",
]
