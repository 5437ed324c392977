"""`ShardWriter` and `finish_shard_files`: a folder written tensor by tensor, within a byte budget per file.

Contract: the folder two writers stream (with `finish_shard_files` on their reports) reads back exactly the tensors
written (keys, dtypes, values), its index names every key in files that exist, each file holds at most the budget
unless it holds one bigger tensor, and a writer never holds more than max(budget, the biggest tensor) — counted by
the writer itself. One file ends as `model.safetensors` without an index, as `save_pretrained` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from am_model_io import (
    INDEX_FILE,
    SINGLE_FILE,
    ShardWriter,
    finish_shard_files,
    parse_shard_size,
    read_safetensors_folder,
)


def _tensors(seed: int, prefix: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"{prefix}.a": torch.randn(10, 10, generator=generator),  # 400 bytes
        f"{prefix}.b": torch.randn(30, generator=generator).to(torch.bfloat16),  # 60 bytes
        f"{prefix}.big": torch.randn(40, 10, generator=generator),  # 1600 bytes: above the budget
        f"{prefix}.c": torch.arange(7, dtype=torch.int64),  # 56 bytes
        f"{prefix}.d": torch.randn(5, 20, generator=generator),  # 400 bytes
    }


def test_two_writers_stream_a_sharded_folder_within_the_budget(tmp_path: Path) -> None:
    budget = 500
    first, second = _tensors(0, "stage0"), _tensors(1, "stage1")
    stacked = torch.randn(4, 3, 5)  # views of one stacked tensor: each written with its own bytes only
    reports = []
    for prefix, tensors in (("w0", first), ("w1", second)):
        writer = ShardWriter(tmp_path, max_shard_bytes=budget, prefix=prefix)
        for key, tensor in tensors.items():
            writer.add(key, tensor)
            assert writer.held_bytes <= max(budget, tensor.numel() * tensor.element_size())
        if prefix == "w1":
            for e, view in enumerate(stacked.unbind(0)):
                writer.add(f"experts.{e}", view)
        reports.append((writer.close(), writer.peak_held_bytes))
    files = [file for written, _ in reports for file in written]
    assert all(name.endswith(".partial") for name in (f.name for f in files))
    weight_map = finish_shard_files(tmp_path, files)

    expected = {**first, **second, **{f"experts.{e}": v for e, v in enumerate(stacked.unbind(0))}}
    got = read_safetensors_folder(tmp_path)
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key
    names = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert not list(tmp_path.glob("*.partial"))
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"] == weight_map
    assert weight_map.keys() == expected.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    for name in names:
        with safe_open(str(tmp_path / name), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            held = [handle.get_tensor(key) for key in handle.keys()]  # noqa: SIM118 - handles are not iterable
            sizes = [t.numel() * t.element_size() for t in held]
        assert sum(sizes) <= budget or len(sizes) == 1, (name, sizes)
    for _, peak in reports:
        assert budget < peak <= 1600  # the 1600-byte tensor is held alone; nothing else ever exceeds the budget


def test_one_file_is_model_safetensors_without_an_index(tmp_path: Path) -> None:
    tensors = _tensors(2, "m")
    with ShardWriter(tmp_path, max_shard_bytes=parse_shard_size("5GB")) as writer:
        for key, tensor in tensors.items():
            writer.add(key, tensor)
    assert finish_shard_files(tmp_path, writer.files) == dict.fromkeys(tensors, SINGLE_FILE)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]
    assert writer.peak_held_bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_key_twice_and_bad_sizes_are_refused(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "a", max_shard_bytes=100, prefix="a")
    writer.add("x", torch.zeros(2))
    with pytest.raises(ValueError, match="x was already written by this writer"):
        writer.add("x", torch.zeros(2))
    other = ShardWriter(tmp_path / "a", max_shard_bytes=100, prefix="b")
    other.add("x", torch.ones(2))
    with pytest.raises(ValueError, match=r"1 key\(s\) were written more than once .*x in \['a-00000"):
        finish_shard_files(tmp_path / "a", [*writer.close(), *other.close()])
    with pytest.raises(ValueError, match="no safetensors file was written"):
        finish_shard_files(tmp_path, [])
    with pytest.raises(ValueError, match="must be positive"):
        ShardWriter(tmp_path, max_shard_bytes=0)
    assert parse_shard_size("200MB") == 200_000_000
    assert parse_shard_size("64KB") == 64_000
    assert parse_shard_size(123) == 123
    for bad in ("5 apples", "-1GB", 0, "GB", True):
        with pytest.raises(ValueError, match="is not a positive size"):
            parse_shard_size(bad)  # type: ignore[arg-type]
