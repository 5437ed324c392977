"""Writing a safetensors folder tensor by tensor, never holding more than one file's worth of tensors.

What it is for: `ShardWriter` (a stream of `(key, tensor)` written into safetensors files of at most a byte budget:
a file is written as soon as the next tensor would overflow it, so the writer holds at most one budget of tensors,
and counts what it held) and `finish_shard_files` (the files of one or several writers renamed to transformers'
names — `model.safetensors` alone, else `model-0000i-of-0000n.safetensors` — with `model.safetensors.index.json`
naming the file of every key). A distributed export runs one writer per rank that writes (e.g. one per pipeline
stage) and `finish_shard_files` once, on one rank, with what every writer reported: no tensor crosses ranks there.
What it must not do: know models or issue collectives (the caller gathers each tensor to its writer), or hold
more than one file's tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .safetensors_files import INDEX_FILE, SINGLE_FILE

__all__ = ["FileLayout", "ShardFile", "ShardWriter", "finish_shard_files", "parse_shard_size"]


@dataclass(frozen=True)
class FileLayout:
    """How a model's `save_pretrained` writes it, usable tensor by tensor (the model packages' `hf_file_layout`).

    `to_file({model name: full tensor})` -> the file's entries (its names and dtypes; {} for a tensor the save leaves
    out, e.g. a tied head): a streaming export calls it once per tensor (or per self-sharding module), a whole save
    once with every tensor. `write_metadata(folder)` writes what the save writes besides the weights (config.json,
    generation_config.json), reading no weight."""

    to_file: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    write_metadata: Callable[[Path], None]


_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_shard_size(size: int | str) -> int:
    """Bytes of a shard budget given as transformers' `max_shard_size` spells it: an int, or "5GB" / "200MB" /
    "64KB" (decimal units, as huggingface_hub parses them).

    Raises:
        ValueError: not a positive size in those units.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and size.strip()[-2:].upper() in _SIZE_UNITS:
        text = size.strip()
        try:
            value = int(float(text[:-2]) * _SIZE_UNITS[text[-2:].upper()])
        except ValueError:
            value = 0
    else:
        value = 0
    if value <= 0:
        raise ValueError(f"shard size {size!r} is not a positive size: give bytes (int) or e.g. '5GB', '200MB', '64KB'")
    return value


@dataclass(frozen=True)
class ShardFile:
    """One file a `ShardWriter` wrote: its name in the folder (provisional until `finish_shard_files`), the keys
    it holds in write order, and their tensor bytes."""

    name: str
    keys: tuple[str, ...]
    nbytes: int


class ShardWriter:
    """Write `(key, tensor)` pairs into safetensors files of at most `max_shard_bytes` of tensor data each.

    `add` keeps the tensor until the file it belongs to is written: when the next tensor would take the held bytes
    over the budget, the held tensors are written first (a tensor bigger than the budget gets a file of its own, as
    transformers does). `held_bytes` / `peak_held_bytes` count the tensor bytes the writer holds; `peak_held_bytes`
    never exceeds `max(max_shard_bytes, the biggest tensor)`. Files are named `{prefix}-{n:05d}.safetensors.partial`
    (n from 0) until `finish_shard_files` gives them their final names; every file's header carries `metadata`
    (default `{"format": "pt"}`, what transformers and huggingface_hub write). A context manager (closed on exit).

    tensors: any device and dtype; moved to the CPU and made contiguous on `add`. A view that shares storage with
    other tensors (e.g. one expert of a stacked `[E, out, in]` tensor) is copied, so only its own bytes are held.

    Raises:
        ValueError: a key added twice, or `max_shard_bytes` not positive.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        max_shard_bytes: int,
        prefix: str = "model",
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self.prefix = prefix
        self.metadata = dict(metadata) if metadata is not None else {"format": "pt"}
        self.files: list[ShardFile] = []
        self.held_bytes = 0  # tensor bytes held now
        self.peak_held_bytes = 0  # the most tensor bytes held at once
        self._held: dict[str, torch.Tensor] = {}
        self._seen: set[str] = set()
        self.folder.mkdir(parents=True, exist_ok=True)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Hold `tensor` under `key`, writing the held file first when `tensor` would overflow it."""
        if key in self._seen:
            raise ValueError(f"{key} was already written by this writer; every key goes into one file once")
        self._seen.add(key)
        tensor = tensor.detach().to("cpu")
        if _shares_storage(tensor):
            tensor = tensor.clone()  # only its own bytes; safetensors refuses tensors that share storage
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self._held and self.held_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self._held[key] = tensor
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def flush(self) -> None:
        """Write the held tensors (if any) as the next file and let them go."""
        if not self._held:
            return
        from safetensors.torch import save_file

        name = f"{self.prefix}-{len(self.files):05d}.safetensors.partial"
        save_file(self._held, str(self.folder / name), metadata=dict(self.metadata))
        self.files.append(ShardFile(name, tuple(self._held), self.held_bytes))
        self._held = {}
        self.held_bytes = 0

    def close(self) -> list[ShardFile]:
        """Write what is held; returns every file written, in order."""
        self.flush()
        return list(self.files)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()


def _shares_storage(tensor: torch.Tensor) -> bool:
    storage_bytes = tensor.untyped_storage().nbytes()
    return tensor._base is not None or storage_bytes != tensor.numel() * tensor.element_size()


def finish_shard_files(
    folder: str | os.PathLike[str], files: Sequence[ShardFile], *, metadata: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """Give the files of every writer (in the order given) their final names and write the index; reads no tensor.

    One file: `model.safetensors`, no index (what `save_pretrained` writes for a model under its shard size).
    Several: `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json` =
    `{"metadata": {"total_size": <tensor bytes>, **metadata}, "weight_map": {key: file}}` (huggingface_hub's
    format). Returns the weight map (key -> final file name).

    Raises:
        ValueError: a key written by two files (all listed), or no file at all.
    """
    folder = Path(folder)
    if not files:
        raise ValueError(f"no safetensors file was written into {folder}: nothing to finish")
    owners: dict[str, list[str]] = {}
    for file in files:
        for key in file.keys:
            owners.setdefault(key, []).append(file.name)
    twice = {key: names for key, names in owners.items() if len(names) > 1}
    if twice:
        shown = "; ".join(f"{key} in {names}" for key, names in sorted(twice.items())[:10])
        raise ValueError(f"{len(twice)} key(s) were written more than once into {folder}: {shown}")
    if len(files) == 1:
        final = [SINGLE_FILE]
    else:
        final = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    weight_map: dict[str, str] = {}
    for file, name in zip(files, final, strict=True):
        os.replace(folder / file.name, folder / name)
        weight_map.update(dict.fromkeys(file.keys, name))
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(file.nbytes for file in files), **(metadata or {})},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return weight_map
