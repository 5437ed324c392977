"""Batch sharding: resolution order, padding semantics, the contiguous and THD paths, and input validation.

The load-balanced and THD paths run on a real 2-rank gloo group with a `DeviceMesh(("cp",))`; expected shards are
computed in the pytest process by indexing the padded full tensors with the positions each rank should keep.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cp_dist import case_result, run_cases, run_group
from torch.distributed.device_mesh import init_device_mesh

from am_context_parallel import (
    ContiguousCPOptions,
    ContiguousLayout,
    FlashCPUAttentionKernel,
    LoadBalancedLayout,
    RingAttentionContext,
    cp_local_seq_len,
    make_cp_batch_and_ctx,
    model_cp_options,
    model_cp_problems,
)
from am_context_parallel.upstream import _synthesize_single_document_seq_ids, make_contiguous_shard_cp_batch_and_ctx
from am_model_contract import ContextParallelContract, ModelContract

PAD_ID = 9
# rank r of 2 keeps chunks r and 3 - r of 8 padded tokens (chunk = 2 tokens)
KEEP = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}


def _full_batch() -> dict[str, torch.Tensor]:
    input_ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 0, 0]])
    return {
        "input_ids": input_ids,
        "labels": input_ids + 100,
        "attention_mask": torch.tensor([[1] * 7, [1] * 5 + [0] * 2]),
    }


class _RingModel(torch.nn.Module):
    """The model the load-balanced path is given (required at C > 1): a layer stack whose blocks would call the
    ring; the sharding cases never run it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])


RING_MODEL = _RingModel()


def _load_balanced_case(mesh: Any) -> dict[str, Any]:
    batch = _full_batch()
    batch_id = id(batch)
    loss_mask = torch.ones(2, 7)
    ctx, out = make_cp_batch_and_ctx(mesh, batch, loss_mask=loss_mask, padding_token_id=PAD_ID, model=RING_MODEL)
    assert isinstance(ctx, RingAttentionContext)
    return {
        "same_object": id(out) == batch_id,
        "keys": sorted(out),
        "input_ids": out["input_ids"],
        "labels": out["labels"],
        "position_ids": out["position_ids"],
        "loss_mask": out["loss_mask"],
        "positions": ctx.positions,
        "doc_ids": ctx.doc_ids,
        "unsharded": ctx.unshard(out["input_ids"], seq_dim=1),
    }


def _embeds_case(mesh: Any) -> dict[str, Any]:
    embeds = torch.randn(1, 8, 3, requires_grad=True)
    batch = {"inputs_embeds": embeds, "labels": torch.zeros(1, 8, dtype=torch.long)}
    _, out = make_cp_batch_and_ctx(mesh, batch, model=RING_MODEL)
    out["inputs_embeds"].sum().backward()
    assert embeds.grad is not None
    return {"grad_mask": embeds.grad[0, :, 0], "position_ids": out["position_ids"]}


def _mrope_and_extra_case(mesh: Any) -> dict[str, Any]:
    batch = {
        "input_ids": torch.arange(6).unsqueeze(0),
        "labels": torch.arange(6).unsqueeze(0),
        "position_ids": torch.arange(18).reshape(3, 1, 6),
        "padding_mask": torch.zeros(1, 6, dtype=torch.bool),
        "token_weights": torch.full((1, 6), 0.5),
    }
    _, out = make_cp_batch_and_ctx(mesh, batch, extra_seq_buffers=["token_weights"], model=RING_MODEL)
    return {k: out[k] for k in ("position_ids", "padding_mask", "token_weights")}


def _error_case(mesh: Any, batch: dict[str, Any], **kwargs: Any) -> str:
    try:
        make_cp_batch_and_ctx(mesh, batch, **{"model": RING_MODEL, **kwargs})
    except ValueError as error:
        return str(error)
    return "no error"


