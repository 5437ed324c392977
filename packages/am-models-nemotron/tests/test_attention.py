"""Attention masks: None when causal suffices; padding, packed documents and cache offsets combined; no empty rows."""

from __future__ import annotations

import torch

from am_models_nemotron import build_attention_mask

CPU = torch.device("cpu")


def test_plain_causal_needs_no_mask() -> None:
    assert build_attention_mask(batch_size=2, query_length=5, device=CPU) is None
    ones = torch.ones(2, 5)
    assert build_attention_mask(batch_size=2, query_length=5, attention_mask=ones, device=CPU) is None
    assert build_attention_mask(batch_size=2, query_length=1, past_length=4, attention_mask=ones, device=CPU) is None


def test_padding_and_causality_combine_and_rows_are_never_empty() -> None:
    pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    mask = build_attention_mask(batch_size=2, query_length=4, attention_mask=pad, device=CPU)
    assert mask is not None
    assert mask.shape == (2, 1, 4, 4)
    assert mask[0, 0, 3].tolist() == [False, False, True, True]
    assert mask[1, 0, 2].tolist() == [True, True, True, False]
    assert mask.any(dim=-1).all()  # padded query rows fall back to causal attention instead of NaN


def test_packed_documents_are_block_diagonal() -> None:
    seq_idx = torch.tensor([[0, 0, 1, 1, 1]])
    mask = build_attention_mask(batch_size=1, query_length=5, seq_idx=seq_idx, device=CPU)
    assert mask is not None
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask[0, 0], expected)


def test_cache_offset_shifts_causality() -> None:
    mask = build_attention_mask(batch_size=1, query_length=2, past_length=3, device=CPU)
    assert mask is not None
    assert mask[0, 0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
