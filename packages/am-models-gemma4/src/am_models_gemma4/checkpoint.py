"""HF-format checkpoint folders for the Gemma 4 models: config.json plus safetensors (one file or shards + index).

What it is for: the models' `from_pretrained` and `save_pretrained` (`Gemma4PreTrainedModel` binds these functions).
`load_pretrained(cls, folder_or_hub_id)` reads the config with transformers' `AutoConfig`, builds the model, checks
every tensor name and shape from the file headers, then copies tensor by tensor — converted by
`Gemma4StateDictAdapter` — into the model, so a sharded checkpoint is never held in memory next to the model.
`save_pretrained(model, folder)` writes transformers' names and layouts, the tied LM head once, shards + index
written by huggingface_hub.
What it must not do: load partially. Missing or unexpected keys and shape mismatches raise one error listing all of
them; an unreadable, truncated or corrupt file raises an error naming the file. The only keys skipped on load are
the ones transformers skips too: a tied `lm_head.weight`, and K/V weights of KV-shared layers.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from typing import Any, TypeVar, Unpack

import torch
from torch import nn

from am_model_io import (
    FileLayout,
    HubOptions,
    LazyCheckpoint,
    ShardedLoad,
    checked_sources,
    load_hf_config,
    load_sharded_tensors_,
    pretrained_saver,
    resolve_checkpoint_folder,
    resolve_device,
    resolve_dtype,
    split_pretrained_kwargs,
)
from am_precision import cast_model_to_dtype

from .config import kv_sharing_modes, text_config_of
from .state_dict_adapter import Gemma4StateDictAdapter, NativeStateDictLayout, checkpoint_adapter

__all__ = ["load_pretrained", "load_sharded_checkpoint", "save_pretrained"]

_SHARED_KV_KEY = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")

ModelT = TypeVar("ModelT", bound=nn.Module)


def _skippable(key: str, config: Any, tied: bool) -> bool:
    if tied and key.endswith("lm_head.weight"):
        return True
    match = _SHARED_KV_KEY.search(key)
    if match is None or "vision_tower" in key or "audio_tower" in key:
        return False
    modes = kv_sharing_modes(text_config_of(config))
    index = int(match.group(1))
    return index < len(modes) and modes[index] == "reuse"


Layout = type[Gemma4StateDictAdapter] | type[NativeStateDictLayout]


def _backend_of(model: nn.Module) -> Any:
    """The `BackendConfig` the model was built with (its text model holds it; None: the defaults)."""
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if backend is not None and hasattr(backend, "enable_hf_state_dict_adapter"):
            return backend
    return None


def _check_names_and_shapes(
    model: nn.Module, checkpoint: LazyCheckpoint, layout: Layout = Gemma4StateDictAdapter
) -> dict[str, list[str]]:
    """Our name -> the checkpoint keys it is read from, after checking every name and shape (file headers only)."""
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", True))
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return checked_sources(
        checkpoint, type(model).__name__, expected=expected, adapter=layout, skip=lambda k: _skippable(k, config, tied)
    )


def load_pretrained(
    cls: type[ModelT],
    pretrained_model_name_or_path: str | os.PathLike[str],
    *,
    config: Any = None,
    torch_dtype: Any = None,
    dtype: Any = None,
    device_map: Any = None,
    device: Any = None,
    backend: Any = None,
    **kwargs: Any,
) -> ModelT:
    """Build `cls` from the checkpoint's config and copy every tensor in, one at a time.

    The model is built in fp32 and each tensor copied into it as it is read, so tensors stored in bf16 elsewhere
    load as fp32 and the checkpoint is never held next to the model; with `dtype=torch.bfloat16` everything except
    the tensors `cls._keep_in_fp32_modules(_strict)` pins is cast after loading (`cast_model_to_dtype`).

    Args:
        pretrained_model_name_or_path: a folder, or a hub id (`snapshot_download` at `revision`; `cache_dir`, `token`,
            `local_files_only`, `force_download` as in huggingface_hub).
        config: use this config instead of the folder's config.json (what `AutoModelForCausalLM` passes).
        torch_dtype / dtype: transformers' two names for the same option; "auto": the config's dtype.
        device_map / device: one device for the whole model (None: CPU); splitting across devices is refused.
            "meta": the model is built on the meta device and every name and shape checked against the files'
            headers, but no tensor data is read: shard it, then `load_sharded_checkpoint` gives each rank its blocks.
        backend: the model's `BackendConfig` (None: its defaults); with `enable_hf_state_dict_adapter=False` the
            folder holds the model's native keys (`layers.N.moe.*`) instead of transformers'.

    Raises:
        ValueError: missing/unexpected keys or shape mismatches (all listed), an unreadable file (named), or an
            option this loader cannot honour.
        FileNotFoundError: no config.json or no safetensors files.
    """
    hub = split_pretrained_kwargs(kwargs)
    if kwargs:
        raise TypeError(
            f"from_pretrained got keyword arguments it does not support: {sorted(kwargs)}; supported: config, "
            "torch_dtype/dtype, device_map, backend, revision, cache_dir, token, local_files_only, force_download"
        )
    root = resolve_checkpoint_folder(pretrained_model_name_or_path, **hub)
    if config is None:
        config = load_hf_config(root)
    target_dtype = resolve_dtype(torch_dtype=torch_dtype, dtype=dtype, config=config)
    target = resolve_device(device_map=device_map, device=device)
    built: dict[str, Any] = {} if backend is None else {"backend": backend}
    layout = checkpoint_adapter(backend)
    with LazyCheckpoint(root) as checkpoint:
        # "meta": the layout only, every name and shape checked, no data read
        with torch.device("meta") if target.type == "meta" else contextlib.nullcontext():
            model = cls(config, **built)
        sources = _check_names_and_shapes(model, checkpoint, layout)
        state = model.state_dict()
        with torch.no_grad():
            for name, keys in sources.items() if target.type != "meta" else ():
                (tensor,) = layout.from_hf({key: checkpoint.read(key) for key in keys}).values()
                state[name].copy_(tensor)
                del tensor  # before the next read: one tensor in flight at a time
    if target.type not in ("cpu", "meta"):
        model.to(target)
    if target_dtype is not None and target_dtype != torch.float32:
        cast_model_to_dtype(model, target_dtype)
    return model


def load_sharded_checkpoint(
    model: nn.Module,
    pretrained_model_name_or_path: str | os.PathLike[str],
    **hub: Unpack[HubOptions],
) -> ShardedLoad:
    """Load an HF-format checkpoint into an already-sharded Gemma 4 model, each rank reading only its own blocks.

    model: a `Gemma4ForCausalLM` or `Gemma4ForConditionalGeneration` built on the meta device (`from_config(config,
        device="meta")` or `from_pretrained(folder, device_map="meta")`), then split into a pipeline stage,
        expert-parallel (`apply_expert_parallel`: `[E, out, in]` stacks split over ep) and/or FSDP2-wrapped, then
        `to_empty(device=...)`. Plain tensors are read whole; DTensors read their own block
        (`safe_open(...).get_slice`). Names come from `Gemma4StateDictAdapter` (the native keys when the model's
        backend says `enable_hf_state_dict_adapter=False`).
    The strict check runs once, on the files' headers, against the whole model (`sharded.meta_twin`): missing or
    unexpected tensors and shape mismatches are named as the files name them. Buffers no checkpoint holds (RoPE
    frequencies, the embedding scale, expert load counters) are recomputed; a tied LM head is tied again. No
    collective: every rank calls it on its own.

    Returns `ShardedLoad`: the model's names loaded on this rank and the tensor bytes read.

    Raises:
        ValueError: missing / unexpected keys or shape mismatches (all listed), a tensor still on the meta device,
            an unreadable file (named).
        FileNotFoundError: no safetensors files.
    """
    from .sharded import meta_twin, restore_constructed_buffers_

    root = resolve_checkpoint_folder(pretrained_model_name_or_path, **hub)
    with LazyCheckpoint(root) as checkpoint:
        sources = _check_names_and_shapes(meta_twin(model), checkpoint, checkpoint_adapter(_backend_of(model)))
        report = load_sharded_tensors_(model, checkpoint, sources)
    restore_constructed_buffers_(model)
    model.tie_weights()  # type: ignore[operator]  # ties only when the config says so; to_empty untied it
    return report


def hf_file_layout(model: nn.Module) -> FileLayout:
    """How `save_pretrained` writes `model` (a whole model or a pipeline stage of it), tensor by tensor:
    transformers' names (the checkpoint adapter; the model's native keys when its backend says
    `enable_hf_state_dict_adapter=False`), the tied LM head left out, and config.json naming the model's class. A
    streaming export (one tensor at a time, e.g. the reference trainer's) uses it to write what `save_pretrained`
    writes."""
    config: Any = copy.deepcopy(model.config)
    # FSDP2 swaps in a class named "FSDP<cls>": the file names the model's own class, as transformers does
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    tied = bool(getattr(config, "tie_word_embeddings", True))
    adapter = checkpoint_adapter(_backend_of(model))

    def to_file(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return adapter.to_hf({k: v for k, v in tensors.items() if not (tied and k == "lm_head.weight")})

    return FileLayout(to_file, write_metadata=lambda folder: config.save_pretrained(str(folder)))


# (model, save_directory, *, max_shard_size="5GB", safe_serialization=True, state_dict=None): what hf_file_layout says
save_pretrained = pretrained_saver(hf_file_layout)
