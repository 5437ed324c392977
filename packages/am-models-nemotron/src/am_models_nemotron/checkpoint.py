"""HF-format checkpoint folders: config.json plus safetensors, single file or sharded with an index.

What it is for: `load_pretrained` (a folder or a hub id; read the config, build the model on the meta device, check
every tensor name and shape from the file headers, then read tensor by tensor — converted by
`NemotronStateDictAdapter` — straight into the model's parameters, so a sharded checkpoint is never held twice)
and `save_pretrained` (NVIDIA naming; shards + `model.safetensors.index.json` above `max_shard_size`, written by
huggingface_hub). Tensors pinned by the model's `_keep_in_fp32_modules_strict` (the adapter's `forced_fp32`) are
loaded as fp32 and stored as F32.
What it must not do: load partially. Missing or unexpected keys and shape mismatches raise one error listing all of
them, in the file's own naming (`backbone.layers.0.mixer.A_log`, per-expert keys); an unreadable, truncated or
corrupt file raises an error naming the file. Save a sharded model (expert parallel or FSDP2 DTensors): gather it
into an unsharded model first (see `save_pretrained`).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Unpack

import torch
from torch import nn

import am_moe
from am_model_io import (
    FileLayout,
    HubOptions,
    LazyCheckpoint,
    ShardedLoad,
    checked_sources,
    fill_self_sharded_,
    load_hf_config,
    load_sharded_tensors_,
    pretrained_saver,
    resolve_checkpoint_folder,
    resolve_device,
    resolve_dtype,
    self_sharded_names,
    split_pretrained_kwargs,
)
from am_precision import cast_model_to_dtype, match_keep_rule

from .config import as_hf_config
from .state_dict_adapter import NemotronStateDictAdapter

__all__ = [
    "NativeStateDictLayout",
    "checkpoint_adapter",
    "load_pretrained",
    "load_sharded_checkpoint",
    "save_pretrained",
]


class NativeStateDictLayout(NemotronStateDictAdapter):
    """The checkpoint layout of `BackendConfig(enable_hf_state_dict_adapter=False)`: the model's own state-dict keys
    (`model.layers.0.mixer._fp32_params.A_log`, stacked experts `[E, out, in]`), written and read as they are.
    fp32-pinned tensors are still stored as F32."""

    def from_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._cast(dict(state_dict))

    def internal_key(self, key: str) -> str:
        return key

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._cast(dict(state_dict))

    def forced_fp32(self, name: str) -> bool:
        return match_keep_rule(name, self._fp32_rules) is not None


def checkpoint_adapter(config: Any, backend: Any) -> NemotronStateDictAdapter:
    """The layout `from_pretrained` / `save_pretrained` use: NVIDIA's HF naming (`NemotronStateDictAdapter`), or the
    native keys when `backend.enable_hf_state_dict_adapter` is False (upstream: the model then has no adapter)."""
    if backend is not None and not backend.enable_hf_state_dict_adapter:
        return NativeStateDictLayout(config)
    return NemotronStateDictAdapter(config)


def load_pretrained(
    cls: Any,
    path_or_hub_id: str | os.PathLike[str],
    *,
    backend: Any = None,
    config: Any = None,
    torch_dtype: Any = None,
    dtype: Any = None,
    device_map: Any = None,
    device: torch.device | str | None = None,
    **model_kwargs: Any,
) -> Any:
    """Build `cls` from the checkpoint's config and load every parameter and buffer strictly, tensor by tensor.

    Args:
        path_or_hub_id: a folder, or a hub id (`snapshot_download` at `revision`; `cache_dir`, `token`,
            `local_files_only`, `force_download` as in huggingface_hub).
        config: use this config instead of the folder's config.json (what `AutoModelForCausalLM` passes).
        torch_dtype / dtype: the same option under transformers' two names; non-pinned floating tensors are cast to
            it as they are read (fp32-pinned tensors stay fp32); "auto": the config's dtype; None keeps the
            checkpoint's dtypes.
        device_map / device: one device for every tensor (None: CPU); splitting across devices is refused.
            "meta": the model is built on the meta device and every name and shape checked against the files'
            headers, but no tensor data is read: shard it, then `load_sharded_checkpoint` (or
            `sharded.materialize_sharded`) gives each rank its own blocks.
        model_kwargs: the constructor's keyword options (e.g. `num_nextn_predict_layers`); the hub options
            (`am_model_io.HubOptions`) and the keywords `AutoModelForCausalLM` adds are taken out first.

    Raises:
        ValueError: missing / unexpected keys or shape mismatches (all listed), an unreadable file (named), or an
            option this loader cannot honour.
    """
    folder = resolve_checkpoint_folder(path_or_hub_id, **split_pretrained_kwargs(model_kwargs))
    config = as_hf_config(config if config is not None else load_hf_config(folder))
    target_dtype = resolve_dtype(torch_dtype=torch_dtype, dtype=dtype, config=config)
    target = resolve_device(device_map=device_map, device=device)
    with LazyCheckpoint(folder) as checkpoint:
        model = cls(config, backend, device="meta", **model_kwargs)
        adapter = checkpoint_adapter(config, model.backend)
        sources = checked_sources(checkpoint, cls.__name__, expected=model.state_dict(), adapter=adapter)
        if target.type == "meta":  # the layout only: every name and shape checked, no data read
            if target_dtype is not None:
                cast_model_to_dtype(model, target_dtype)
            return model
        for name, keys in sources.items():
            (tensor,) = adapter.from_hf({key: checkpoint.read(key) for key in keys}).values()
            if tensor.is_floating_point() and adapter.forced_fp32(name):
                tensor = tensor.float()  # a checkpoint written elsewhere may hold pinned tensors in bf16
            elif tensor.is_floating_point() and target_dtype is not None:
                tensor = tensor.to(target_dtype)
            _assign(model, name, tensor.to(target))
            del tensor  # before the next read: one tensor (group) in flight at a time
    _materialize_unsaved_buffers(model, target)
    if target_dtype is not None:
        cast_model_to_dtype(model, target_dtype)
    return model


def load_sharded_checkpoint(
    model: Any,
    path_or_hub_id: str | os.PathLike[str],
    **hub: Unpack[HubOptions],
) -> ShardedLoad:
    """Load an HF-format checkpoint into an already-sharded model, each rank reading only the blocks it holds.

    model: a `NemotronHForCausalLM` built on the meta device (`from_config(config, device="meta")` or
        `from_pretrained(folder, device_map="meta")`), then split into a pipeline stage, expert-parallel
        (`apply_expert_parallel`) and/or FSDP2-wrapped in any combination, then `to_empty(device=...)`. Plain
        tensors are read whole; DTensors read their own block (`safe_open(...).get_slice`), per-expert keys only for
        the experts the rank holds (`NemotronStateDictAdapter` maps the names and the stacking order; the native
        keys when the model's backend says `enable_hf_state_dict_adapter=False`).
    The strict check runs once, on the files' headers, against the whole model (`sharded.meta_twin`): missing or
    unexpected tensors and shape mismatches are named as the files name them, whichever stage this rank holds.
    Values are cast to each tensor's dtype (fp32-pinned tensors are fp32 in the model). Expert load counters are
    zeroed. No collective: every rank calls it on its own.

    Returns `ShardedLoad`: the model's names that were loaded (this stage's state-dict keys) and the tensor bytes
    this rank read.

    Raises:
        ValueError: missing / unexpected keys or shape mismatches (all listed), a tensor still on the meta device,
            an unreadable file (named).
        FileNotFoundError: no safetensors files.
    """
    from .sharded import meta_twin

    folder = resolve_checkpoint_folder(path_or_hub_id, **hub)
    adapter = checkpoint_adapter(model.config, model.backend)  # the layout from_pretrained / save_pretrained use
    with LazyCheckpoint(folder) as checkpoint:
        twin = meta_twin(model)
        # reported in the checkpoint's own naming (`backbone.layers.0.mixer.A_log`, per-expert tensors), not ours
        sources = checked_sources(checkpoint, type(model).__name__, expected=twin.state_dict(), adapter=adapter)
        # per-expert keys in expert order (the files list them by name: experts.10 before experts.2)
        ordered = {name: sorted(keys, key=lambda k: adapter.expert_index(k) or 0) for name, keys in sources.items()}
        # Mamba2 mixers sharded by heads (tensor parallelism) hold a slice of every packed segment, not a block of the
        # file's tensor: read whole one mixer at a time and cut by the mixer (`tensor_parallel_shard_state`)
        own = self_sharded_names(model, template=twin)
        loaded = load_sharded_tensors_(model, checkpoint, {n: k for n, k in ordered.items() if n not in own})
        before = checkpoint.bytes_read
        filled = fill_self_sharded_(model, template=twin, read=lambda name: checkpoint.read(ordered[name][0]))
        loaded = ShardedLoad(loaded.names + tuple(filled), loaded.bytes_read + checkpoint.bytes_read - before)
    with torch.no_grad():
        for _, experts in am_moe.expert_modules(model):
            experts.tokens_per_expert.zero_()
    return loaded


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the (meta) parameter or buffer `name`, as `load_state_dict(assign=True)` does."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr in owner._parameters:
        old = owner._parameters[attr]
        owner._parameters[attr] = nn.Parameter(tensor, requires_grad=old.requires_grad if old is not None else True)
    else:
        owner._buffers[attr] = tensor


def _materialize_unsaved_buffers(model: Any, device: torch.device) -> None:
    """Buffers no checkpoint holds are still on the meta device after an `assign=True` load: am-moe's per-expert load
    counters (non-persistent) start at zero on `device`; anything else left on meta is an error, never a silent hole."""
    for _, experts in am_moe.expert_modules(model):
        if experts.tokens_per_expert.is_meta:
            experts.tokens_per_expert = torch.zeros_like(experts.tokens_per_expert, device=device)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{type(model).__name__}: tensors left uninitialized (meta) after loading: {left}")


def hf_file_layout(model: Any) -> FileLayout:
    """How `save_pretrained` writes `model` (a whole model or a pipeline stage of it), tensor by tensor: NVIDIA's
    names (the checkpoint adapter: per-expert tensors), fp32-pinned tensors as F32, and config.json (transformers'
    NemotronHConfig) whose MTP depth count is the model's (a stage may lack the MTP module its model has). A
    streaming export (one tensor at a time, e.g. the reference trainer's) uses it to write what `save_pretrained`
    writes."""
    config = as_hf_config(copy.deepcopy(model.config))
    config.architectures = ["NemotronHForCausalLM"]
    # The constructor may override the MTP depth count; the saved config must describe the saved weights.
    config.num_nextn_predict_layers = model.mtp_config.num_layers if model.mtp_config.enabled else 0
    adapter = checkpoint_adapter(config, model.backend)

    def to_file(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: (v.float() if adapter.forced_fp32(k) else v) for k, v in adapter.to_hf(tensors).items()}

    return FileLayout(to_file, write_metadata=lambda folder: config.save_pretrained(str(folder)))


# (model, save_directory, *, max_shard_size="5GB", safe_serialization=True, state_dict=None): what hf_file_layout says
save_pretrained = pretrained_saver(hf_file_layout)
