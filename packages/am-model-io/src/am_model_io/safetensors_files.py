"""Safetensors checkpoint folders, read tensor by tensor or block by block, and written by huggingface_hub.

What it is for: `LazyCheckpoint` (a folder's `model.safetensors.index.json` shards or `model.safetensors`: keys,
shapes and dtypes from the file headers before any data is read, one tensor or one block of a tensor at a time),
`checked_sources` (a checkpoint's names and shapes checked strictly against a model's, from the headers),
`load_sharded_tensors_` (fill a materialized, possibly sharded model, each rank reading only the blocks it holds),
`read_safetensors_folder` (everything at once, for inspection and tests) and `write_safetensors` (shards and the
index file are huggingface_hub's, imported when called).
What it must not do: know model names or layouts (each model package's state-dict adapter and `checkpoint.py` do),
read a whole checkpoint into memory on the loading paths, or accept an option it does not honour.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .materialize import local_region

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "LazyCheckpoint",
    "ShardedLoad",
    "checked_sources",
    "load_sharded_tensors_",
    "read_safetensors_folder",
    "write_safetensors",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class LazyCheckpoint:
    """The tensors of a folder (`model.safetensors.index.json` shards, else `model.safetensors`), read one at a time.

    Keys, shapes and dtypes come from the file headers (`meta_state_dict`) before any data is read; `read(key)`
    materialises one tensor. Use as a context manager (handles are closed on exit).

    Raises:
        FileNotFoundError: no index and no model.safetensors, or a shard named by the index is absent.
        ValueError: a file cannot be read (named), the index is malformed, or names tensors its shards lack.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self._handles: dict[Path, Any] = {}
        self.bytes_read = 0  # tensor data read so far (`read`, `read_block`); headers are not counted
        index_path = self.folder / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"Malformed shard index {index_path}: {err}") from err
            files = sorted({self.folder / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"Shards listed in {index_path} are missing from {self.folder}: {missing}")
        elif (self.folder / SINGLE_FILE).is_file():
            files = [self.folder / SINGLE_FILE]
        else:
            raise FileNotFoundError(f"No {SINGLE_FILE} or {INDEX_FILE} in {self.folder}.")
        self.file_of: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in files:
            handle = self._open(file)
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                piece = handle.get_slice(key)
                self.file_of[key] = file
                self._meta[key] = (tuple(piece.get_shape()), piece.get_dtype())
        if index_path.is_file():
            absent = sorted(k for k in weight_map if k not in self.file_of)
            if absent:
                raise ValueError(f"Tensors listed in {index_path} are absent from their shards: {absent}")

    def _open(self, file: Path) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt").__enter__()
            except (SafetensorError, OSError) as err:  # what safetensors raises for a damaged or unreadable file
                raise ValueError(
                    f"Cannot read safetensors file {file}: {type(err).__name__}: {err}. The file is truncated, "
                    "corrupt or not a safetensors file; re-download or re-save the checkpoint."
                ) from err
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self.file_of)

    def meta_state_dict(self, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Meta tensors with the stored shapes and dtypes (no data read)."""
        out = {}
        for key in self.file_of if keys is None else keys:
            shape, dtype = self._meta[key]
            out[key] = torch.empty(shape, dtype=_SAFETENSORS_DTYPES.get(dtype, torch.uint8), device="meta")
        return out

    def source_shape(self, source: str | Sequence[str]) -> tuple[int, ...] | None:
        """The shape `source` describes (header only): a key's stored shape, or for a tuple of keys their
        concatenation along dim 0 (e.g. transformers' per-expert `w1` and `w3` fused into one `gate_up` row); None
        when the pieces do not concatenate (different trailing dims, or a 0-d piece)."""
        if isinstance(source, str):
            return self._meta[source][0]
        shapes = [self._meta[key][0] for key in source]
        if not shapes or any(not shape or shape[1:] != shapes[0][1:] for shape in shapes):
            return None
        return (sum(shape[0] for shape in shapes), *shapes[0][1:])

    def read(self, key: str) -> torch.Tensor:
        """Materialise one tensor (CPU)."""
        return self._read_slices(key, ())

    def read_block(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """Materialise the block `[offset[d] : offset[d] + shape[d]]` of one tensor (CPU), reading only its bytes
        (`safe_open(...).get_slice`); a 0-d tensor is read whole."""
        stored = self._meta[key][0]
        if len(offset) != len(stored) or len(shape) != len(stored):
            raise ValueError(f"block {tuple(offset)} + {tuple(shape)} has the wrong rank for {key} of shape {stored}")
        return self._read_slices(key, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True)))

    def read_indexed(self, key: str, index: Sequence[slice | torch.Tensor]) -> torch.Tensor:
        """Materialise `full[index]` of one tensor (CPU), dim by dim, reading only the indexed elements: `index` has
        one entry per dim, a `slice` (step 1) or a 1-D integer tensor of indices in any order (a tensor whose rows
        transformers re-orders on load, e.g. `Interleave`'s even rows then odd rows). The distinct indices of a
        tensor entry are read in arithmetic runs (one stepped `get_slice` per run: `0, 2, 4, ..` is one read), then
        put in the asked order; a 0-d tensor is read whole."""
        stored = self._meta[key][0]
        if len(index) != len(stored):
            raise ValueError(f"index of {len(index)} dims for {key} of shape {stored}")
        if not stored:
            return self._read_slices(key, ())
        runs: list[list[slice]] = []
        orders: list[torch.Tensor | None] = []
        for entry in index:
            if isinstance(entry, slice):
                runs.append([entry])
                orders.append(None)
                continue
            wanted = entry.reshape(-1).to(torch.int64)
            distinct, order = torch.unique(wanted, sorted=True, return_inverse=True)
            runs.append(_arithmetic_runs(distinct.tolist()))
            orders.append(None if torch.equal(distinct, wanted) else order)
        if any(not dim_runs for dim_runs in runs):  # no index on some dim: an empty block
            sizes = [
                len(range(*e.indices(n))) if isinstance(e, slice) else e.numel()
                for e, n in zip(index, stored, strict=True)
            ]
            return torch.empty(sizes, dtype=_SAFETENSORS_DTYPES.get(self._meta[key][1], torch.uint8))

        def assemble(dim: int, picked: tuple[slice, ...]) -> torch.Tensor:
            if dim == len(runs):
                return self._read_slices(key, picked)
            pieces = [assemble(dim + 1, (*picked, run)) for run in runs[dim]]
            return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]

        block = assemble(0, ())
        for dim, order in enumerate(orders):
            if order is not None:
                block = block.index_select(dim, order)
        return block

    def _read_slices(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """`get_slice(key)[index]` (the whole tensor for `()`), counted in `bytes_read`; a damaged file named."""
        file = self.file_of[key]
        try:
            handle = self._open(file)
            tensor = handle.get_slice(key)[index] if index else handle.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise ValueError(
                f"Cannot read tensor {key} from safetensors file {file}: {type(err).__name__}: {err}. The file is "
                "truncated or corrupt; re-download or re-save the checkpoint."
            ) from err
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read_source_block(
        self, source: str | Sequence[str], offset: Sequence[int], shape: Sequence[int]
    ) -> torch.Tensor:
        """`read_block` of a key, or of the concatenation along dim 0 of a tuple of keys (`source_shape`): each
        piece's rows in `[offset[0], offset[0] + shape[0])` are read with `get_slice`, nothing else."""
        if isinstance(source, str):
            return self.read_block(source, offset, shape)
        start, pieces = 0, []
        for key in source:
            stored = self._meta[key][0]
            low, high = max(offset[0], start), min(offset[0] + shape[0], start + stored[0])
            if low < high:
                pieces.append(self.read_block(key, (low - start, *offset[1:]), (high - low, *shape[1:])))
            start += stored[0]
        if not pieces:
            dtype = _SAFETENSORS_DTYPES.get(self._meta[source[0]][1], torch.uint8)
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_safetensors_folder(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a folder (`model.safetensors.index.json` shards, else `model.safetensors`) in memory at once;
    for inspection and tests (loading reads tensor by tensor, see `LazyCheckpoint`).

    Raises:
        FileNotFoundError: no index and no model.safetensors, or a shard named by the index is absent.
        ValueError: a file cannot be read (named), or the index is malformed.
    """
    with LazyCheckpoint(folder) as checkpoint:
        return {key: checkpoint.read(key) for key in checkpoint.names()}


@dataclass(frozen=True)
class ShardedLoad:
    """What `load_sharded_tensors_` did on this rank: the model's names it filled and the tensor bytes it read from
    the files (this rank's blocks only; compare with the checkpoint's total to see that nothing else was read)."""

    names: tuple[str, ...]
    bytes_read: int


def checked_sources(
    checkpoint: LazyCheckpoint,
    model_name: str,
    *,
    expected: Mapping[str, torch.Tensor],
    adapter: Any,
    skip: Callable[[str], bool] | None = None,
) -> dict[str, list[str]]:
    """The model's name -> the checkpoint keys it is read from, for every tensor of `expected`, after the strict check
    (`load_state_dict(strict=True)`'s rule) of every name and shape, from the file headers (no data read).

    Args:
        expected: the tensors the model loads, by the model's names (meta tensors suffice: shapes only).
        adapter: the model's checkpoint layout: `internal_key(file key)` -> the model's name it fills (several keys
            for per-expert tensors stacked into one), `from_hf` / `to_hf` convert state dicts between the file's
            names and the model's; missing tensors are named as `to_hf` would write them, so every key in the error
            is in the files' naming.
        skip: file keys the loader ignores unless their name is expected (e.g. the K/V weights of KV-shared layers,
            which transformers skips too); None: none.

    Raises:
        ValueError: the checkpoint does not match `model_name`: every missing and unexpected key and every shape
            mismatch, listed at once (and whatever `adapter.from_hf` refuses, e.g. an incomplete expert set).
    """
    sources: dict[str, list[str]] = {}
    for key in checkpoint.names():
        name = adapter.internal_key(key)
        if name in expected or skip is None or not skip(key):
            sources.setdefault(name, []).append(key)
    provided = adapter.from_hf(checkpoint.meta_state_dict([key for keys in sources.values() for key in keys]))
    missing = sorted(adapter.to_hf({k: expected[k] for k in expected.keys() - provided.keys()}))
    unexpected = sorted(key for k in provided.keys() - expected.keys() for key in sources[k])
    mismatched = sorted(
        f"{_short(sources[k])}: checkpoint {tuple(provided[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected.keys() & provided.keys()
        if tuple(provided[k].shape) != tuple(expected[k].shape)
    )
    problems = [
        f"{what} ({len(keys)}): {keys}"
        for what, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched))
        if keys
    ]
    if problems:
        listed = "\n  - ".join(problems)
        raise ValueError(
            f"checkpoint {checkpoint.folder} does not match {model_name} built from its config.json:\n  - {listed}"
        )
    return {name: list(sources[name]) for name in expected}


@torch.no_grad()
def load_sharded_tensors_(
    model: nn.Module, checkpoint: LazyCheckpoint, sources: Mapping[str, Sequence[str | Sequence[str]]]
) -> ShardedLoad:
    """Copy into every parameter and buffer of `model` named in `sources` the block this rank holds, reading only
    that block from the files.

    model: materialized (e.g. `to_empty`) and possibly sharded: plain tensors are read whole, DTensors (FSDP2,
        expert parallel, tensor parallel; full logical shape) read their `local_region` block only.
    sources: the model's name -> the checkpoint keys it is read from, as the model's state-dict adapter decides:
        one key (the tensor itself, renamed), or several entries stacked along a new dim 0 in the given order (e.g.
        the per-expert `experts.{e}.up_proj.weight` of a `[E, I, H]` stack; a rank holding experts [a, b) reads
        entries a..b-1 only). A stacked entry may be a tuple of keys, concatenated along its dim 0 (transformers'
        fused experts: `(experts.{e}.w1.weight, experts.{e}.w3.weight)` is row e of a `[E, 2I, H]` `gate_up_proj`);
        a rank reads only the pieces' rows its block covers. Check names and shapes on the files' headers first
        (the model packages' loaders do).

    Values are cast to the target's dtype on copy. Returns the names copied (the model's names present in
    `sources`) and the bytes read; names of `model` absent from `sources` are left untouched.

    Raises:
        ValueError: a target still on the meta device, or a stored shape that does not match the target's full
            shape (all listed, before any data is read).
    """
    targets = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    names = [name for name in targets if name in sources]
    problems = []
    for name in names:
        target, keys = targets[name], list(sources[name])
        if target.is_meta:
            problems.append(f"{name} is on the meta device: materialize the model first (to_empty)")
            continue
        stored = [checkpoint.source_shape(key) for key in keys]
        unfit = [entry for entry, shape in zip(keys, stored, strict=True) if shape is None]
        if unfit:
            shapes = [(key, checkpoint._meta[key][0]) for key in unfit[0]]
            problems.append(f"{name}: the pieces of {_short(unfit[:1])} do not concatenate along dim 0: {shapes}")
            continue
        single = len(keys) == 1 and isinstance(keys[0], str)
        full = stored[0] if single else (len(keys), *(stored[0] or ()))
        if any(shape != stored[0] for shape in stored) or tuple(full or ()) != tuple(target.shape):
            problems.append(f"{name}: checkpoint {_short(keys)} has shape {full}, the model {tuple(target.shape)}")
    if problems:
        raise ValueError("load_sharded_tensors_:\n  - " + "\n  - ".join(problems))
    start = checkpoint.bytes_read
    # File by file, each file's handle closed before the next one: the pages of a memory-mapped file that were read
    # count in the rank's resident memory until it is unmapped, so at most one file's pages stay mapped.
    names.sort(key=lambda name: str(checkpoint.file_of[_first_key(sources[name])]))
    for position, name in enumerate(names):
        target, keys = targets[name], list(sources[name])
        offset, shape = local_region(target)
        if len(keys) == 1 and isinstance(keys[0], str):
            block = checkpoint.read_block(keys[0], offset, shape)
        else:
            rows = keys[offset[0] : offset[0] + shape[0]]
            pieces = [checkpoint.read_source_block(key, offset[1:], shape[1:]) for key in rows]
            block = torch.stack(pieces) if pieces else torch.empty(shape, dtype=target.dtype)
        to_local = getattr(target, "to_local", None)
        local = to_local() if callable(to_local) else target
        local.copy_(block)
        del block  # one block in flight at a time
        following = names[position + 1] if position + 1 < len(names) else None
        following_file = None if following is None else checkpoint.file_of[_first_key(sources[following])]
        if following_file != checkpoint.file_of[_first_key(keys)]:
            checkpoint.close()  # reopened on the next read
    return ShardedLoad(tuple(names), checkpoint.bytes_read - start)


def _arithmetic_runs(values: list[int]) -> list[slice]:
    """Sorted distinct indices as the fewest greedy arithmetic runs, each a `slice(start, stop, step)`."""
    runs: list[slice] = []
    position = 0
    while position < len(values):
        start = values[position]
        if position + 1 == len(values):
            runs.append(slice(start, start + 1, 1))
            break
        step = values[position + 1] - start
        end = position + 1
        while end + 1 < len(values) and values[end + 1] - values[end] == step:
            end += 1
        runs.append(slice(start, values[end] + 1, step))
        position = end + 1
    return runs


def _first_key(keys: Sequence[str | Sequence[str]]) -> str:
    first = keys[0]
    return first if isinstance(first, str) else first[0]


def _short(keys: Sequence[str | Sequence[str]]) -> str:
    def one(entry: str | Sequence[str]) -> str:
        return entry if isinstance(entry, str) else " + ".join(entry)

    return one(keys[0]) if len(keys) == 1 else f"{one(keys[0])} .. {one(keys[-1])} ({len(keys)} tensors)"


def write_safetensors(
    tensors: dict[str, torch.Tensor],
    folder: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None,
) -> None:
    """`model.safetensors`, or shards + `model.safetensors.index.json` above `max_shard_size` ("5GB", bytes; None:
    one file), written by `huggingface_hub.save_torch_state_dict`."""
    from huggingface_hub import save_torch_state_dict

    # Tensors that share storage (views of one stacked tensor) are written as separate tensors, not deduplicated.
    owned = {k: v.detach().cpu().clone() if _is_view(v) else v.detach().cpu() for k, v in tensors.items()}
    save_torch_state_dict(
        owned,
        Path(folder),
        max_shard_size=max_shard_size if max_shard_size is not None else 2**62,
        metadata={"format": "pt"},
    )


def _is_view(tensor: torch.Tensor) -> bool:
    storage_bytes = tensor.untyped_storage().nbytes()
    return tensor._base is not None or storage_bytes != tensor.numel() * tensor.element_size()
