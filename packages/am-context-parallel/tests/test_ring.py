"""Ring attention: forward output and Q/K/V gradients equal dense attention on the unsharded sequence.

One gloo group of 4 real processes per module: the 4-rank cases run on the whole group, the 2-rank cases on the
sub-groups {0, 1} and {2, 3} (half the cases each, concurrently). The reference is a dense fp64 attention computed
in the pytest process from the same seeded inputs (tests/_cp_dist.py), compared on the real (unpadded) tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cp_dist import case_result, reference_attention, run_cases, run_group

from am_context_parallel import (
    ContiguousLayout,
    Layout,
    LoadBalancedLayout,
    count_ring_bytes,
    ring_attention,
    ring_plan,
)

# fp32 ring vs fp64 dense reference: the chunked log-sum-exp merge reorders fp32 sums, ~1e-7 relative in practice.
FP32_RTOL = 1e-5
# bf16 inputs and output (8 mantissa bits; accumulation is fp32): one bf16 ulp at the output's scale is ~4e-3.
BF16_RTOL = 2e-2


@dataclass(frozen=True)
class Spec:
    name: str
    cp: int = 2
    layout: str = "load_balanced"
    batch: int = 2
    q_heads: int = 2
    kv_heads: int = 2
    seq: int = 16
    head_dim: int = 8
    causal: bool = True
    window: int | None = None
    packed: bool = False
    dtype: torch.dtype = torch.float32
    scale: float | None = None
    row_positions: bool = False  # pass positions as [B, S_local] instead of [S_local]


BASE = Spec("base")
CASES_2 = [
    Spec("causal_lb"),
    Spec("noncausal_lb", causal=False),
    Spec("causal_contiguous", layout="contiguous"),
    Spec("noncausal_contiguous", layout="contiguous", causal=False),
    Spec("window_smaller_lb", window=3),
    Spec("window_equal_lb", window=8),
    Spec("window_larger_lb", window=11),
    Spec("window_smaller_contiguous", layout="contiguous", window=3),
    Spec("window_larger_contiguous_noncausal", layout="contiguous", window=11, causal=False),
    Spec("packed_lb", packed=True),
    Spec("packed_noncausal_contiguous", layout="contiguous", packed=True, causal=False),
    Spec("gqa_lb", q_heads=4, kv_heads=1, scale=0.2),
    Spec("padding_lb", seq=13),
    Spec("padding_contiguous_window", layout="contiguous", seq=11, window=4),
    Spec("bf16_lb", dtype=torch.bfloat16, packed=True),
    Spec("bf16_contiguous_window_noncausal", layout="contiguous", dtype=torch.bfloat16, window=6, causal=False),
    Spec("row_positions_window_lb", window=5, row_positions=True, seq=14),
]
CASES_4 = [
    Spec("c4_causal_lb", cp=4, seq=32),
    Spec("c4_window_smaller_lb", cp=4, seq=32, window=5),
    Spec("c4_window_equal_lb", cp=4, seq=32, window=8),
    Spec("c4_window_larger_noncausal_lb", cp=4, seq=32, window=13, causal=False),
    Spec("c4_window_contiguous", cp=4, seq=32, layout="contiguous", window=10),
    Spec("c4_packed_gqa_padding", cp=4, seq=29, packed=True, q_heads=4, kv_heads=2),
]
ALL_CASES = {spec.name: spec for spec in CASES_2 + CASES_4}


def _layout(spec: Spec, rank: int) -> Layout:
    if spec.layout == "contiguous":
        return ContiguousLayout(cp_size=spec.cp, cp_rank=rank)
    return LoadBalancedLayout(cp_size=spec.cp, cp_rank=rank)


def _inputs(spec: Spec) -> dict[str, Any]:
    """Full-sequence inputs, identical in every process (seeded by the case name)."""
    gen = torch.Generator().manual_seed(sum(map(ord, spec.name)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(spec.dtype)

    b, s, d = spec.batch, spec.seq, spec.head_dim
    docs = None
    if spec.packed:
        rows = []
        for _ in range(b):
            cuts = sorted(torch.randint(1, s, (2,), generator=gen).tolist())
            row = torch.zeros(s, dtype=torch.long)
            row[: cuts[0]], row[cuts[0] : cuts[1]], row[cuts[1] : s - 1] = 1, 2, 3
            rows.append(row)  # the last token is padding (doc 0): its row must come out 0, never NaN
        docs = torch.stack(rows)
    return {
        "q": randn(b, spec.q_heads, s, d),
        "k": randn(b, spec.kv_heads, s, d),
        "v": randn(b, spec.kv_heads, s, d),
        "dout": randn(b, spec.q_heads, s, d),
        "docs": docs,
    }


def _run_case(spec: Spec, group: Any) -> dict[str, Any]:
    """One rank's part of a case: shard, ring forward + backward, return the local results."""
    rank = dist.get_rank(group)
    layout = _layout(spec, rank)
    data = _inputs(spec)
    padded_len = layout.padded_length(spec.seq)
    # Padding tokens get doc id 0 so that nothing attends to them (what make_cp_batch_and_ctx does).
    docs = data["docs"] if data["docs"] is not None else torch.ones(spec.batch, spec.seq, dtype=torch.long)
    local = {name: layout.shard(data[name], seq_dim=2) for name in ("q", "k", "v", "dout")}
    q, k, v = (local[n].clone().requires_grad_() for n in ("q", "k", "v"))
    local_docs = layout.shard(docs, seq_dim=1, pad_value=0) if padded_len != spec.seq or spec.packed else None
    positions = layout.local_indices(padded_len)
    if spec.row_positions:
        positions = positions.expand(spec.batch, -1)
    with count_ring_bytes() as stats:
        out = ring_attention(
            q,
            k,
            v,
            group=group,
            positions=positions,
            doc_ids=local_docs,
            causal=spec.causal,
            sliding_window=spec.window,
            scale=spec.scale,
        )
        out.backward(local["dout"])
    return {
        "rank": rank,
        "indices": layout.local_indices(padded_len),
        "out": out.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "stats": stats,
        "kv_bytes_one_rank": k.numel() * k.element_size() + v.numel() * v.element_size(),
    }


