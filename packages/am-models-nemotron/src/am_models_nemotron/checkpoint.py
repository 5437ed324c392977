"""HF-format checkpoint folders: config.json plus safetensors, single file or sharded with an index.

What it is for: `load_pretrained` (read the config, build the model on the meta device, read every tensor, convert
names with `NemotronV3StateDictAdapter`, load strictly) and `save_pretrained` (NVIDIA naming, shards +
`model.safetensors.index.json` above `max_shard_size` bytes). Tensors pinned by the model's
`_keep_in_fp32_modules_strict` (the adapter's `forced_fp32`) are loaded as fp32 and stored as F32.
What it must not do: load partially. Missing or unexpected keys and shape mismatches raise one error listing all of
them; an unreadable, truncated or corrupt file raises an error naming the file. Save a sharded model (expert
parallel or FSDP2 DTensors): gather it into an unsharded model first (see `save_pretrained`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import am_moe
from am_precision import cast_model_to_dtype

from .config import as_hf_config
from .state_dict_adapter import NemotronV3StateDictAdapter

__all__ = ["load_pretrained", "read_safetensors_folder", "save_pretrained", "write_safetensors_folder"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensors[key] = handle.get_tensor(key)
    except Exception as err:  # safetensors raises SafetensorError / OSError / ValueError for damaged files
        raise ValueError(
            f"Cannot read safetensors file {path}: {type(err).__name__}: {err}. The file is truncated, corrupt or "
            "not a safetensors file; re-download or re-save the checkpoint."
        ) from err
    return tensors


def read_safetensors_folder(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a folder: `model.safetensors.index.json` shards, else `model.safetensors`.

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
            raise ValueError(f"Malformed shard index {index_path}: {err}") from err
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise FileNotFoundError(f"Shards listed in {index_path} are missing from {root}: {missing}")
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(_read_file(root / shard))
        absent = sorted(k for k, s in weight_map.items() if k not in tensors)
        if absent:
            raise ValueError(f"Tensors listed in {index_path} are absent from their shards: {absent}")
        return tensors
    single = root / SINGLE_FILE
    if single.is_file():
        return _read_file(single)
    raise FileNotFoundError(f"No {SINGLE_FILE} or {INDEX_FILE} in {root}.")


def write_safetensors_folder(
    tensors: dict[str, torch.Tensor], folder: str | os.PathLike[str], *, max_shard_size: int | None = None
) -> None:
    """Write `tensors` as `model.safetensors`, or as numbered shards plus an index when they exceed `max_shard_size`
    bytes."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    total = sum(t.numel() * t.element_size() for t in contiguous.values())
    metadata = {"format": "pt"}
    if max_shard_size is None or total <= max_shard_size:
        save_file(contiguous, str(root / SINGLE_FILE), metadata=metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(contiguous):
        nbytes = contiguous[key].numel() * contiguous[key].element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = contiguous[key]
        size += nbytes
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _load_config(folder: Path) -> Any:
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"No config.json in {folder}.")
    return as_hf_config(AutoConfig.from_pretrained(str(folder)))


def load_pretrained(
    cls: Any,
    path: str | os.PathLike[str],
    *,
    backend: Any = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **model_kwargs: Any,
) -> Any:
    """Build `cls` from the folder's config and load every parameter and buffer strictly.

    Args:
        dtype: cast after loading with `cast_model_to_dtype` (fp32-pinned tensors stay fp32); None keeps the
            checkpoint's dtypes.
        device: where the loaded tensors go (default CPU).

    Raises:
        ValueError: missing / unexpected keys or shape mismatches (all listed), or an unreadable file (named).
    """
    folder = Path(path)
    config = _load_config(folder)
    adapter = NemotronV3StateDictAdapter(config)
    raw = read_safetensors_folder(folder)
    state_dict = adapter.from_hf(raw)
    file_names = {adapter._internal_name(key): key for key in raw}  # internal name -> the file's own name
    # A checkpoint written elsewhere may hold pinned tensors in bf16; they are loaded (assigned) as fp32.
    state_dict = {
        k: (v.float() if v.is_floating_point() and adapter.forced_fp32(k) else v) for k, v in state_dict.items()
    }
    model = cls(config, backend, device="meta", **model_kwargs)
    expected = model.state_dict()
    # Reported in the checkpoint's own naming (`backbone.layers.0.mixer.A_log`, per-expert tensors), not ours.
    missing = sorted(adapter.to_hf({k: expected[k] for k in set(expected) - set(state_dict)}))
    unexpected = sorted(file_names.get(k, k) for k in set(state_dict) - set(expected))
    mismatched = sorted(
        f"{file_names.get(k, k)}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(expected) & set(state_dict)
        if tuple(state_dict[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {missing}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
        if mismatched:
            parts.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
        raise ValueError(
            f"Checkpoint {folder} does not match {cls.__name__} built from its config.json:\n  - "
            + "\n  - ".join(parts)
        )
    target = torch.device(device) if device is not None else torch.device("cpu")
    model.load_state_dict({k: v.to(target) for k, v in state_dict.items()}, strict=True, assign=True)
    _materialize_unsaved_buffers(model, target)
    if dtype is not None:
        cast_model_to_dtype(model, dtype)
    return model


def _materialize_unsaved_buffers(model: Any, device: torch.device) -> None:
    """Buffers no checkpoint holds are still on the meta device after an `assign=True` load: am-moe's per-expert load
    counters (non-persistent) start at zero on `device`; anything else left on meta is an error, never a silent hole."""
    for _, experts in am_moe.expert_modules(model):
        if experts.tokens_per_expert.is_meta:
            experts.tokens_per_expert = torch.zeros_like(experts.tokens_per_expert, device=device)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{type(model).__name__}: tensors left uninitialized (meta) after loading: {left}")


def _state_dict_to_save(model: Any, state_dict: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The state dict `save_pretrained` writes: `state_dict` when given (it must name exactly the model's keys),
    else `model.state_dict()`; every tensor must be full (no sharded DTensor). Raises one ValueError listing every
    problem."""
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
    sharded = sorted(k for k, v in tensors.items() if _is_dtensor(v))
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
    model: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write config.json (transformers' NemotronHConfig) and the weights in NVIDIA's naming; fp32-pinned tensors
    (`_keep_in_fp32_modules_strict`) are stored as F32 even from a model cast with a plain `.to(bfloat16)`.

    state_dict: the full state dict to write instead of `model.state_dict()` (transformers' `save_pretrained`
    option). For an expert-parallel model every rank calls
    `full = {**model.state_dict(), **am_moe.gather_expert_state_dict(model)}` (collective: the experts are gathered
    back to `[E, out, in]`), then one rank calls `save_pretrained(model, path, state_dict=full)`; the adapter writes
    the per-expert keys of the file.

    Raises:
        ValueError: sharded DTensors (expert parallel / FSDP2) in what would be written, or a state_dict whose keys
            differ from the model's (all listed).
    """
    tensors = _state_dict_to_save(model, state_dict)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = as_hf_config(model.config)
    config.architectures = ["NemotronHForCausalLM"]
    # The constructor may override the MTP depth count; the saved config must describe the saved weights.
    config.num_nextn_predict_layers = model.mtp_config.num_layers if model.mtp is not None else 0
    config.save_pretrained(str(folder))
    adapter = NemotronV3StateDictAdapter(config)
    tensors = adapter.to_hf(tensors)
    tensors = {k: (v.float() if adapter.forced_fp32(k) else v) for k, v in tensors.items()}
    write_safetensors_folder(tensors, folder, max_shard_size=max_shard_size)
