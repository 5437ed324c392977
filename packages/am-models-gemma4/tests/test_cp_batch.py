"""What Gemma 4 declares to am-context-parallel's contiguous CP path, on one process (multi-rank parity: test_cp.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _g4_configs import text_config

from am_context_parallel import ContiguousCPOptions, make_cp_batch_and_ctx, model_cp_options
from am_model_contract import contract_of
from am_models_gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration, default_ring_kernel


class _OneProcessMesh:
    """A CP mesh as seen without torch.distributed: size and this process's coordinate."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def _cp1_mesh() -> object:
    return type("Mesh", (), {"mesh_dim_names": ("cp",), "__getitem__": lambda self, _: _OneProcessMesh(1, 0)})()


def test_models_declare_the_contiguous_layout_and_their_kernel() -> None:
    """The declaration is the model's contract (no sharder of our own): contiguous layout, our block-sparse kernel,
    token ids required, transformers' attention not routed (the vision tower keeps its own)."""
    for cls in (Gemma4ForCausalLM, Gemma4ForConditionalGeneration):
        assert not hasattr(cls, "prepare_model_inputs_for_cp")
    assert contract_of(Gemma4ForCausalLM(text_config())).cp.layout == "contiguous"
    options = model_cp_options(Gemma4ForCausalLM(text_config()))
    assert isinstance(options, ContiguousCPOptions)
    assert options.kernel is default_ring_kernel
    assert options.primary_keys == ("input_ids",)
    assert options.route_hf_attention is False


def test_inputs_embeds_are_refused_under_cp() -> None:
    model = Gemma4ForCausalLM(text_config())
    batch = {"inputs_embeds": torch.zeros(1, 4, 32), "labels": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"accepts only \['input_ids'\] under context parallelism"):
        make_cp_batch_and_ctx(_cp1_mesh(), batch, model=model)


def test_one_rank_cp_batch_runs_the_local_path() -> None:
    """With C = 1 the contiguous path still synthesizes document ids; the forward equals the plain one."""
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(text_config(moe=True))
    ids = torch.randint(1, 100, (2, 6))
    labels = torch.roll(ids, -1, dims=1)
    ctx, batch = make_cp_batch_and_ctx(_cp1_mesh(), {"input_ids": ids, "labels": labels}, model=model)
    assert ctx is contextlib.nullcontext
    assert batch["_packed_seq_ids"].tolist() == [[1] * 6] * 2
    with ctx():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(logits, model(input_ids=ids).logits, rtol=0, atol=0)
