"""The seed contiguous shard and the model's CP hook, on one process (multi-rank parity lives in test_cp.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _g4_configs import text_config

from am_context_parallel import make_cp_batch_and_ctx
from am_models_gemma4 import Gemma4ForCausalLM, make_contiguous_shard_cp_batch_and_ctx
from am_models_gemma4.cp_batch import make_gemma4_cp_batch_and_ctx


class _OneProcessMesh:
    """A CP mesh as seen without torch.distributed: size and this process's coordinate."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def test_seed_shard_keeps_this_ranks_contiguous_slice() -> None:
    """S=3, C=2, rank 1: padded to 4, keeps tokens [2, 4): the last token and one pad."""
    batch = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[6, 7, -100]])}
    ctx, out = make_contiguous_shard_cp_batch_and_ctx(_OneProcessMesh(2, 1), None, batch, padding_token_id=0)
    assert ctx is contextlib.nullcontext
    assert out["input_ids"].tolist() == [[7, 0]]
    assert out["labels"].tolist() == [[-100, -100]]
    assert out["_packed_seq_ids"].tolist() == [[1, 0]]
    assert out["position_ids"].tolist() == [[2, 3]]


def test_prepare_model_inputs_for_cp_attaches_the_model_sharder() -> None:
    model = Gemma4ForCausalLM(text_config())
    batch = model.prepare_model_inputs_for_cp({"input_ids": torch.ones(1, 4, dtype=torch.long)})
    assert batch["_cp_make_batch_fn"] is make_gemma4_cp_batch_and_ctx
    with pytest.raises(ValueError, match="requires input_ids"):
        model.prepare_model_inputs_for_cp({"inputs_embeds": torch.zeros(1, 4, 32)})


def test_one_rank_cp_batch_runs_the_local_path() -> None:
    """With C = 1 the model-owned sharder still synthesizes document ids; the forward equals the plain one."""
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(text_config(moe=True))
    ids = torch.randint(1, 100, (2, 6))
    labels = torch.roll(ids, -1, dims=1)
    batch = model.prepare_model_inputs_for_cp({"input_ids": ids, "labels": labels})
    mesh = type("Mesh", (), {"mesh_dim_names": ("cp",), "__getitem__": lambda self, _: _OneProcessMesh(1, 0)})()
    ctx, batch = make_cp_batch_and_ctx(mesh, batch)
    with ctx():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(logits, model(input_ids=ids).logits, rtol=0, atol=0)
