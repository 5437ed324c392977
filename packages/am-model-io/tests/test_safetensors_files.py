"""am_model_io: transformers' loading keywords resolved to one dtype / device, lazy safetensors folders,
and the huggingface_hub writer (shards + index). Model-level loading is tested in the model packages."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from am_model_io import (
    INDEX_FILE,
    SINGLE_FILE,
    LazyCheckpoint,
    checked_sources,
    load_sharded_tensors_,
    resolve_checkpoint_folder,
    resolve_device,
    resolve_dtype,
    write_safetensors,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(4, 8, 8, generator=g)
    return {
        "a.weight": torch.randn(64, 32, generator=g),
        "b.weight": torch.randn(32, dtype=torch.float64, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(10, dtype=torch.int64),
        # views of one storage are written as separate tensors (not deduplicated, not refused)
        **{f"experts.{i}.weight": stacked[i] for i in range(4)},
    }


@pytest.mark.parametrize("max_shard_size", [None, 4096])
def test_written_folder_reads_back_tensor_by_tensor(tmp_path: Path, max_shard_size: int | None) -> None:
    tensors = _tensors()
    write_safetensors(tensors, tmp_path, max_shard_size=max_shard_size)
    sharded = (tmp_path / INDEX_FILE).is_file()
    assert sharded == (max_shard_size is not None)
    assert (tmp_path / SINGLE_FILE).is_file() != sharded
    if sharded:
        assert len(set(json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"].values())) > 1
    with LazyCheckpoint(tmp_path) as ckpt:
        assert sorted(ckpt.names()) == sorted(tensors)
        meta = ckpt.meta_state_dict()
        for name, want in tensors.items():
            assert meta[name].device.type == "meta"
            assert (meta[name].shape, meta[name].dtype) == (want.shape, want.dtype)
            assert torch.equal(ckpt.read(name), want)


def test_missing_shard_and_damaged_file_are_named(tmp_path: Path) -> None:
    write_safetensors(_tensors(), tmp_path, max_shard_size=4096)
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    shard.rename(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match=shard.name):
        LazyCheckpoint(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=SINGLE_FILE):
        LazyCheckpoint(empty)
    (empty / SINGLE_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="Cannot read safetensors file"):
        LazyCheckpoint(empty)


def test_only_file_errors_are_reported_as_a_damaged_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors' own error and OS errors name the file; anything else (a bug) propagates unchanged."""
    import am_model_io.safetensors_files as hf_io

    write_safetensors(_tensors(), tmp_path, max_shard_size=None)

    def unreadable(path: str, framework: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(hf_io, "safe_open", unreadable)
    with pytest.raises(ValueError, match=f"Cannot read safetensors file .*{SINGLE_FILE}: PermissionError"):
        LazyCheckpoint(tmp_path)

    def buggy(path: str, framework: str) -> None:
        raise TypeError("a bug, not a damaged file")

    monkeypatch.setattr(hf_io, "safe_open", buggy)
    with pytest.raises(TypeError, match="a bug, not a damaged file"):
        LazyCheckpoint(tmp_path)


def test_dtype_spellings() -> None:
    config = SimpleNamespace(dtype="bfloat16")
    assert resolve_dtype(torch_dtype=None, dtype=None, config=config) is None
    assert resolve_dtype(torch_dtype="auto", dtype=None, config=config) == torch.bfloat16
    assert resolve_dtype(torch_dtype=None, dtype="torch.float16", config=config) == torch.float16
    assert resolve_dtype(torch_dtype=torch.float32, dtype=torch.float32, config=config) == torch.float32
    with pytest.raises(ValueError, match="disagree"):
        resolve_dtype(torch_dtype=torch.float32, dtype=torch.bfloat16, config=config)
    with pytest.raises(ValueError, match="not a torch dtype"):
        resolve_dtype(torch_dtype="float33", dtype=None, config=config)


def test_device_maps() -> None:
    assert resolve_device(device_map=None, device=None) == torch.device("cpu")
    assert resolve_device(device_map={"": "cpu"}, device=None) == torch.device("cpu")
    assert resolve_device(device_map=None, device=torch.device("cpu")) == torch.device("cpu")
    for spreading in ("auto", "balanced", {"model": 0, "lm_head": "cpu"}):
        with pytest.raises(ValueError, match="cannot be honoured"):
            resolve_device(device_map=spreading, device=None)
    with pytest.raises(ValueError, match="both given"):
        resolve_device(device_map="cpu", device="cpu")


def test_folders_and_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_checkpoint_folder(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="revision"):
        resolve_checkpoint_folder(tmp_path, revision="main")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        resolve_checkpoint_folder(tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        resolve_checkpoint_folder(str(tmp_path / "absent"))
    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        return str(tmp_path)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_checkpoint_folder("org/name", revision="v1") == tmp_path
    assert calls[0]["repo_id"] == "org/name"
    assert calls[0]["revision"] == "v1"
    assert "*.safetensors" in calls[0]["allow_patterns"]


def test_read_block_reads_only_the_block_and_counts_its_bytes(tmp_path: Path) -> None:
    tensors = _tensors()
    write_safetensors(tensors, tmp_path, max_shard_size=4096)
    with LazyCheckpoint(tmp_path) as checkpoint:
        block = checkpoint.read_block("a.weight", (16, 8), (8, 4))
        assert torch.equal(block, tensors["a.weight"][16:24, 8:12])
        assert checkpoint.bytes_read == 8 * 4 * 4
        checkpoint.read("c.ids")
        assert checkpoint.bytes_read == 8 * 4 * 4 + 10 * 8
        with pytest.raises(ValueError, match="wrong rank"):
            checkpoint.read_block("a.weight", (0,), (4,))


def test_read_indexed_reads_only_the_indexed_rows_in_the_asked_order(tmp_path: Path) -> None:
    """Rows in any order (transformers' `Interleave`: even rows, then odd rows) are read as arithmetic runs, only
    the indexed elements counted; repeated indices and an empty index work; the index must have the tensor's rank."""
    tensors = _tensors()
    write_safetensors(tensors, tmp_path, max_shard_size=4096)
    full = tensors["a.weight"]
    with LazyCheckpoint(tmp_path) as checkpoint:
        rows = torch.tensor([8, 10, 12, 14, 9, 11, 13, 15, 3, 3])
        block = checkpoint.read_indexed("a.weight", (rows, slice(4, 12)))
        assert torch.equal(block, full[rows][:, 4:12])
        assert checkpoint.bytes_read == 9 * 8 * 4  # 9 distinct rows of 8 fp32 values
        columns = torch.tensor([31, 0, 16])
        assert torch.equal(checkpoint.read_indexed("a.weight", (slice(2, 5), columns)), full[2:5][:, columns])
        empty = checkpoint.read_indexed("a.weight", (torch.tensor([], dtype=torch.int64), slice(0, 32)))
        assert empty.shape == (0, 32)
        with pytest.raises(ValueError, match="index of 1 dims"):
            checkpoint.read_indexed("a.weight", (slice(0, 4),))


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(64, 32))
        self.experts = torch.nn.Parameter(torch.zeros(4, 8, 8))
        self.register_buffer("ids", torch.zeros(10, dtype=torch.int64))


def test_load_sharded_tensors_fills_plain_tensors_and_stacks_keys_in_the_given_order(tmp_path: Path) -> None:
    """Without DTensors every tensor is read whole; several keys are stacked along a new dim 0 in the order given
    (the adapter's expert order, not the files' name order); bytes read are reported."""
    tensors = _tensors()
    write_safetensors(tensors, tmp_path, max_shard_size=4096)
    holder = _Holder()
    order = ["experts.2.weight", "experts.0.weight", "experts.3.weight", "experts.1.weight"]
    sources = {"a": ["a.weight"], "experts": order, "ids": ["c.ids"]}
    with LazyCheckpoint(tmp_path) as checkpoint:
        report = load_sharded_tensors_(holder, checkpoint, sources)
    assert set(report.names) == {"a", "experts", "ids"}
    assert torch.equal(holder.a, tensors["a.weight"])
    assert torch.equal(holder.experts, torch.stack([tensors[k] for k in order]))
    assert torch.equal(holder.ids, tensors["c.ids"])
    assert report.bytes_read == sum(t.numel() * t.element_size() for k, t in tensors.items() if k != "b.weight")


def test_load_sharded_tensors_refuses_meta_targets_and_wrong_shapes_before_reading(tmp_path: Path) -> None:
    write_safetensors(_tensors(), tmp_path, max_shard_size=None)
    holder = _Holder()
    holder.ids = torch.empty(10, dtype=torch.int64, device="meta")
    sources = {"a": ["a.weight"], "experts": ["experts.0.weight", "experts.1.weight"], "ids": ["c.ids"]}
    with LazyCheckpoint(tmp_path) as checkpoint, pytest.raises(ValueError, match="load_sharded_tensors_") as info:
        load_sharded_tensors_(holder, checkpoint, sources)
    assert checkpoint.bytes_read == 0
    message = str(info.value)
    assert "ids is on the meta device: materialize the model first (to_empty)" in message
    assert "experts: checkpoint experts.0.weight .. experts.1.weight (2 tensors) has shape (2, 8, 8)" in message


def test_fused_rows_concatenate_their_keys_and_read_only_the_rows_a_block_covers(tmp_path: Path) -> None:
    """A stacked entry that is a tuple of keys is their concatenation along dim 0 (transformers' fused experts:
    per-expert `w1` and `w3` are row e of a `[E, 2I, H]` `gate_up_proj`): the whole stack loads equal to
    `stack(cat(w1_e, w3_e))`, and a block that covers part of a row reads only the pieces' rows inside it."""
    g = torch.Generator().manual_seed(1)
    w1 = {e: torch.randn(3, 5, generator=g) for e in range(4)}
    w3 = {e: torch.randn(3, 5, generator=g) for e in range(4)}
    files = {**{f"experts.{e}.w1.weight": w1[e] for e in w1}, **{f"experts.{e}.w3.weight": w3[e] for e in w3}}
    write_safetensors(files, tmp_path, max_shard_size=256)
    rows = [(f"experts.{e}.w1.weight", f"experts.{e}.w3.weight") for e in range(4)]
    holder = torch.nn.Module()
    holder.gate_up = torch.nn.Parameter(torch.zeros(4, 6, 5))
    with LazyCheckpoint(tmp_path) as checkpoint:
        assert checkpoint.source_shape(rows[0]) == (6, 5)
        report = load_sharded_tensors_(holder, checkpoint, {"gate_up": rows})
        expected = torch.stack([torch.cat([w1[e], w3[e]]) for e in range(4)])
        assert torch.equal(holder.gate_up, expected)
        assert report.bytes_read == expected.numel() * 4
        # rows 2..4 of expert 1's fused row: one row of w1, one of w3; columns 1..3
        before = checkpoint.bytes_read
        block = checkpoint.read_source_block(rows[1], (2, 1), (2, 3))
        assert torch.equal(block, expected[1, 2:4, 1:4])
        assert checkpoint.bytes_read - before == 2 * 3 * 4
        block = checkpoint.read_source_block(rows[1], (3, 0), (3, 5))  # w3 alone
        assert torch.equal(block, w3[1])
    files["experts.0.w3.weight"] = torch.randn(3, 4)  # a piece that does not concatenate: named before any read
    (tmp_path / "bad").mkdir()
    write_safetensors(files, tmp_path / "bad", max_shard_size=None)
    with LazyCheckpoint(tmp_path / "bad") as checkpoint, pytest.raises(ValueError, match="do not concatenate") as info:
        load_sharded_tensors_(holder, checkpoint, {"gate_up": rows})
    assert checkpoint.bytes_read == 0
    expected = "gate_up: the pieces of experts.0.w1.weight + experts.0.w3.weight do not concatenate along dim 0: "
    assert expected + "[('experts.0.w1.weight', (3, 5)), ('experts.0.w3.weight', (3, 4))]" in str(info.value)


class _StackingAdapter:
    """A toy checkpoint layout: file keys are ours prefixed with "file.", and "file.e.{i}.w" are the rows of our
    stacked "stack.w"."""

    @staticmethod
    def internal_key(key: str) -> str:
        name = key.removeprefix("file.")
        return "stack.w" if name.startswith("e.") else name

    @staticmethod
    def from_hf(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = [t for k, t in tensors.items() if k.startswith("file.e.")]
        out = {_StackingAdapter.internal_key(k): t for k, t in tensors.items() if not k.startswith("file.e.")}
        return {**out, "stack.w": torch.stack(rows)} if rows else out

    @staticmethod
    def to_hf(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"file.{name}": t for name, t in tensors.items()}


def test_checked_sources_lists_every_problem_in_the_files_naming(tmp_path: Path) -> None:
    stored = {"file.x.w": torch.zeros(2, 3), "file.extra.w": torch.zeros(1), "file.skipped.w": torch.zeros(1)}
    stored |= {f"file.e.{i}.w": torch.zeros(3) for i in range(5)}
    write_safetensors(stored, tmp_path, max_shard_size=None)
    expected = {"x.w": torch.empty(2, 3, device="meta"), "stack.w": torch.empty(4, 3, device="meta")}
    expected["gone.w"] = torch.empty(1, device="meta")
    skip = "file.skipped.w".__eq__  # ignored unless expected
    with LazyCheckpoint(tmp_path) as checkpoint, pytest.raises(ValueError, match="does not match Net") as info:
        checked_sources(checkpoint, "Net", expected=expected, adapter=_StackingAdapter, skip=skip)
    assert str(info.value).splitlines()[1:] == [
        "  - missing keys (1): ['file.gone.w']",
        "  - unexpected keys (1): ['file.extra.w']",
        "  - shape mismatches (1): ['file.e.0.w .. file.e.4.w (5 tensors): checkpoint (5, 3) vs model (4, 3)']",
    ]
    expected = {"x.w": expected["x.w"], "stack.w": torch.empty(5, 3, device="meta"), "extra.w": torch.empty(1)}
    with LazyCheckpoint(tmp_path) as checkpoint:
        got = checked_sources(checkpoint, "Net", expected=expected, adapter=_StackingAdapter, skip=skip)
    assert got == {"x.w": ["file.x.w"], "stack.w": [f"file.e.{i}.w" for i in range(5)], "extra.w": ["file.extra.w"]}
