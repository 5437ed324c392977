"""HF-format checkpoint folders: config.json plus safetensors, single file or sharded with an index.

What it is for: `load_pretrained` (a folder or a hub id; read the config, build the model on the meta device, check
every tensor name and shape from the file headers, then read tensor by tensor — converted by
`NemotronV3StateDictAdapter` — straight into the model's parameters, so a sharded checkpoint is never held twice)
and `save_pretrained` (NVIDIA naming; shards + `model.safetensors.index.json` above `max_shard_size`, written by
huggingface_hub). Tensors pinned by the model's `_keep_in_fp32_modules_strict` (the adapter's `forced_fp32`) are
loaded as fp32 and stored as F32.
What it must not do: load partially. Missing or unexpected keys and shape mismatches raise one error listing all of
them (in the file's naming and the model's); an unreadable, truncated or corrupt file raises an error naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from am_models_nemotron.config import as_hf_config
from am_models_nemotron.hf_io import (
    LazyCheckpoint,
    resolve_checkpoint_folder,
    resolve_device,
    resolve_dtype,
    write_safetensors,
)
from am_models_nemotron.state_dict_adapter import NemotronV3StateDictAdapter
from am_precision import cast_model_to_dtype

__all__ = ["load_pretrained", "read_safetensors_folder", "save_pretrained"]

# Keywords transformers' AutoModel passes on to a registered class; none changes what is loaded here.
_AUTO_KWARGS = ("_from_auto", "trust_remote_code", "adapter_kwargs", "subfolder", "proxies")


def read_safetensors_folder(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a folder (`model.safetensors.index.json` shards, else `model.safetensors`) in memory at once;
    for inspection and tests (loading reads tensor by tensor, see `LazyCheckpoint`).

    Raises:
        FileNotFoundError: no index and no model.safetensors, or a shard named by the index is absent.
        ValueError: a file cannot be read (named), or the index is malformed.
    """
    with LazyCheckpoint(folder) as checkpoint:
        return {key: checkpoint.read(key) for key in checkpoint.names()}


def _load_config(folder: Path) -> Any:
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"No config.json in {folder}.")
    return as_hf_config(AutoConfig.from_pretrained(str(folder)))


def _pop_auto_kwargs(kwargs: dict[str, Any]) -> None:
    """Drop what `AutoModelForCausalLM.from_pretrained` adds; refuse the ones that would change the load."""
    for name in _AUTO_KWARGS:
        value = kwargs.pop(name, None)
        if name in ("adapter_kwargs", "subfolder", "proxies") and value:
            raise ValueError(f"{name}={value!r} is not supported by this loader (load adapters / subfolders apart)")


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
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
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
        model_kwargs: the constructor's keyword options (e.g. `num_nextn_predict_layers`).

    Raises:
        ValueError: missing / unexpected keys or shape mismatches (all listed), an unreadable file (named), or an
            option this loader cannot honour.
    """
    _pop_auto_kwargs(model_kwargs)
    folder = resolve_checkpoint_folder(
        path_or_hub_id,
        revision=revision,
        cache_dir=cache_dir,
        token=token,
        local_files_only=local_files_only,
        force_download=force_download,
    )
    config = as_hf_config(config) if config is not None else _load_config(folder)
    target_dtype = resolve_dtype(torch_dtype=torch_dtype, dtype=dtype, config=config)
    target = resolve_device(device_map=device_map, device=device)
    adapter = NemotronV3StateDictAdapter(config)
    with LazyCheckpoint(folder) as checkpoint:
        model = cls(config, backend, device="meta", **model_kwargs)
        sources = _check_names_and_shapes(cls.__name__, model, checkpoint, adapter, folder)
        for name, keys in sources.items():
            (tensor,) = adapter.from_hf({key: checkpoint.read(key) for key in keys}).values()
            if tensor.is_floating_point() and adapter.forced_fp32(name):
                tensor = tensor.float()  # a checkpoint written elsewhere may hold pinned tensors in bf16
            elif tensor.is_floating_point() and target_dtype is not None:
                tensor = tensor.to(target_dtype)
            _assign(model, name, tensor.to(target))
            del tensor  # before the next read: one tensor (group) in flight at a time
    if target_dtype is not None:
        cast_model_to_dtype(model, target_dtype)
    return model


def _check_names_and_shapes(
    owner: str, model: nn.Module, checkpoint: LazyCheckpoint, adapter: NemotronV3StateDictAdapter, folder: Path
) -> dict[str, list[str]]:
    """Internal name -> the checkpoint keys it is built from, after checking every name and shape (headers only)."""
    converted = adapter.from_hf(checkpoint.meta_state_dict())  # raises on incomplete expert sets, all listed
    sources: dict[str, list[str]] = {}
    for key in checkpoint.names():
        sources.setdefault(adapter.internal_key(key), []).append(key)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(converted))
    unexpected = sorted(set(converted) - set(expected))
    mismatched = sorted(
        f"{k}: checkpoint {tuple(converted[k].shape)} vs model {tuple(expected[k].shape)} (file: {_short(sources[k])})"
        for k in set(expected) & set(converted)
        if tuple(converted[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            named = [f"{k} (file: {_short(list(adapter.to_hf({k: expected[k]})))})" for k in missing]
            parts.append(f"missing keys ({len(missing)}): {named}")
        if unexpected:
            parts.append(
                f"unexpected keys ({len(unexpected)}): {[f'{_short(sources[k])} (model: {k})' for k in unexpected]}"
            )
        if mismatched:
            parts.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
        raise ValueError(
            f"Checkpoint {folder} does not match {owner} built from its config.json:\n  - " + "\n  - ".join(parts)
        )
    return {name: sources[name] for name in expected}


def _short(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{keys[0]} .. {keys[-1]} ({len(keys)} tensors)"


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the (meta) parameter or buffer `name`, as `load_state_dict(assign=True)` does."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr in owner._parameters:
        old = owner._parameters[attr]
        owner._parameters[attr] = nn.Parameter(tensor, requires_grad=old.requires_grad if old is not None else True)
    else:
        owner._buffers[attr] = tensor


def save_pretrained(
    model: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = True,
) -> None:
    """Write config.json (transformers' NemotronHConfig) and the weights in NVIDIA's naming; fp32-pinned tensors
    (`_keep_in_fp32_modules_strict`) are stored as F32 even from a model cast with a plain `.to(bfloat16)`.

    Args:
        max_shard_size: above it ("5GB", "200MB" or bytes) the weights are split into
            `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`; None: one file.
        safe_serialization: only True (safetensors) is supported; False is refused.
    """
    folder = Path(path)
    if not safe_serialization:
        write_safetensors({}, folder, max_shard_size=max_shard_size, safe_serialization=False)  # raises
    folder.mkdir(parents=True, exist_ok=True)
    config = as_hf_config(model.config)
    config.architectures = ["NemotronHForCausalLM"]
    # The constructor may override the MTP depth count; the saved config must describe the saved weights.
    config.num_nextn_predict_layers = model.mtp_config.num_layers if model.mtp is not None else 0
    config.save_pretrained(str(folder))
    adapter = NemotronV3StateDictAdapter(config)
    tensors = adapter.to_hf(model.state_dict())
    tensors = {k: (v.float() if adapter.forced_fp32(k) else v) for k, v in tensors.items()}
    write_safetensors(tensors, folder, max_shard_size=max_shard_size, safe_serialization=True)
