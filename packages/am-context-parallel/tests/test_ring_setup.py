"""Ring setup once per batch context: after the first call, an attention call only moves K/V (and gradients).

One gloo group of 4 real processes: a load-balanced context over all 4 ranks (packed documents, padding) and a
contiguous context on each 2-rank sub-group. Each case calls `ctx.attention` as a model's layers would — full and
sliding layers, GQA and another head dim, a bidirectional layer — then runs ONE backward through all of them. While
it runs, the test process counts the REAL calls of every torch.distributed collective and of every tensor-to-host
conversion (`tolist`, `item`, `bool(t)`, `int(t)`, ...) by wrapping them (the wrappers call the originals). The
outputs and Q/K/V gradients are compared with dense fp64 attention on the unsharded sequence.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cp_dist import case_result, reference_attention, run_cases, run_group

from am_context_parallel import (
    ContiguousLayout,
    Layout,
    LoadBalancedLayout,
    RingAttentionContext,
    count_ring_bytes,
    ring_attention,
)

FP32_RTOL = 1e-5  # fp32 ring vs fp64 dense reference (chunked log-sum-exp merge reorders fp32 sums)
_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)
_HOST_SYNCS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")
_MISSING = object()

# (name, causal, sliding_window, query heads, key/value heads, head dim): the "layers" of one forward.
LAYERS = [
    ("full", True, None, 4, 2, 8),
    ("sliding", True, 3, 2, 2, 8),
    ("full_again", True, None, 4, 2, 8),
    ("sliding_other_heads", True, 3, 4, 1, 16),
    ("bidirectional", False, None, 2, 2, 8),
    ("bidirectional_again", False, None, 2, 2, 8),
]
SEEN_BEFORE = {"full_again", "sliding_other_heads", "bidirectional_again"}  # same (causal, window) as an earlier layer


@contextmanager
def _counting() -> Iterator[Counter[str]]:
    """Count real calls of torch.distributed collectives and tensor-to-host conversions (originals still run)."""
    counts: Counter[str] = Counter()
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, vars(owner).get(name, _MISSING)))

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[label] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            wrap(dist, name, f"collective:{name}")
    wrap(dist, "batch_isend_irecv", "p2p:batch_isend_irecv")
    for name in _HOST_SYNCS:
        wrap(torch.Tensor, name, f"sync:{name}")
    try:
        yield counts
    finally:
        for owner, name, previous in reversed(saved):
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


def _kinds(counts: Counter[str], prefix: str) -> dict[str, int]:
    return {k: v for k, v in counts.items() if k.startswith(prefix)}


def _inputs(name: str, seq: int, heads: int, kv_heads: int, dim: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + seq)
    return {
        "q": torch.randn(2, heads, seq, dim, generator=gen),
        "k": torch.randn(2, kv_heads, seq, dim, generator=gen),
        "v": torch.randn(2, kv_heads, seq, dim, generator=gen),
        "dout": torch.randn(2, heads, seq, dim, generator=gen),
    }


def _docs(seq: int) -> torch.Tensor:
    """Row 0: two documents then one padding token; row 1: one document then two padding tokens."""
    docs = torch.zeros(2, seq, dtype=torch.long)
    docs[0, : seq // 2], docs[0, seq // 2 : seq - 1] = 1, 2
    docs[1, : seq - 2] = 1
    return docs


def _layout(kind: str, cp: int, rank: int) -> Layout:
    return (
        ContiguousLayout(cp_size=cp, cp_rank=rank)
        if kind == "contiguous"
        else LoadBalancedLayout(cp_size=cp, cp_rank=rank)
    )


def _context_case(kind: str, seq: int, group: Any) -> dict[str, Any]:
    """All LAYERS through one context, then one backward; counts per call and for the backward."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = _layout(kind, cp, rank)
    padded = layout.padded_length(seq)
    ctx = RingAttentionContext(
        group=group,
        layout=layout,
        positions=layout.local_indices(padded),
        doc_ids=layout.shard(_docs(seq), seq_dim=1, pad_value=0),
        seq_len=seq,
        padded_len=padded,
        route_hf_attention=False,
    )
    leaves, outs, per_call = {}, {}, {}
    loss = torch.zeros(())
    with count_ring_bytes() as stats:
        for name, causal, window, heads, kv_heads, dim in LAYERS:
            data = {n: layout.shard(t, seq_dim=2) for n, t in _inputs(name, seq, heads, kv_heads, dim).items()}
            q, k, v = (data[n].clone().requires_grad_() for n in ("q", "k", "v"))
            with _counting() as counts:
                out = ctx.attention(q, k, v, causal=causal, sliding_window=window)
            per_call[name] = dict(counts)
            leaves[name], outs[name] = (q, k, v), out.detach()
            loss = loss + (out * data["dout"]).sum()
        with _counting() as backward_counts:
            loss.backward()
    return {
        "indices": layout.local_indices(padded),
        "per_call": per_call,
        "backward": dict(backward_counts),
        "setup_gathers": stats.setup_gathers,
        "calls": stats.calls,
        "outs": outs,
        "grads": {name: tuple(t.grad for t in leaves[name]) for name in leaves},
    }


