"""The seed API called exactly as NeMo AutoModel documents it (pre-refactor `cp_utils`, `thd_utils`,
`gemma4_moe/cp_batch`): positional order, defaults and the documented vectors. Single process: a C=2 mesh is faked
(no collective runs in these paths); the multi-rank behaviour is covered by `test_batch.py` / `test_ring.py`."""

from __future__ import annotations

import contextlib
import inspect
import types

import torch

from am_context_parallel import (
    make_contiguous_shard_cp_batch_and_ctx,
    make_cp_batch_and_ctx,
    make_cp_batch_for_te,
    process_input_for_thd,
    split_batch_into_thd_chunks,
)


def _fake_cp_mesh(size: int, rank: int) -> object:
    return types.SimpleNamespace(
        size=lambda *_: size, get_local_rank=lambda *_: rank, get_group=lambda *_: None, mesh_dim_names=("cp",)
    )


def _packed_batch() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.arange(1, 13).view(2, 6),
        "labels": torch.arange(1, 13).view(2, 6),
        "position_ids": torch.arange(6).repeat(2, 1),
        "seq_lens": torch.tensor([[3, 2], [6, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, -1000]]),
    }


def test_make_cp_batch_and_ctx_positional_without_mesh():
    assert list(inspect.signature(make_cp_batch_and_ctx).parameters)[:8] == [
        "device_mesh",
        "batch",
        "loss_mask",
        "use_te",
        "padding_token_id",
        "num_chunks",
        "seq_lens_padding_value",
        "extra_seq_buffers",
    ]
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long)}
    ctx, out = make_cp_batch_and_ctx(None, batch, None, False, 0, 1, -1000, None)
    assert out is batch
    assert ctx is contextlib.nullcontext or isinstance(ctx(), contextlib.nullcontext)


def test_process_input_for_thd_reference_vector():
    out = process_input_for_thd(_packed_batch(), -1000, 0)
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 11]
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 6, 12]
    assert int(out["max_seqlen"]) == 6
    assert out["input_ids"].tolist() == list(range(1, 13))
    assert out["qkv_format"] == "thd"
    assert "seq_lens" not in out


def test_split_batch_into_thd_chunks_and_te_path_at_cp1():
    one = split_batch_into_thd_chunks(_packed_batch(), 1)
    assert one["cu_seqlens"].tolist() == [0, 3, 5, 11]
    two = split_batch_into_thd_chunks(_packed_batch(), 2, -1000, 0)
    assert two["input_ids"].shape == (2, 6)
    assert two["cu_seqlens"][1].tolist()[:2] == [0, 6]
    te = make_cp_batch_for_te(_fake_cp_mesh(1, 0), _packed_batch(), "thd", 0, 1, -1000)
    assert te["cu_seqlens"].tolist() == [0, 3, 5, 11]


def test_contiguous_shard_reference_vector():
    """S=3, C=2, rank 1 keeps [3, pad]; labels [3, -100]; packed ids [2, 0]; positions continue past the end."""
    batch = {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "labels": torch.tensor([[1, 2, 3]]),
        "_packed_seq_ids": torch.tensor([[1, 1, 2]]),
    }
    _ctx, out = make_contiguous_shard_cp_batch_and_ctx(_fake_cp_mesh(2, 1), None, batch, padding_token_id=0)
    assert out["input_ids"].tolist() == [[3, 0]]
    assert out["labels"].tolist() == [[3, -100]]
    assert out["_packed_seq_ids"].tolist() == [[2, 0]]
    assert out["position_ids"].tolist() == [[2, 3]]
