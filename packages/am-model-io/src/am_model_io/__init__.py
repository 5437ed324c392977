"""am-model-io: the plumbing every model package shares to get weights in and out.

HF-format checkpoint folders (safetensors read tensor by tensor or block by block, written by huggingface_hub),
transformers' `from_pretrained` keywords resolved or refused, seeded per-rank materialization of a meta-built,
sharded model, and the `generate()` hooks of a model with its own cache. Model packages build their
`from_pretrained` / `save_pretrained` / `materialize_sharded` on it; it knows no model.

Importing it imports torch and safetensors; huggingface_hub and transformers are imported only by the functions
that need them (a hub download, writing shards, reading a config).
"""

from ._version import __version__
from .generation import OwnCacheGenerationHooks
from .materialize import (
    SHARD_STATE_METHOD,
    InitUnit,
    fill_self_sharded_,
    local_index,
    local_region,
    materialize_sharded_,
    read_local,
    self_sharded_names,
    unit_seed,
)
from .pretrained import (
    HubOptions,
    load_hf_config,
    pretrained_saver,
    resolve_checkpoint_folder,
    resolve_device,
    resolve_dtype,
    split_pretrained_kwargs,
)
from .safetensors_files import (
    INDEX_FILE,
    SINGLE_FILE,
    LazyCheckpoint,
    ShardedLoad,
    checked_sources,
    load_sharded_tensors_,
    read_safetensors_folder,
    write_safetensors,
)
from .shard_writer import FileLayout, ShardFile, ShardWriter, finish_shard_files, parse_shard_size

__all__ = [
    # safetensors folders
    "LazyCheckpoint",
    "ShardedLoad",
    "checked_sources",
    "load_sharded_tensors_",
    "read_safetensors_folder",
    "write_safetensors",
    "INDEX_FILE",
    "SINGLE_FILE",
    # writing a folder tensor by tensor (a distributed export: one writer per writing rank)
    "ShardWriter",
    "FileLayout",
    "ShardFile",
    "finish_shard_files",
    "parse_shard_size",
    # from_pretrained / save_pretrained
    "HubOptions",
    "split_pretrained_kwargs",
    "resolve_checkpoint_folder",
    "resolve_dtype",
    "resolve_device",
    "load_hf_config",
    "pretrained_saver",
    # materializing a meta-built, sharded model (seeded, layout-independent)
    "InitUnit",
    "materialize_sharded_",
    "unit_seed",
    "local_index",
    "local_region",
    "SHARD_STATE_METHOD",
    "read_local",
    "self_sharded_names",
    "fill_self_sharded_",
    # generate()
    "OwnCacheGenerationHooks",
    "__version__",
]