def _standalone_case(group: Any) -> dict[str, Any]:
    """The standalone function keeps working without a context: it sets the ring up on every call."""
    rank = dist.get_rank(group)
    layout = LoadBalancedLayout(cp_size=dist.get_world_size(group), cp_rank=rank)
    data = {n: layout.shard(t, seq_dim=2) for n, t in _inputs("standalone", 16, 2, 2, 8).items()}
    calls = []
    with count_ring_bytes() as stats:
        for _ in range(2):
            with _counting() as counts:
                ring_attention(data["q"], data["k"], data["v"], group=group, positions=layout.local_indices(16))
            calls.append(_kinds(counts, "collective:"))
    return {"calls": calls, "setup_gathers": stats.setup_gathers}


def _bad_positions_case(kind: str, group: Any) -> str:
    """Positions that are not global positions of one layout: every rank must raise the same error (no hang)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q = torch.randn(2, 2, 4, 8)
    if kind == "local":  # each rank counts its own 4 tokens from 0
        positions = torch.arange(4)
    elif kind == "rope_restarting":  # position ids of two packed 8-token documents over 4 contiguous shards
        positions = torch.arange(8).repeat(2)[4 * rank : 4 * rank + 4]
    else:  # "gaps": distinct, but rank r's tokens start at 8r: the ranks do not tile one sequence
        positions = torch.arange(4) + 8 * rank
    try:
        if kind == "rope_restarting":  # through a context: checked at its first attention call
            layout = ContiguousLayout(cp_size=cp, cp_rank=rank)
            ctx = RingAttentionContext(
                group=group, layout=layout, positions=positions, doc_ids=None, seq_len=4 * cp, padded_len=4 * cp
            )
            ctx.attention(q, q, q)
        else:
            ring_attention(q, q, q, group=group, positions=positions)
    except ValueError as error:
        return str(error)
    return "no error"


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return run_cases(
        {
            "load_balanced_cp4": lambda: _context_case("load_balanced", 29, dist.group.WORLD),
            "contiguous_cp2": lambda: _context_case("contiguous", 13, pairs[rank // 2]),
            "standalone_cp2": lambda: _standalone_case(pairs[rank // 2]),
            "local_positions_cp2": lambda: _bad_positions_case("local", pairs[rank // 2]),
            "rope_positions_cp4": lambda: _bad_positions_case("rope_restarting", dist.group.WORLD),
            "gaps_cp2": lambda: _bad_positions_case("gaps", pairs[rank // 2]),
            # the group still works after every rank raised together
            "after_errors_cp4": lambda: _context_case("load_balanced", 29, dist.group.WORLD)["setup_gathers"],
        }
    )


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(4, _worker)


CASES = {"load_balanced_cp4": 29, "contiguous_cp2": 13}


@pytest.mark.parametrize("case", list(CASES))
def test_only_the_first_call_gathers(results: list[dict[str, Any]], case: str) -> None:
    """The first call all-gathers (header, positions, doc ids); no later call and no backward issues a collective."""
    for rank in range(4):
        got = case_result(results, case, rank)
        first, *later = LAYERS
        assert _kinds(got["per_call"][first[0]], "collective:"), "the first call must set the ring up"
        for name, *_ in later:
            assert _kinds(got["per_call"][name], "collective:") == {}, (rank, name, got["per_call"][name])
            assert got["per_call"][name].get("p2p:batch_isend_irecv", 0) > 0, (rank, name)  # K/V do move
        assert _kinds(got["backward"], "collective:") == {}, (rank, got["backward"])
        assert (got["setup_gathers"], got["calls"]) == (1, len(LAYERS))


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_sync_once_a_layer_kind_is_planned(results: list[dict[str, Any]], case: str) -> None:
    """Host syncs happen only while a (causal, window) plan is built (first call of that kind): a layer of a kind
    seen before, and the whole backward, never wait for the device."""
    for rank in range(4):
        got = case_result(results, case, rank)
        assert _kinds(got["per_call"]["full"], "sync:"), "the counter must see the setup's syncs"
        for name in SEEN_BEFORE:
            assert _kinds(got["per_call"][name], "sync:") == {}, (rank, name, got["per_call"][name])
        assert _kinds(got["backward"], "sync:") == {}, (rank, got["backward"])


@pytest.mark.parametrize("case", list(CASES))
def test_cached_setup_still_equals_dense_attention(results: list[dict[str, Any]], case: str) -> None:
    """Every layer's output and Q/K/V gradients equal dense fp64 attention at each rank's global positions."""
    seq = CASES[case]
    docs = _docs(seq)
    for layer, causal, window, heads, kv_heads, dim in LAYERS:
        data = _inputs(layer, seq, heads, kv_heads, dim)
        q, k, v = (data[n].double().requires_grad_() for n in ("q", "k", "v"))
        expected = reference_attention(q, k, v, doc_ids=docs, causal=causal, window=window, scale=1 / math.sqrt(dim))
        expected.backward(data["dout"].double())
        for rank in range(4):
            got = case_result(results, case, rank)
            real = got["indices"] < seq
            idx = got["indices"][real]
            for what, value, ref in zip(
                ("out", "dq", "dk", "dv"),
                (got["outs"][layer], *got["grads"][layer]),
                (expected.detach(), q.grad, k.grad, v.grad),
                strict=True,
            ):
                error = (value[:, :, real].double() - ref[:, :, idx]).abs().max().item()
                bound = FP32_RTOL * max(ref.abs().max().item(), 1e-12)
                assert error <= bound, f"{case} rank {rank} {layer} {what}: {error:.3e} > {bound:.3e}"


def test_standalone_ring_attention_sets_up_per_call(results: list[dict[str, Any]]) -> None:
    for rank in range(4):
        got = case_result(results, "standalone_cp2", rank)
        assert all(call.get("collective:all_gather", 0) >= 2 for call in got["calls"]), got
        assert got["setup_gathers"] == 2


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("local_positions_cp2", ["not the GLOBAL positions", "row 0: position 0 is held by ranks [0, 1]"]),
        ("rope_positions_cp4", ["row 0: position 0 is held by ranks [0, 2]", "restart at every packed document"]),
        ("gaps_cp2", ["row 0: 8 positions span 0..11, leaving gaps"]),
    ],
)
def test_positions_that_are_not_global_raise_on_every_rank(
    results: list[dict[str, Any]], case: str, needles: list[str]
) -> None:
    """Per-rank positions (each rank counting from 0) would silently give wrong attention; every rank refuses them
    with the same message, and the group stays usable."""
    for rank in range(4):
        message = case_result(results, case, rank)
        for needle in needles:
            assert needle in message, (rank, message)
        assert case_result(results, "after_errors_cp4", rank) == 1


def test_one_process_positions_are_checked_too() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="position 1 is held 2 times by rank 0"):
        ring_attention(q, q, q, group=None, positions=torch.tensor([0, 1, 1, 2]))
    with pytest.raises(ValueError, match=r"span 0\.\.5, leaving gaps"):
        ring_attention(q, q, q, group=None, positions=torch.tensor([0, 1, 2, 5]))
    # Any contiguous range is a valid global sequence: masks compare differences only.
    torch.testing.assert_close(
        ring_attention(q, q, q, group=None, positions=torch.arange(4) + 10),
        ring_attention(q, q, q, group=None, positions=torch.arange(4)),
        rtol=0,
        atol=0,
    )


def test_a_bool_sliding_window_raises_the_librarys_message() -> None:
    """True is an int in Python: it must not pass as a window of 1."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(
        ValueError, match=r"sliding_window must be a positive int \(a window length\) or None; got True"
    ):
        ring_attention(q, q, q, group=None, positions=torch.arange(4), sliding_window=True)
    ctx = RingAttentionContext(
        group=None,
        layout=ContiguousLayout(cp_size=1, cp_rank=0),
        positions=torch.arange(4),
        doc_ids=None,
        seq_len=4,
        padded_len=4,
    )
    with pytest.raises(ValueError, match="got False"):
        ctx.attention(q, q, q, sliding_window=False)
