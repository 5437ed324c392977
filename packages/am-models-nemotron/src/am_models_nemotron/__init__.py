"""am-models-nemotron: Nemotron-H / Nemotron V3 hybrid Mamba2 + attention + MLP + MoE models with multi-token
prediction, in plain PyTorch, loading and saving HF-format checkpoints.

The root exports this package's own design (one name per thing) plus the seed's model surface
(`NemotronHForCausalLM`, `NemotronV3Model`, `NemotronHybridCache`, `MTPConfig`, `roll_tensor`). NeMo AutoModel's
other spellings (`NemotronV3Block`, `NemotronV3Attention`, `NemotronV3StateDictAdapter`, the generic `MTPModule`
constructor, `prepare_mtp_inputs_for_cp`, `ModelClass`, ...) are in `am_models_nemotron.upstream`, built on this
core and never imported by it.

Importing this package never imports mamba_ssm, causal_conv1d, am-pipelining or am-capabilities.
"""

from __future__ import annotations

from ._version import __version__
from .attention import NemotronAttention, build_attention_mask
from .backbone import NemotronV3Model
from .backend import SUPPORTED_BACKENDS, backend_problems, default_backend, resolve_backend
from .blocks import NemotronBlock
from .cache import NemotronHybridCache
from .checkpoint import hf_file_layout, load_pretrained, load_sharded_checkpoint, save_pretrained
from .config import BLOCK_KINDS, NemotronConfig, as_hf_config, normalize_block_types
from .inputs import BatchLayout, resolve_batch_layout
from .loss import CombinedLoss, combined_causal_lm_loss
from .mamba2 import (
    Mamba2FP32Params,
    Mamba2Mixer,
    MambaRMSNormGated,
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
from .model import NemotronHForCausalLM
from .moe import NemotronMLP, NemotronMoE, NemotronRouter, relu2
from .mtp import (
    MTPConfig,
    MTPModule,
    MTPSublayer,
    roll_tensor,
    shift_labels,
    shift_within_documents,
)
from .outputs import NemotronHCausalLMOutputWithPast
from .pretrained import NemotronHPreTrainedModel
from .sharded import init_units, materialize_sharded, meta_twin
from .ssd import segment_sum, ssd_chunked_scan, ssd_sequential_scan
from .state_dict_adapter import NemotronStateDictAdapter

__all__ = [
    # config
    "BLOCK_KINDS",
    "NemotronConfig",
    "as_hf_config",
    "normalize_block_types",
    # models
    "NemotronHForCausalLM",
    "NemotronHPreTrainedModel",
    "NemotronV3Model",
    "NemotronHCausalLMOutputWithPast",
    # losses
    "CombinedLoss",
    "combined_causal_lm_loss",
    # backends
    "SUPPORTED_BACKENDS",
    "backend_problems",
    "default_backend",
    "resolve_backend",
    # forward inputs (packing, padding, masks)
    "BatchLayout",
    "resolve_batch_layout",
    # blocks
    "NemotronBlock",
    "NemotronAttention",
    "build_attention_mask",
    "Mamba2Mixer",
    "Mamba2FP32Params",
    "MambaRMSNormGated",
    "mamba_kernels_available",
    "NemotronMLP",
    "NemotronMoE",
    "NemotronRouter",
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
    "roll_tensor",
    "shift_labels",
    "shift_within_documents",
    # cache
    "NemotronHybridCache",
    # checkpoints
    "NemotronStateDictAdapter",
    "load_pretrained",
    "save_pretrained",
    # real size: meta build, seeded per-rank materialization, sharded checkpoint loading
    "init_units",
    "materialize_sharded",
    "meta_twin",
    "load_sharded_checkpoint",
    "hf_file_layout",
    "__version__",
]