def _te_case(mesh: Any) -> dict[str, Any]:
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 0, 4, 5, 6, 7]]),
        "labels": torch.tensor([[1, 2, 3, 0, 4, 5, 6, 7]]),
        "seq_lens": torch.tensor([[3, 4]]),
        "seq_lens_padded": torch.tensor([[4, 4]]),
    }
    ctx, out = make_cp_batch_and_ctx(mesh, batch, use_te=True)
    assert ctx is contextlib.nullcontext
    return {k: out[k] for k in ("input_ids", "cu_seqlens", "max_seqlen", "padding_mask", "cp_size", "cp_rank")}


def _te_chunks_case(mesh: Any) -> dict[str, Any]:
    """num_chunks=2: each batch row is its own THD chunk, sharded per packed sequence, then stacked."""
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 0, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]),
        "labels": torch.tensor([[1, 2, 3, 0, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]),
        "seq_lens": torch.tensor([[3, 4], [8, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 4], [8, -1000]]),
    }
    _, out = make_cp_batch_and_ctx(mesh, batch, use_te=True, num_chunks=2)
    return {k: out[k] for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "cp_rank")}


def _contiguous_error_case(mesh: Any) -> str:
    try:
        make_contiguous_shard_cp_batch_and_ctx(mesh, None, {"input_ids": torch.ones(1, 4)})
    except ValueError as error:
        return str(error)
    return "no error"


def _wrong_group_case() -> str:
    layout = LoadBalancedLayout(cp_size=4, cp_rank=0)
    ctx = RingAttentionContext(
        group=dist.group.WORLD, layout=layout, positions=torch.arange(2), doc_ids=None, seq_len=8, padded_len=8
    )
    try:
        with ctx():
            pass
    except ValueError as error:
        return str(error)
    return "no error"


def _contiguous_case(mesh: Any) -> dict[str, Any]:
    batch = {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "labels": torch.tensor([[1, 2, 3]]),
        "_packed_seq_ids": torch.tensor([[1, 1, 2]]),
        "mm_token_type_ids": torch.tensor([[0, 1, 1]]),
        "attention_mask": torch.tensor([[1, 1, 1]]),
    }
    ctx, out = make_contiguous_shard_cp_batch_and_ctx(mesh, None, batch, padding_token_id=PAD_ID)
    assert isinstance(ctx, RingAttentionContext)
    assert out is batch
    mrope = {"inputs_embeds": torch.randn(1, 8, 2), "labels": torch.zeros(1, 8), "position_ids": torch.zeros(3, 1, 8)}
    _, mrope_out = make_contiguous_shard_cp_batch_and_ctx(mesh, None, mrope)
    metadata = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5]]),
        "vision_groups": torch.tensor([[0, 0, 1, 1, 1]]),
        "_cp_metadata_seq_dims": {"vision_groups": 1},
        "_cp_metadata_pad_values": {"vision_groups": -1},
    }
    loss_mask = torch.tensor([[1, 1, 1, 0, 1]])
    _, metadata_out = make_contiguous_shard_cp_batch_and_ctx(mesh, None, metadata, loss_mask=loss_mask)
    return {
        "keys": sorted(out),
        "ctx": (ctx.layout.name, ctx.positions, ctx.doc_ids, ctx.seq_len, ctx.padded_len, ctx.route_hf_attention),
        **{k: out[k] for k in ("input_ids", "labels", "_packed_seq_ids", "mm_token_type_ids", "padding_mask")},
        "position_ids": out["position_ids"],
        "mrope_shapes": (tuple(mrope_out["position_ids"].shape), tuple(mrope_out["inputs_embeds"].shape)),
        "vision_groups": metadata_out["vision_groups"],
        "promoted_labels": metadata_out["labels"],
        "metadata_keys": sorted(metadata_out),
    }


_CONTIGUOUS = ModelContract(cp=ContextParallelContract(layout="contiguous"))


class _DeclaredModel(torch.nn.Module):
    """A model that declares the contiguous path with options (what Gemma 4 and Nemotron-H do)."""

    def am_contract(self) -> ModelContract:
        return ModelContract(cp=ContextParallelContract(layout="contiguous", options=self.get_cp_options))

    def get_cp_options(self) -> ContiguousCPOptions:
        return ContiguousCPOptions(
            kernel=lambda device: FlashCPUAttentionKernel(),
            route_hf_attention=True,
            extra_seq_keys={"mtp_labels": (1, -100), "absent_key": (1, 0)},
            pad_multiple=3,
        )


