"""Attention masks (causal, sliding window, documents, padding, vision groups) and the shared-K/V store."""

from __future__ import annotations

import torch

from am_models_gemma4 import SharedKVStates, build_attention_mask


def _dense(seq: int, *, window: int | None, docs: list[int] | None, groups: list[int] | None) -> torch.Tensor:
    """Reference mask from the rules, one (query, key) pair at a time."""
    allowed = torch.zeros(seq, seq, dtype=torch.bool)
    for q in range(seq):
        for k in range(seq):
            same_group = groups is not None and groups[q] >= 0 and groups[q] == groups[k]
            ok = (k <= q or same_group) and (window is None or q - k < window)
            if docs is not None:
                ok = ok and docs[q] == docs[k] and docs[q] > 0
            allowed[q, k] = ok
    return allowed


def test_masks_follow_the_rules() -> None:
    docs = [1, 1, 1, 1, 2, 2, 2, 0]
    groups = [-1, 0, 0, -1, -1, 1, 1, -1]
    for window, use_docs, use_groups in [(None, True, False), (2, True, False), (2, True, True), (3, False, False)]:
        mask, rows = build_attention_mask(
            seq_len=8,
            device=torch.device("cpu"),
            doc_ids=torch.tensor([docs]) if use_docs else None,
            vision_group_ids=torch.tensor([groups]) if use_groups else None,
            sliding_window=window,
        )
        expected = _dense(8, window=window, docs=docs if use_docs else None, groups=groups if use_groups else None)
        assert mask is not None
        real = expected.any(-1)
        assert torch.equal(mask[0, 0][real], expected[real])
        if rows is not None:
            assert torch.equal(rows[0, 0, :, 0], real)
            assert bool(mask[0, 0, 7, 7])  # a padding row keeps its diagonal: finite softmax, output zeroed


def test_plain_causal_mask_is_left_to_sdpa() -> None:
    mask, rows = build_attention_mask(
        seq_len=5, device=torch.device("cpu"), doc_ids=None, vision_group_ids=None, sliding_window=None
    )
    assert mask is None
    assert rows is None


def test_shared_kv_store_is_a_mapping_but_not_a_dict() -> None:
    """FSDP2 copies dict arguments; the store must reach every layer as one object."""
    store = SharedKVStates()
    store["sliding_attention"] = (torch.zeros(1), torch.ones(1))
    assert not isinstance(store, dict)
    assert list(store) == ["sliding_attention"]
    assert len(store) == 1
