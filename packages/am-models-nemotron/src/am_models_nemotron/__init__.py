"""am-models-nemotron: Nemotron-H / Nemotron V3 hybrid Mamba2 + attention + MLP + MoE models with multi-token
prediction, in plain PyTorch, loading and saving HF-format checkpoints.

Importing this package never imports mamba_ssm, causal_conv1d, am-pipelining or am-capabilities.
"""

from __future__ import annotations

from ._version import __version__
from .attention import NemotronAttention, NemotronV3Attention, build_attention_mask
from .backbone import NemotronV3Model
from .backend import SUPPORTED_BACKENDS, default_backend, resolve_backend
from .blocks import NemotronV3Block
from .cache import NemotronHybridCache
from .checkpoint import load_pretrained, read_safetensors_folder, save_pretrained
from .config import BLOCK_KINDS, NemotronConfig, as_hf_config, normalize_block_types
from .cp import prepare_mtp_inputs_for_cp
from .inputs import BatchLayout, resolve_batch_layout
from .mamba2 import (
    Mamba2FP32Params,
    Mamba2Mixer,
    MambaRMSNormGated,
    NemotronV3Mamba2Mixer,
    NemotronV3MambaFP32Params,
    NemotronV3MambaRMSNormGated,
    mamba_kernels_available,
)
from .mamba2_cp import (
    Mamba2CPContext,
    MambaCPCommStats,
    conv_halo_width,
    count_mamba_cp_bytes,
    mamba_cp_bytes_per_layer,
    prepend_conv_halo,
    ssd_chunked_scan_cp,
)
from .model import ModelClass, NemotronHForCausalLM
from .moe import ExpertParallelHooks, GroupedExperts, NemotronMLP, NemotronMoE, NemotronRouter, relu2
from .mtp import (
    MTPConfig,
    MTPModule,
    MTPSublayer,
    NemotronV3MTPSublayer,
    build_mtp_config_from_hf,
    mtp_depth_losses,
    mtp_loss,
    parse_mtp_layer_pattern,
    roll_tensor,
    shift_labels,
    shift_within_documents,
)
from .outputs import CombinedLoss, NemotronHCausalLMOutputWithPast, combined_causal_lm_loss
from .ssd import segment_sum, ssd_chunked_scan, ssd_sequential_scan
from .state_dict_adapter import NemotronV3StateDictAdapter

__all__ = [
    # config
    "BLOCK_KINDS",
    "NemotronConfig",
    "as_hf_config",
    "normalize_block_types",
    # models
    "ModelClass",
    "NemotronHForCausalLM",
    "NemotronV3Model",
    "NemotronHCausalLMOutputWithPast",
    # losses
    "CombinedLoss",
    "combined_causal_lm_loss",
    # backends
    "SUPPORTED_BACKENDS",
    "default_backend",
    "resolve_backend",
    # forward inputs (packing, padding, masks)
    "BatchLayout",
    "resolve_batch_layout",
    # blocks
    "NemotronV3Block",
    "NemotronAttention",
    "build_attention_mask",
    "Mamba2Mixer",
    "Mamba2FP32Params",
    "MambaRMSNormGated",
    "mamba_kernels_available",
    # upstream class names (nemotron_v3.layers)
    "NemotronV3Attention",
    "NemotronV3Mamba2Mixer",
    "NemotronV3MambaRMSNormGated",
    "NemotronV3MambaFP32Params",
    "NemotronMLP",
    "NemotronMoE",
    "NemotronRouter",
    "GroupedExperts",
    "ExpertParallelHooks",
    "relu2",
    # SSD scan
    "ssd_chunked_scan",
    "ssd_sequential_scan",
    "segment_sum",
    # context parallelism across Mamba2 (contiguous shards, exact state passing)
    "Mamba2CPContext",
    "ssd_chunked_scan_cp",
    "prepend_conv_halo",
    "conv_halo_width",
    "MambaCPCommStats",
    "count_mamba_cp_bytes",
    "mamba_cp_bytes_per_layer",
    # MTP
    "MTPConfig",
    "MTPModule",
    "MTPSublayer",
    "NemotronV3MTPSublayer",
    "build_mtp_config_from_hf",
    "parse_mtp_layer_pattern",
    "prepare_mtp_inputs_for_cp",
    "mtp_depth_losses",
    "mtp_loss",
    "roll_tensor",
    "shift_labels",
    "shift_within_documents",
    # cache
    "NemotronHybridCache",
    # checkpoints
    "NemotronV3StateDictAdapter",
    "load_pretrained",
    "save_pretrained",
    "read_safetensors_folder",
    "__version__",
]