def _declared_model_case(mesh: Any) -> dict[str, Any]:
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5, 6, 7]]),
        "labels": torch.tensor([[2, 3, 4, 5, 6, 7, -100]]),
        "mtp_labels": torch.tensor([[3, 4, 5, 6, 7, -100, -100]]),
        "token_weights": torch.full((1, 7), 0.5),
    }
    ctx, out = make_cp_batch_and_ctx(mesh, batch, model=_DeclaredModel(), extra_seq_buffers=["token_weights"])
    assert isinstance(ctx, RingAttentionContext)
    return {
        "layout": repr(ctx.layout),
        "kernel": type(ctx.kernel).__name__,
        "route": ctx.route_hf_attention,
        "positions": ctx.positions,
        "doc_ids": ctx.doc_ids,
        "lengths": (ctx.seq_len, ctx.padded_len),
        **{k: out[k] for k in ("input_ids", "labels", "mtp_labels", "token_weights", "position_ids")},
    }


def _tp_case() -> dict[str, Any]:
    """C = 1 with a real TP mesh of 2 ranks: upstream synthesizes position ids (C > 1 or TP > 1); without TP it
    does not. The upstream positional call `(cp_mesh, tp_mesh, batch, loss_mask, padding_token_id)` works."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("cp", "tp"))
    batch = {"input_ids": torch.tensor([[4, 5, 6]]), "labels": torch.tensor([[5, 6, -100]])}
    ctx, with_tp = make_contiguous_shard_cp_batch_and_ctx(mesh["cp"], mesh["tp"], dict(batch), None, PAD_ID)
    _, without_tp = make_contiguous_shard_cp_batch_and_ctx(mesh["cp"], None, dict(batch), None, PAD_ID)
    _, declared = make_cp_batch_and_ctx(mesh, dict(batch), model=_DeclaredModel())
    return {
        "ctx": ctx,
        "with_tp": with_tp.get("position_ids"),
        "without_tp": "position_ids" in without_tp,
        "declared": declared.get("position_ids"),
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    ids = torch.ones(2, 7, dtype=torch.long)
    return run_cases(
        {
            "load_balanced": lambda: _load_balanced_case(mesh),
            "embeds": lambda: _embeds_case(mesh),
            "mrope_extra": lambda: _mrope_and_extra_case(mesh),
            "te": lambda: _te_case(mesh),
            "te_chunks": lambda: _te_chunks_case(mesh),
            "contiguous": lambda: _contiguous_case(mesh),
            "declared_model": lambda: _declared_model_case(mesh),
            "tp": _tp_case,
            "err_contiguous_labels": lambda: _contiguous_error_case(mesh),
            "err_labels": lambda: _error_case(mesh, {"input_ids": ids}),
            "err_no_model": lambda: _error_case(mesh, _full_batch(), model=None),
            "err_both": lambda: _error_case(
                mesh, {"input_ids": ids, "inputs_embeds": torch.ones(2, 7, 3), "labels": ids}
            ),
            "err_neither": lambda: _error_case(mesh, {"labels": ids}),
            "err_lengths": lambda: _error_case(mesh, {"input_ids": ids, "labels": torch.ones(2, 6, dtype=torch.long)}),
            "err_seq_dim": lambda: _error_case(
                mesh, {"input_ids": ids, "labels": ids, "padding_mask": torch.zeros(2, dtype=torch.bool)}
            ),
            "err_all_at_once": lambda: _error_case(
                mesh,
                {"input_ids": ids, "position_ids": torch.zeros(3, 2, 5, dtype=torch.long)},
                extra_seq_buffers=["missing_key"],
            ),
            "err_group_size": _wrong_group_case,
        }
    )


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(2, _worker)


def test_load_balanced_padding_and_context(results: list[dict[str, Any]]) -> None:
    """Pad 7 -> 8 with pad id / -100 / continuing positions; attention_mask becomes doc id 0 for the ring."""
    full = _full_batch()
    padded_ids = torch.cat([full["input_ids"], torch.full((2, 1), PAD_ID)], dim=1)
    padded_labels = torch.cat([full["labels"], torch.full((2, 1), -100)], dim=1)
    docs = torch.cat([full["attention_mask"], torch.zeros(2, 1, dtype=torch.long)], dim=1)
    for rank in range(2):
        local = case_result(results, "load_balanced", rank)
        keep = KEEP[rank]
        assert local["same_object"]
        assert "attention_mask" not in local["keys"]
        assert local["input_ids"].tolist() == padded_ids[:, keep].tolist()
        assert local["labels"].tolist() == padded_labels[:, keep].tolist()
        assert local["position_ids"].tolist() == [keep, keep]  # synthesized arange, continued into the padding
        assert local["loss_mask"].tolist() == [[1.0 if p < 7 else 0.0 for p in keep]] * 2
        assert local["positions"].tolist() == keep
        assert local["doc_ids"].tolist() == docs[:, keep].tolist()
        assert torch.equal(local["unsharded"], full["input_ids"])


def test_embeddings_keep_their_gradient(results: list[dict[str, Any]]) -> None:
    """Rank 1 of 2 keeps positions 2..5 of 8; gradients reach exactly those embedding rows."""
    assert case_result(results, "embeds", 1)["grad_mask"].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert case_result(results, "embeds", 0)["grad_mask"].tolist() == [1, 1, 0, 0, 0, 0, 1, 1]


def test_mrope_positions_padding_mask_and_extra_buffers(results: list[dict[str, Any]]) -> None:
    """6 tokens -> 8: mRoPE [3,1,S] is sharded on dim 2 (continuing), padding_mask pads True, floats pad 0."""
    positions = torch.arange(18).reshape(3, 1, 6)
    padded_positions = torch.cat([positions, positions[..., -1:] + torch.tensor([1, 2])], dim=2)
    for rank in range(2):
        local = case_result(results, "mrope_extra", rank)
        keep = KEEP[rank]
        assert torch.equal(local["position_ids"], padded_positions[..., keep])
        assert local["padding_mask"].tolist() == [[p >= 6 for p in keep]]
        assert local["token_weights"].tolist() == [[0.5 if p < 6 else 0.0 for p in keep]]


def test_thd_path_shards_each_sequence_head_tail(results: list[dict[str, Any]]) -> None:
    """Two packed sequences of padded length 4: rank r keeps chunks r and 3-r of EACH sequence."""
    tokens = [1, 2, 3, 0, 4, 5, 6, 7]
    expected = {0: [0, 3, 4, 7], 1: [1, 2, 5, 6]}
    for rank in range(2):
        local = case_result(results, "te", rank)
        assert local["input_ids"].tolist() == [tokens[i] for i in expected[rank]]
        assert local["cu_seqlens"].tolist() == [0, 4, 8]
        assert int(local["max_seqlen"]) == 4
        assert local["padding_mask"].tolist() == [tokens[i] == 0 for i in expected[rank]]
        assert (local["cp_size"], local["cp_rank"]) == (2, rank)


def test_thd_path_with_chunks_stacks_per_chunk_shards(results: list[dict[str, Any]]) -> None:
    """Chunk 0 = sequences of padded length 4 and 4 (chunks of 1); chunk 1 = one sequence of 8 (chunks of 2)."""
    rows = [[1, 2, 3, 0, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    keep = {0: ([0, 3, 4, 7], [0, 1, 6, 7]), 1: ([1, 2, 5, 6], [2, 3, 4, 5])}
    # position ids restart at every packed sequence (over its padded extent) before sharding
    positions = [[0, 1, 2, 3, 0, 1, 2, 3], list(range(8))]
    for rank in range(2):
        local = case_result(results, "te_chunks", rank)
        expected = [[row[i] for i in idx] for row, idx in zip(rows, keep[rank], strict=True)]
        assert local["input_ids"].tolist() == expected
        assert local["labels"].tolist() == expected
        assert local["position_ids"].tolist() == [
            [pos[i] for i in idx] for pos, idx in zip(positions, keep[rank], strict=True)
        ]
        assert local["cu_seqlens"].tolist() == [[0, 4, 8], [0, 8, -1000]]
        assert local["max_seqlen"].tolist() == [4, 8]
        assert local["cp_rank"] == rank


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("err_labels", ["requires 'labels'"]),
        ("err_both", ["exactly one of 'input_ids' or 'inputs_embeds'", "got both"]),
        ("err_neither", ["got neither"]),
        ("err_lengths", ["'labels' has 6 tokens", "S=7"]),
        ("err_seq_dim", ["'padding_mask' has shape (2,)", "sequence dim is 1"]),
        ("err_all_at_once", ["requires 'labels'", "'missing_key' is missing", "'position_ids' has 5 tokens"]),
        ("err_group_size", ["2 ranks", "sharded for 4"]),
        # the load-balanced path must know the model it routes and checks (issue 22 item 1)
        ("err_no_model", ["needs the model", "Pass model=", "am_context_parallel.upstream.make_cp_batch_and_ctx"]),
        ("err_contiguous_labels", ["requires 'labels'"]),
    ],
)
def test_bad_input_is_a_clear_error(results: list[dict[str, Any]], case: str, needles: list[str]) -> None:
    for rank in range(2):
        message = case_result(results, case, rank)
        for needle in needles:
            assert needle in message, f"{needle!r} not in {message!r}"


def test_contiguous_shard_pads_and_slices(results: list[dict[str, Any]]) -> None:
    """S=3, C=2, rank 1 -> [3, pad], labels [3, -100], _packed_seq_ids [2, 0]; mRoPE [3,1,8] -> [3,1,4]."""
    local = case_result(results, "contiguous", 1)
    assert local["input_ids"].tolist() == [[3, PAD_ID]]
    assert local["labels"].tolist() == [[3, -100]]
    assert local["_packed_seq_ids"].tolist() == [[2, 0]]
    assert local["mm_token_type_ids"].tolist() == [[1, 0]]
    assert local["padding_mask"].tolist() == [[False, True]]
    assert local["position_ids"].tolist() == [[2, 3]]
    assert "attention_mask" not in local["keys"]
    # The sharder returns the ring context itself: contiguous layout, global positions 2..3, the local doc ids.
    assert local["ctx"][0] == "contiguous"
    assert local["ctx"][1].tolist() == [2, 3]
    assert local["ctx"][2].tolist() == [[2, 0]]
    assert local["ctx"][3:] == (3, 4, False)
    assert local["mrope_shapes"] == ((3, 1, 4), (1, 4, 2))
    # Model metadata with its own pad value; loss_mask promoted to labels when labels are missing.
    # 5 tokens pad to 8 (a multiple of 2C): rank 1 keeps tokens 4..7.
    assert local["vision_groups"].tolist() == [[1, -1, -1, -1]]
    assert local["promoted_labels"].tolist() == [[1, -100, -100, -100]]
    assert "_cp_metadata_seq_dims" not in local["metadata_keys"]
    rank0 = case_result(results, "contiguous", 0)
    assert rank0["input_ids"].tolist() == [[1, 2]]
    assert rank0["_packed_seq_ids"].tolist() == [[1, 1]]


# ---------------------------------------------------------------- single process
def test_no_mesh_or_cp1_is_identity() -> None:
    batch = _full_batch()
    ctx, out = make_cp_batch_and_ctx(None, batch)
    assert ctx is contextlib.nullcontext
    assert out is batch
    assert "attention_mask" in out


@pytest.mark.parametrize("declared", [False, True], ids=["identity", "contiguous"])
def test_float_token_ids_and_labels_of_another_batch_size_are_refused(declared: bool) -> None:
    """Checked before any path is chosen, so also at C = 1, where the batch would otherwise pass unchanged."""

    class Declared(torch.nn.Module):
        def am_contract(self) -> ModelContract:
            return _CONTIGUOUS

    model = Declared() if declared else None
    batch = _full_batch()
    with pytest.raises(ValueError, match="cannot shard the batch for context parallelism") as info:
        make_cp_batch_and_ctx(
            None, {**batch, "input_ids": batch["input_ids"].float(), "labels": batch["labels"][:1]}, model=model
        )
    message = str(info.value)
    assert "'input_ids' must be an integer tensor of token ids; got torch.float32" in message
    assert "'labels' has batch size 1 (shape (1, 7)) but 'input_ids' has B=2" in message
    with pytest.raises(
        ValueError, match=r"'labels' must be an integer tensor of token ids \(-100 = ignore\); got torch.float32"
    ):
        make_cp_batch_and_ctx(None, {**batch, "labels": batch["labels"].float()}, model=model)
    with pytest.raises(ValueError, match=r"'labels' has batch size 3 \(shape \(3, 7\)\) but 'input_ids' has B=2"):
        make_cp_batch_and_ctx(None, {**batch, "labels": torch.zeros(3, 7, dtype=torch.long)}, model=model)


def test_declared_model_gets_the_contiguous_shard_and_its_context(results: list[dict[str, Any]]) -> None:
    """7 tokens, pad_multiple 3 -> padded to 12 (6 per rank); the model's extra key pads with its own value, an
    absent declared key is skipped, extra_seq_buffers are sharded too; kernel and routing come from the options."""
    for rank in range(2):
        local = case_result(results, "declared_model", rank)
        keep = list(range(6 * rank, 6 * rank + 6))
        assert local["layout"] == f"ContiguousLayout(cp_size=2, cp_rank={rank})"
        assert (local["kernel"], local["route"], local["lengths"]) == ("FlashCPUAttentionKernel", True, (7, 12))
        assert local["positions"].tolist() == keep
        assert local["position_ids"].tolist() == [keep]
        assert local["doc_ids"].tolist() == [[1 if p < 7 else 0 for p in keep]]
        assert local["input_ids"].tolist() == [[p + 1 if p < 7 else 0 for p in keep]]
        assert local["mtp_labels"].tolist() == [[p + 3 if p < 5 else -100 for p in keep]]
        assert local["token_weights"].tolist() == [[0.5 if p < 7 else 0.0 for p in keep]]


def test_tp_mesh_makes_the_contiguous_shard_synthesize_position_ids(results: list[dict[str, Any]]) -> None:
    for rank in range(2):
        got = case_result(results, "tp", rank)
        assert got["ctx"] is contextlib.nullcontext  # C = 1: nothing to ring over
        # 3 tokens padded to a multiple of 2C = 2 (as upstream does at C = 1), positions continuing into the pad
        assert got["with_tp"].tolist() == [[0, 1, 2, 3]]
        assert got["without_tp"] is False
        # make_cp_batch_and_ctx hands the mesh's tp dim over (that model pads to a multiple of 3C = 3)
        assert got["declared"].tolist() == [[0, 1, 2]]


def test_thd_options_without_use_te_are_refused() -> None:
    """num_chunks / seq_lens_padding_value configure only the THD path: elsewhere they would be ignored."""
    for kwargs in ({"num_chunks": 2}, {"seq_lens_padding_value": -1}):
        with pytest.raises(ValueError, match="configure the THD path only"):
            make_cp_batch_and_ctx(None, _full_batch(), **kwargs)
    _, out = make_cp_batch_and_ctx(None, _full_batch(), None, False, 0, 1, -1000)  # upstream positional defaults
    assert "attention_mask" in out


def test_context_lengths_must_match_the_positions() -> None:
    layout = LoadBalancedLayout(cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="keep 4 tokens per rank, but the positions hold 3"):
        RingAttentionContext(
            group=None, layout=layout, positions=torch.arange(3), doc_ids=None, seq_len=7, padded_len=8
        )
    with pytest.raises(ValueError, match="seq_len=9, padded_len=8"):
        RingAttentionContext(
            group=None, layout=layout, positions=torch.arange(4), doc_ids=None, seq_len=9, padded_len=8
        )


def test_a_function_in_the_batch_is_refused_with_the_new_way() -> None:
    """The removed `_cp_make_batch_fn` protocol (functions travelling in batches) names its replacement."""

    def sharder(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("must not be called")

    for call in (
        lambda b: make_cp_batch_and_ctx(None, b),
        lambda b: make_contiguous_shard_cp_batch_and_ctx(None, None, b),
    ):
        with pytest.raises(ValueError, match="_cp_make_batch_fn") as error:
            call({**_full_batch(), "_cp_make_batch_fn": sharder})
        assert 'ContextParallelContract(layout="contiguous"' in str(error.value)
        assert "model=model" in str(error.value)


def test_model_cp_problems_asks_the_hook_with_the_shard_length_the_sharder_will_use() -> None:
    """`model_cp_problems` passes the hook the local length `make_cp_batch_and_ctx` will produce (padded to
    pad_multiple x C, then split), returns its list, and refuses a hook that returns anything else."""
    calls: list[dict[str, int]] = []

    class Hooked(torch.nn.Module):
        def am_contract(self) -> ModelContract:
            return ModelContract(
                cp=ContextParallelContract(layout="contiguous", options=self.get_cp_options, problems=self.cp_problems)
            )

        def get_cp_options(self) -> ContiguousCPOptions:
            return ContiguousCPOptions(pad_multiple=3)

        def cp_problems(self, **kwargs: int) -> list[str]:
            calls.append(kwargs)
            return [f"{kwargs['local_seq_len']} tokens per rank is too short"] if kwargs["local_seq_len"] < 6 else []

    class LoadBalancedHooked(torch.nn.Module):
        def am_contract(self) -> ModelContract:
            return ModelContract(cp=ContextParallelContract(problems=self.cp_problems))

        def cp_problems(self, **kwargs: int) -> list[str]:
            return [f"local {kwargs['local_seq_len']}"]

    class BadHook(torch.nn.Module):
        def am_contract(self) -> ModelContract:
            return ModelContract(cp=ContextParallelContract(problems=self.cp_problems))

        def cp_problems(self, **kwargs: int) -> str:
            return "one string, not a list"

    assert model_cp_problems(Hooked(), seq_len=10, cp_size=2) == []  # padded to 12: 6 per rank
    assert calls == [{"seq_len": 10, "local_seq_len": 6, "cp_size": 2}]
    assert model_cp_problems(Hooked(), seq_len=10, cp_size=4) == ["3 tokens per rank is too short"]  # 12 / 4
    assert model_cp_problems(Hooked(), seq_len=10, cp_size=1) == []  # no CP: the hook is not asked
    assert len(calls) == 2
    assert model_cp_problems(LoadBalancedHooked(), seq_len=10, cp_size=2) == ["local 6"]  # padded to 2 x C = 12
    assert model_cp_problems(torch.nn.Module(), seq_len=10, cp_size=2) == []  # no hook: nothing declared
    with pytest.raises(TypeError, match="must return a list of strings"):
        model_cp_problems(BadHook(), seq_len=8, cp_size=2)
    assert cp_local_seq_len(Hooked(), seq_len=10, cp_size=4) == 3
    assert cp_local_seq_len(Hooked(), seq_len=10, cp_size=1) == 10
    # the rule is the sharder's: the local length equals the contiguous layout's shard of the padded length
    layout = ContiguousLayout(cp_size=4, cp_rank=0, pad_multiple=3)
    assert cp_local_seq_len(Hooked(), seq_len=10, cp_size=4) == len(layout.local_indices(layout.padded_length(10)))


def test_model_declarations_are_checked() -> None:
    class NoDeclaration(torch.nn.Module):
        pass

    class OptionsWithoutLayout(torch.nn.Module):
        def am_contract(self) -> ModelContract:
            return ModelContract(cp=ContextParallelContract(options=self.get_cp_options))

        def get_cp_options(self) -> ContiguousCPOptions:
            return ContiguousCPOptions()

    class UnknownLayout(torch.nn.Module):
        def am_contract(self) -> ModelContract:
            return ModelContract(cp=ContextParallelContract(layout="zigzag"))

    class WrongOptions(torch.nn.Module):
        def am_contract(self) -> ModelContract:
            return ModelContract(cp=ContextParallelContract(layout="contiguous", options=self.get_cp_options))

        def get_cp_options(self) -> dict[str, Any]:
            return {}

    class Plain(torch.nn.Module):
        def am_contract(self) -> ModelContract:
            return _CONTIGUOUS

    assert model_cp_options(NoDeclaration()) is None
    assert model_cp_options(Plain()) == ContiguousCPOptions()
    with pytest.raises(ValueError, match='options are read only for layout="contiguous"'):
        model_cp_options(OptionsWithoutLayout())
    with pytest.raises(ValueError, match=r"layout must be one of \['load_balanced', 'contiguous'\]; got 'zigzag'"):
        model_cp_options(UnknownLayout())
    with pytest.raises(TypeError, match=r"contract cp.options\(\) must return a ContiguousCPOptions"):
        model_cp_options(WrongOptions())
    with pytest.raises(ValueError, match="drop use_te"):
        make_cp_batch_and_ctx(None, _full_batch(), use_te=True, model=Plain())
    with pytest.raises(ValueError, match="invalid ContiguousCPOptions") as error:
        ContiguousCPOptions(kernel=3, pad_multiple=0, primary_keys=("tokens",), extra_seq_keys={"x": 1})  # type: ignore[arg-type]
    for needle in ("kernel must be", "pad_multiple", "primary_keys", "extra_seq_keys['x']"):
        assert needle in str(error.value)


def test_plan_layout_picks_the_path_and_is_checked_against_the_model() -> None:
    """A run plan's `layout=` decides the path (the contract is not asked to derive it again) and must be the one
    the model's contract declares: a plan made for another model is refused, every problem in one message."""

    class Contiguous(torch.nn.Module):
        def am_contract(self) -> ModelContract:
            return _CONTIGUOUS

    batch = {"input_ids": torch.tensor([[4, 5, 6]]), "labels": torch.tensor([[5, 6, -100]])}
    same = dict(batch)
    ctx, out = make_cp_batch_and_ctx(None, same, model=torch.nn.Module(), layout="load_balanced")
    assert ctx is contextlib.nullcontext  # C = 1 on the load-balanced path: nothing to shard
    assert out is same
    _, contiguous = make_cp_batch_and_ctx(None, dict(batch), model=Contiguous(), layout="contiguous")
    _, declared = make_cp_batch_and_ctx(None, dict(batch), model=Contiguous())
    assert "_packed_seq_ids" in contiguous  # the contiguous path ran (it adds document ids even at C = 1)
    assert contiguous.keys() == declared.keys()
    assert all(torch.equal(contiguous[k], declared[k]) for k in declared)
    with pytest.raises(ValueError, match=r"contract declares cp\.layout='contiguous'"):
        make_cp_batch_and_ctx(None, dict(batch), model=Contiguous(), layout="load_balanced")
    with pytest.raises(ValueError, match=r"contract declares cp\.layout='load_balanced'"):
        make_cp_batch_and_ctx(None, dict(batch), model=torch.nn.Module(), layout="contiguous")
    with pytest.raises(ValueError, match="make_cp_batch_and_ctx: ") as error:
        make_cp_batch_and_ctx(None, dict(batch), use_te=True, layout="zigzag")
    for needle in ("layout must be one of ['load_balanced', 'contiguous']; got 'zigzag'", "pass model= too"):
        assert needle in str(error.value)
    with pytest.raises(ValueError, match='use_te=True shards for THD, not the "load_balanced" layout'):
        make_cp_batch_and_ctx(None, dict(batch), use_te=True, model=torch.nn.Module(), layout="load_balanced")


def test_synthesize_single_document_seq_ids() -> None:
    from_mask = {"input_ids": torch.ones(1, 3), "padding_mask": torch.tensor([[False, False, True]])}
    _synthesize_single_document_seq_ids(from_mask)
    assert from_mask["_packed_seq_ids"].tolist() == [[1, 1, 0]]
    plain = {"input_ids": torch.ones(2, 3)}
    _synthesize_single_document_seq_ids(plain)
    assert plain["_packed_seq_ids"].tolist() == [[1, 1, 1]] * 2
    present = {"input_ids": torch.ones(1, 2), "_packed_seq_ids": torch.tensor([[3, 4]])}
    _synthesize_single_document_seq_ids(present)
    assert present["_packed_seq_ids"].tolist() == [[3, 4]]
