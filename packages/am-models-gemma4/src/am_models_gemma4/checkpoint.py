"""HF-format checkpoint folders for the Gemma 4 models: config.json plus safetensors (one file or shards + index).

What it is for: `load_pretrained(cls, folder)` (read the config with transformers' `AutoConfig`, build the model,
read every tensor, convert names with `Gemma4StateDictAdapter`, load strictly) and `save_pretrained(model, folder)`
(transformers' names and layouts, the tied LM head saved once, optional shards).
What it must not do: load partially. Missing or unexpected keys and shape mismatches raise one error listing all of
them; an unreadable, truncated or corrupt file raises an error naming the file. The only keys skipped on load are
the ones transformers skips too: a tied `lm_head.weight`, and K/V weights of KV-shared layers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from am_precision import cast_model_to_dtype

from .config import kv_sharing_modes, text_config_of
from .state_dict_adapter import Gemma4StateDictAdapter

__all__ = ["load_pretrained", "read_safetensors_folder", "save_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARED_KV_KEY = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")

ModelT = TypeVar("ModelT", bound=nn.Module)


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensors[key] = handle.get_tensor(key)
    except Exception as err:  # safetensors raises SafetensorError / OSError / ValueError for damaged files
        raise ValueError(
            f"cannot read safetensors file {path}: {type(err).__name__}: {err}. The file is truncated, corrupt or "
            "not a safetensors file; re-download or re-save the checkpoint"
        ) from err
    return tensors


def read_safetensors_folder(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a folder: the shards named by `model.safetensors.index.json`, else `model.safetensors`.

    Raises:
        FileNotFoundError: no index and no model.safetensors, or a shard named by the index is absent.
        ValueError: a file cannot be read (named), or the index is malformed.
    """
    root = Path(folder)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"malformed shard index {index_path}: {err}") from err
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} names shards that do not exist in {root}: {missing}")
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(_read_file(root / shard))
        return tensors
    single = root / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}; is this a safetensors checkpoint folder?")
    return _read_file(single)


def _skippable(key: str, config: Any, tied: bool) -> bool:
    if tied and key.endswith("lm_head.weight"):
        return True
    match = _SHARED_KV_KEY.search(key)
    if match is None or "vision_tower" in key or "audio_tower" in key:
        return False
    modes = kv_sharing_modes(text_config_of(config))
    index = int(match.group(1))
    return index < len(modes) and modes[index] == "reuse"


def _load_state_dict_strictly(model: nn.Module, state_dict: dict[str, torch.Tensor], folder: Path) -> None:
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", True))
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    provided = {k: v for k, v in state_dict.items() if k in expected or not _skippable(k, config, tied)}
    missing = sorted(set(expected) - set(provided))
    unexpected = sorted(set(provided) - set(expected))
    mismatched = [
        f"{k}: checkpoint {tuple(provided[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(expected) & set(provided))
        if tuple(provided[k].shape) != tuple(expected[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
    if problems:
        raise ValueError(
            f"checkpoint {folder} does not match {type(model).__name__} built from its config.json:\n  - "
            + "\n  - ".join(problems)
        )
    result = model.load_state_dict(provided, strict=False)
    leftover = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if leftover or result.unexpected_keys:  # cannot happen after the checks above; never load partially
        raise ValueError(f"checkpoint {folder}: load left {leftover} missing, {result.unexpected_keys} unexpected")


def load_pretrained(
    cls: type[ModelT],
    folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: Any = None,
) -> ModelT:
    """Build `cls` from `folder/config.json` and load every tensor; `dtype` casts with the fp32 contract kept.

    The model is built in fp32 and the checkpoint copied into it, so tensors stored in bf16 elsewhere load as fp32;
    with `dtype=torch.bfloat16` everything except the tensors `cls._keep_in_fp32_modules(_strict)` pins is cast
    after loading (`cast_model_to_dtype`).

    Raises:
        ValueError: missing/unexpected keys or shape mismatches (all listed), an unreadable file (named).
        FileNotFoundError: no config.json or no safetensors files.
    """
    from transformers import AutoConfig

    root = Path(folder)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {root}; save_pretrained writes one next to the weights")
    config = AutoConfig.from_pretrained(str(root))
    tensors = Gemma4StateDictAdapter.from_hf(read_safetensors_folder(root))
    model = cls(config)
    _load_state_dict_strictly(model, tensors, root)
    if device is not None:
        model.to(device)
    if dtype is not None and dtype != torch.float32:
        cast_model_to_dtype(model, dtype)
    return model


def _state_dict_to_save(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The state dict `save_pretrained` writes: `state_dict` when given (it must name exactly the model's keys),
    else `model.state_dict()`; every tensor must be full (no sharded DTensor). Raises one ValueError listing every
    problem."""
    from torch.distributed.tensor import DTensor

    own = model.state_dict()
    tensors = dict(own if state_dict is None else state_dict)
    problems = []
    if state_dict is not None:
        missing = sorted(set(own) - set(tensors))
        unexpected = sorted(set(tensors) - set(own))
        if missing:
            problems.append(f"state_dict lacks {len(missing)} of the model's keys: {missing[:5]}")
        if unexpected:
            problems.append(f"state_dict has {len(unexpected)} keys the model does not: {unexpected[:5]}")
    sharded = sorted(k for k, v in tensors.items() if isinstance(v, DTensor))
    if sharded:
        problems.append(
            f"{len(sharded)} tensors are sharded DTensors (expert parallel / FSDP2), e.g. {sharded[:3]}: gather "
            "them on every rank first — `{**model.state_dict(), **am_moe.gather_expert_state_dict(model)}` for "
            "expert parallelism, `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))` "
            "with FSDP2 — and pass the result as state_dict= on one rank"
        )
    if problems:
        raise ValueError("save_pretrained needs the full state dict of the model:\n  - " + "\n  - ".join(problems))
    return tensors


def save_pretrained(
    model: nn.Module,
    folder: str | os.PathLike[str],
    *,
    max_shard_size: int | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write `config.json` and the weights with transformers' names (tied LM head once; shards above the size).

    state_dict: the full state dict to write instead of `model.state_dict()` (transformers' `save_pretrained`
    option). For an expert-parallel model every rank calls
    `full = {**model.state_dict(), **am_moe.gather_expert_state_dict(model)}` (collective: the experts are gathered
    back to `[E, out, in]`), then one rank calls `save_pretrained(model, folder, state_dict=full)`.

    Raises:
        ValueError: sharded DTensors (expert parallel / FSDP2) in what would be written, or a state_dict whose keys
            differ from the model's (all listed).
    """
    tensors = _state_dict_to_save(model, state_dict)
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    config: Any = model.config
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(root))
    tied = bool(getattr(config, "tie_word_embeddings", True))
    state = {k: v for k, v in tensors.items() if not (tied and k == "lm_head.weight")}
    hf_state = {k: v.detach().contiguous().cpu() for k, v in Gemma4StateDictAdapter.to_hf(state).items()}
    metadata = {"format": "pt"}
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    if max_shard_size is None or total <= max_shard_size:
        save_file(hf_state, str(root / SINGLE_FILE), metadata=metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in hf_state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
