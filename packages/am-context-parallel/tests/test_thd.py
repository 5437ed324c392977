"""THD conversion: cumulative lengths, the pad-only-at-the-end shortcut, reshaping, and chunked stacking."""

from __future__ import annotations

import pytest
import torch

from am_context_parallel import process_input_for_thd, split_batch_into_thd_chunks

PAD = -1000


def _batch() -> dict[str, torch.Tensor]:
    input_ids = torch.tensor([[5, 6, 7, 0, 8, 9], [1, 2, 3, 4, 5, 6]])
    return {
        "input_ids": input_ids,
        "labels": input_ids + 100,
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]),
        "seq_lens": torch.tensor([[3, 2], [6, PAD]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, PAD]]),
    }


def test_worked_example() -> None:
    """seq_lens [[3,2],[6,-1000]], padded [[4,2],[6,-1000]] -> cu [0,3,5,11], cu_padded [0,4,6,12], max 6."""
    out = process_input_for_thd(_batch())
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 11]
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 6, 12]
    assert out["cu_seqlens"].dtype == torch.int32
    assert int(out["max_seqlen"]) == 6
    assert out["input_ids"].tolist() == [5, 6, 7, 0, 8, 9, 1, 2, 3, 4, 5, 6]
    assert out["labels"].shape == (12,)
    assert out["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5]
    assert out["padding_mask"].tolist() == [x == 0 for x in out["input_ids"].tolist()]
    assert "seq_lens" not in out
    assert "seq_lens_padded" not in out
    assert out["qkv_format"] == "thd"


def test_padding_only_at_the_end_extends_last_sequence() -> None:
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 0, 0]]), "seq_lens": torch.tensor([[2, 2]])}
    batch["seq_lens_padded"] = torch.tensor([[2, 4]])
    out = process_input_for_thd(batch)
    assert out["cu_seqlens"].tolist() == [0, 2, 6]
    assert "cu_seqlens_padded" not in out
    assert int(out["max_seqlen"]) == 4


def test_embeddings_mrope_and_synthesized_positions() -> None:
    embeds = torch.randn(2, 3, 5)
    out = process_input_for_thd({"inputs_embeds": embeds, "position_ids": torch.zeros(3, 2, 3, dtype=torch.long)})
    assert out["inputs_embeds"].shape == (6, 5)
    assert torch.equal(out["inputs_embeds"][3:], embeds[1])
    assert out["position_ids"].shape == (3, 1, 6)
    # No seq_lens: one sequence per row, positions restart per row.
    out = process_input_for_thd({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1, 2]
    assert out["cu_seqlens"].tolist() == [0, 3, 6]


def test_split_into_chunks_pads_ragged_cu_seqlens() -> None:
    out = split_batch_into_thd_chunks(_batch(), num_chunks=2)
    assert out["input_ids"].shape == (2, 6)
    assert out["cu_seqlens"].tolist() == [[0, 3, 5], [0, 6, PAD]]
    assert out["cu_seqlens_padded"].tolist() == [[0, 4, 6], [0, 6, PAD]]
    assert out["max_seqlen"].tolist() == [3, 6]
    assert out["qkv_format"] == "thd"
    same = split_batch_into_thd_chunks(_batch(), num_chunks=1)
    assert same["cu_seqlens"].tolist() == [0, 3, 5, 11]


def test_split_rejects_uneven_batch() -> None:
    with pytest.raises(ValueError, match="not divisible by num_chunks=3"):
        split_batch_into_thd_chunks(_batch(), num_chunks=3)