def _skip_case(group: Any) -> dict[str, Any]:
    """Non-causal contiguous halves with different documents: the remote chunk is fetched but fully masked."""
    rank = dist.get_rank(group)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    docs = torch.full((1, 4), rank + 1)
    with count_ring_bytes() as stats:
        ring_attention(q, k, v, group=group, positions=torch.arange(rank * 4, rank * 4 + 4), doc_ids=docs, causal=False)
    return {"stats": stats}


def _mismatch_case(group: Any) -> str:
    """Ranks disagree on the sliding window: every rank must raise the same clear error (no hang)."""
    rank = dist.get_rank(group)
    q = torch.randn(1, 2, 4, 8)
    try:
        ring_attention(q, q, q, group=group, positions=torch.arange(4) + 4 * rank, sliding_window=3 + rank)
    except ValueError as error:
        return str(error)
    return "no error"


def _invalid_on_one_rank_case(group: Any) -> str:
    """Only rank 1 passes positions of the wrong length: both ranks raise (rank 0 must not wait for rank 1)."""
    rank = dist.get_rank(group)
    q = torch.randn(1, 2, 4, 8)
    positions = torch.arange(4) + 4 * rank if rank == 0 else torch.arange(3)
    try:
        ring_attention(q, q, q, group=group, positions=positions)
    except ValueError as error:
        return str(error)
    return "no error"


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    cases = {
        spec.name: (lambda spec=spec: _run_case(spec, mine)) for i, spec in enumerate(CASES_2) if i % 2 == rank // 2
    }
    cases.update({spec.name: (lambda spec=spec: _run_case(spec, dist.group.WORLD)) for spec in CASES_4})
    if rank // 2 == 0:
        cases["skip_masked_chunk"] = lambda: _skip_case(mine)
        cases["invalid_on_one_rank"] = lambda: _invalid_on_one_rank_case(mine)
    else:
        cases["mismatch"] = lambda: _mismatch_case(mine)
    return run_cases(cases)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(4, _worker)


def _ranks_of(results: list[dict[str, Any]], name: str) -> list[Any]:
    return [case_result(results, name, r) for r in range(len(results)) if name in results[r]]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    error = (actual.double() - expected).abs().max().item()
    bound = rtol * max(expected.abs().max().item(), 1e-12)
    assert error <= bound, f"{what}: max abs error {error:.3e} > {bound:.3e}"


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_matches_dense_attention(results: list[dict[str, Any]], name: str) -> None:
    """Forward and Q/K/V gradients of every rank equal the dense reference at that rank's global positions."""
    spec = ALL_CASES[name]
    data = _inputs(spec)
    q, k, v = (data[n].double().requires_grad_() for n in ("q", "k", "v"))
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(spec.head_dim)
    expected = reference_attention(q, k, v, doc_ids=data["docs"], causal=spec.causal, window=spec.window, scale=scale)
    expected.backward(data["dout"].double())
    rtol = BF16_RTOL if spec.dtype == torch.bfloat16 else FP32_RTOL
    ranks = _ranks_of(results, name)
    assert len(ranks) == spec.cp
    covered = torch.zeros(spec.seq, dtype=torch.bool)
    for local in ranks:
        assert local["out"].dtype == spec.dtype
        real = local["indices"] < spec.seq
        idx = local["indices"][real]
        covered[idx] = True
        for what, got, ref in (
            ("out", local["out"], expected.detach()),
            ("dq", local["dq"], q.grad),
            ("dk", local["dk"], k.grad),
            ("dv", local["dv"], v.grad),
        ):
            _assert_close(got[:, :, real], ref[:, :, idx], rtol, f"{name} rank {local['rank']} {what}")
        # Padding query rows attend to nothing: exactly 0 (never NaN).
        assert (local["out"][:, :, ~real] == 0).all()
    assert covered.all(), "the ranks together must cover every token"


def test_padding_rows_and_empty_documents_are_zero(results: list[dict[str, Any]]) -> None:
    """Packed case: the doc-0 token's output row is exactly zero on whichever rank holds it, with finite grads."""
    spec = ALL_CASES["packed_lb"]
    docs = _inputs(spec)["docs"]
    checked = 0
    for local in _ranks_of(results, "packed_lb"):
        pad = docs[:, local["indices"]] == 0
        out = local["out"].permute(0, 2, 1, 3)[pad]  # [pad tokens, heads, d]
        assert (out == 0).all()
        assert all(torch.isfinite(local[g]).all() for g in ("dq", "dk", "dv"))
        checked += int(pad.sum())
    assert checked == spec.batch  # one doc-0 token per row


def _expected_bytes(spec: Spec, rank: int, kv_bytes: int) -> tuple[int, int]:
    """(forward K/V bytes, backward dK/dV bytes) rank `rank` sends, from the closed-form layout geometry."""
    s_local = spec.seq // spec.cp  # the 4-rank byte cases need no padding
    if spec.layout == "contiguous" and spec.causal and spec.window is not None:
        # Keys within the window of rank r's first query reach back n = ceil((window-1)/S_local) ranks: rank r
        # fetches from min(r, n) previous ranks and is fetched by the next min(C-1-r, n).
        reach = math.ceil((spec.window - 1) / s_local)
        receivers, sources = min(spec.cp - 1 - rank, reach), min(rank, reach)
    elif spec.layout == "load_balanced" and spec.window is None:
        receivers = sources = spec.cp - 1  # the tail chunk of every rank sees every other rank
    else:
        raise AssertionError(f"no closed form for {spec}")
    # A rank sends its K/V to its receivers, and the dK/dV of every chunk it fetched back to the chunk's owner, in
    # fp32 (the accumulation dtype).
    return receivers * kv_bytes, sources * kv_bytes * 4 // spec.dtype.itemsize


@pytest.mark.parametrize("name", ["c4_window_contiguous", "c4_causal_lb"])
def test_bytes_sent_match_formula(results: list[dict[str, Any]], name: str) -> None:
    """A sliding-window layer sends K/V only to the ranks within the window; a full ring sends to all C−1."""
    spec = ALL_CASES[name]
    for local in _ranks_of(results, name):
        forward, grads = _expected_bytes(spec, local["rank"], local["kv_bytes_one_rank"])
        stats = local["stats"]
        assert stats.forward_kv_bytes == forward
        assert stats.backward_kv_bytes == forward  # backward re-fetches exactly what the forward fetched
        assert stats.backward_grad_bytes == grads


def test_sliding_window_plan_on_load_balanced_layout_uses_both_neighbours() -> None:
    """Head-tail with C=4, window ≤ chunk: rank r needs r−1 (head chunk) and r+1 (tail chunk), nobody else."""
    cp, padded = 4, 32
    positions = torch.stack([LoadBalancedLayout(cp_size=cp, cp_rank=r).local_indices(padded) for r in range(cp)])
    needed = ring_plan(positions, causal=True, sliding_window=4)
    for r in range(cp):
        peers = {s for s in range(cp) if needed[r][s] and s != r}
        assert peers == {s for s in (r - 1, r + 1) if 0 <= s < cp}, (r, peers)


def test_fully_masked_chunk_is_skipped(results: list[dict[str, Any]]) -> None:
    for local in _ranks_of(results, "skip_masked_chunk"):
        assert local["stats"].chunks_skipped == 1
        assert local["stats"].chunks_computed == 1


def test_ranks_that_disagree_all_raise(results: list[dict[str, Any]]) -> None:
    messages = _ranks_of(results, "mismatch")
    assert len(messages) == 2
    for message in messages:
        assert "disagree" in message
        assert "rank 0" in message
        assert "rank 1" in message


def test_invalid_input_on_one_rank_raises_on_every_rank(results: list[dict[str, Any]]) -> None:
    """The rank with bad input lists its problems; the other names that rank; neither hangs."""
    bad, good = _ranks_of(results, "invalid_on_one_rank")[1], _ranks_of(results, "invalid_on_one_rank")[0]
    assert "invalid input" in bad
    assert "positions must be integer [S_local=4]" in bad
    assert "rank(s) [1]" in good


def test_single_process_equals_reference() -> None:
    """Without a process group the ring is plain local attention (C = 1)."""
    spec = replace(BASE, name="single", packed=True, window=5, q_heads=4, kv_heads=2)
    data = _inputs(spec)
    out = ring_attention(
        data["q"],
        data["k"],
        data["v"],
        group=None,
        positions=torch.arange(spec.seq),
        doc_ids=data["docs"],
        sliding_window=5,
    )
    expected = reference_attention(
        data["q"], data["k"], data["v"], doc_ids=data["docs"], causal=True, window=5, scale=spec.head_dim**-0.5
    )
    _assert_close(out, expected, FP32_RTOL, "single process")


def test_invalid_input_lists_every_problem() -> None:
    q = torch.randn(1, 3, 4, 8)
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="invalid input") as error:
        ring_attention(q, k, k, group=None, positions=torch.arange(3).float(), sliding_window=0)
    text = str(error.value)
    assert "S_local=4" in text
    assert "positions" in text
    assert "sliding_window" in text
