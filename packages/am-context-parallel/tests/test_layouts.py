"""Layouts: every layout's shards reassemble to the original (property-based), head-tail balances causal work,
shards are differentiable, and `unshard` over a real 2-rank gloo group inverts `shard` (values and gradients)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cp_dist import case_result, run_cases, run_group
from hypothesis import given, settings
from hypothesis import strategies as st

from am_context_parallel import (
    ContiguousLayout,
    IdentityLayout,
    Layout,
    LoadBalancedLayout,
    PackedLayout,
    pad_sequence_dim,
)


def _layouts(kind: str, cp: int, seq_len: int, data: st.DataObject) -> tuple[list[Layout], int]:
    """All ranks' layouts of one kind, and the sequence length to use (packed layouts fix it)."""
    if kind == "identity":
        return [IdentityLayout(cp_size=cp, cp_rank=r) for r in range(cp)], seq_len
    if kind == "load_balanced":
        return [LoadBalancedLayout(cp_size=cp, cp_rank=r) for r in range(cp)], seq_len
    if kind == "contiguous":
        multiple = data.draw(st.integers(1, 3), label="pad_multiple")
        return [ContiguousLayout(cp_size=cp, cp_rank=r, pad_multiple=multiple) for r in range(cp)], seq_len
    lengths = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4), label="seq chunks")
    cu = torch.cumsum(torch.tensor([0] + [n * 2 * cp for n in lengths]), 0)
    return [PackedLayout(cp_size=cp, cp_rank=r, cu_seqlens_padded=cu) for r in range(cp)], int(cu[-1])


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["identity", "load_balanced", "contiguous", "packed"]),
    cp=st.integers(1, 4),
    seq_len=st.integers(1, 20),
    ndim=st.integers(1, 4),
    data=st.data(),
)
def test_shards_of_all_ranks_reassemble(kind: str, cp: int, seq_len: int, ndim: int, data: st.DataObject) -> None:
    layouts, seq_len = _layouts(kind, cp, seq_len, data)
    seq_dim = data.draw(st.integers(0, ndim - 1), label="seq_dim")
    shape = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[seq_dim] = seq_len
    full = torch.randn(*shape)
    parts = [layout.shard(full, seq_dim=seq_dim) for layout in layouts]
    padded_len = layouts[0].padded_length(seq_len)
    assert padded_len >= seq_len
    if kind != "identity":
        # Every rank holds the same number of tokens and together they hold every padded position exactly once.
        assert all(p.shape[seq_dim] == padded_len // cp for p in parts)
        everyone = torch.cat([layout.local_indices(padded_len) for layout in layouts])
        assert torch.equal(torch.sort(everyone).values, torch.arange(padded_len))
    for layout, part in zip(layouts, parts, strict=True):
        # A shard is the padded tensor read at the rank's global positions.
        padded = pad_sequence_dim(full, seq_dim=seq_dim, length=padded_len)
        assert torch.equal(part, padded.index_select(seq_dim, layout.local_indices(padded_len)))
    restored = layouts[0].assemble(parts, seq_dim=seq_dim, seq_len=seq_len)
    assert torch.equal(restored, full)


@given(cp=st.integers(1, 6), chunks=st.integers(1, 4))
def test_head_tail_balances_causal_work(cp: int, chunks: int) -> None:
    """Causal work of a token at position p is p + 1 keys; head-tail gives every rank the same total."""
    padded = 2 * cp * chunks
    work = [int((LoadBalancedLayout(cp_size=cp, cp_rank=r).local_indices(padded) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1


def test_head_tail_diagram() -> None:
    """The README's picture: C = 2, 8 tokens -> rank 0 keeps chunks 0 and 3, rank 1 keeps chunks 1 and 2."""
    assert LoadBalancedLayout(cp_size=2, cp_rank=0).local_indices(8).tolist() == [0, 1, 6, 7]
    assert LoadBalancedLayout(cp_size=2, cp_rank=1).local_indices(8).tolist() == [2, 3, 4, 5]
    assert ContiguousLayout(cp_size=2, cp_rank=1).local_indices(8).tolist() == [4, 5, 6, 7]
    packed = PackedLayout(cp_size=2, cp_rank=0, cu_seqlens_padded=[0, 4, 12])
    assert packed.local_indices(12).tolist() == [0, 3, 4, 5, 10, 11]


def test_shard_is_differentiable_and_out_of_place() -> None:
    """Rank 1 of 2 keeps positions 2..5 of 8: only they receive gradient; the input is untouched."""
    embeds = torch.randn(1, 7, 4, requires_grad=True)  # padded to 8
    before = embeds.detach().clone()
    local = LoadBalancedLayout(cp_size=2, cp_rank=1).shard(embeds, seq_dim=1)
    local.sum().backward()
    assert embeds.grad is not None
    assert embeds.grad[0, :, 0].tolist() == [0, 0, 1, 1, 1, 1, 0]
    assert torch.equal(embeds.detach(), before)


def test_pad_continue_and_errors() -> None:
    positions = torch.tensor([[5, 6, 7], [0, 1, 2]])
    assert pad_sequence_dim(positions, seq_dim=1, length=5, pad_value="continue").tolist() == [
        [5, 6, 7, 8, 9],
        [0, 1, 2, 3, 4],
    ]
    with pytest.raises(ValueError, match="multiples of 2·cp_size=4"):
        PackedLayout(cp_size=2, cp_rank=0, cu_seqlens_padded=[0, 4, 10])
    with pytest.raises(ValueError, match="cu_seqlens_padded ends at 8"):
        PackedLayout(cp_size=2, cp_rank=0, cu_seqlens_padded=[0, 8]).shard(torch.zeros(12), seq_dim=0)


# ---------------------------------------------------------------- real 2-rank group: unshard
PACKED_CU = [0, 4, 12]  # two packed sequences of padded lengths 4 and 8 (multiples of 2C = 4)


def _make_layout(kind: str, rank: int) -> Layout:
    if kind == "load_balanced":
        return LoadBalancedLayout(cp_size=2, cp_rank=rank)
    if kind == "contiguous":
        return ContiguousLayout(cp_size=2, cp_rank=rank)
    if kind == "packed":
        return PackedLayout(cp_size=2, cp_rank=rank, cu_seqlens_padded=PACKED_CU)
    return IdentityLayout(cp_size=2, cp_rank=rank)


def _seq_len(kind: str) -> int:
    return PACKED_CU[-1] if kind == "packed" else 7  # 7 needs padding on the other layouts


def _unshard_case(kind: str) -> dict[str, Any]:
    rank = dist.get_rank()
    layout = _make_layout(kind, rank)
    seq_len = _seq_len(kind)
    full = torch.arange(2 * seq_len * 3, dtype=torch.float32).reshape(2, seq_len, 3)
    local = layout.shard(full, seq_dim=1).clone().requires_grad_()
    gathered = layout.unshard(local, seq_dim=1, group=dist.group.WORLD, seq_len=seq_len)
    weights = torch.arange(gathered.numel(), dtype=torch.float32).reshape(gathered.shape)
    (gathered * weights).sum().backward()  # the same loss on every rank: "slice" gradients
    local_sum = local.detach().clone().requires_grad_()
    gathered_sum = layout.unshard(local_sum, seq_dim=1, group=dist.group.WORLD, seq_len=seq_len, grad="sum")
    (gathered_sum * weights * (rank + 1)).sum().backward()  # a different loss per rank: "sum" gradients
    return {
        "gathered": gathered.detach(),
        "grad": local.grad,
        "grad_sum": local_sum.grad,
        "expected_grad": layout.shard(weights, seq_dim=1),
    }


RANDOM_ROUND_TRIPS = 32


def _random_round_trips() -> list[str]:
    """shard -> unshard through the real group on seeded random shapes, seq dims and layouts (same on every rank)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(2024)
    kinds = ["identity", "load_balanced", "contiguous", "packed"]
    failures = []

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    for case in range(RANDOM_ROUND_TRIPS):
        kind = kinds[case % len(kinds)]
        ndim = draw(1, 4)
        seq_dim = draw(0, ndim - 1)
        shape = [draw(1, 3) for _ in range(ndim)]
        if kind == "packed":
            cu = torch.cumsum(torch.tensor([0] + [4 * draw(1, 3) for _ in range(draw(1, 3))]), 0)
            layout: Layout = PackedLayout(cp_size=2, cp_rank=rank, cu_seqlens_padded=cu)
            shape[seq_dim] = int(cu[-1])
        elif kind == "contiguous":
            layout = ContiguousLayout(cp_size=2, cp_rank=rank, pad_multiple=draw(1, 3))
            shape[seq_dim] = draw(1, 20)
        elif kind == "load_balanced":
            layout = LoadBalancedLayout(cp_size=2, cp_rank=rank)
            shape[seq_dim] = draw(1, 20)
        else:
            layout = IdentityLayout(cp_size=2, cp_rank=rank)
            shape[seq_dim] = draw(1, 20)
        full = torch.randn(*shape, generator=gen)
        local = layout.shard(full, seq_dim=seq_dim)
        restored = layout.unshard(local, seq_dim=seq_dim, group=dist.group.WORLD, seq_len=shape[seq_dim])
        if not torch.equal(restored, full):
            failures.append(f"{layout!r} shape={shape} seq_dim={seq_dim}")
    return failures


def _wrong_group_case() -> str:
    try:
        LoadBalancedLayout(cp_size=4, cp_rank=0).unshard(torch.zeros(1, 2), seq_dim=1, group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "no error"


UNSHARD_KINDS = ["load_balanced", "contiguous", "packed", "identity"]


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    cases = {kind: (lambda kind=kind: _unshard_case(kind)) for kind in UNSHARD_KINDS}
    cases["random_round_trips"] = _random_round_trips
    cases["wrong_group"] = _wrong_group_case
    return run_cases(cases)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(2, _worker)


@pytest.mark.parametrize("kind", UNSHARD_KINDS)
def test_unshard_inverts_shard_with_gradients(results: list[dict[str, Any]], kind: str) -> None:
    seq_len = _seq_len(kind)
    full = torch.arange(2 * seq_len * 3, dtype=torch.float32).reshape(2, seq_len, 3)
    for rank in range(2):
        local = case_result(results, kind, rank)
        assert torch.equal(local["gathered"], full)
        if kind == "identity":
            continue  # no communication: the gradient is the replicated computation's own
        assert torch.equal(local["grad"], local["expected_grad"])
        # Summed over ranks: rank 0's loss weighs 1x, rank 1's 2x.
        assert torch.equal(local["grad_sum"], 3 * local["expected_grad"])


def test_unshard_round_trips_on_random_shapes(results: list[dict[str, Any]]) -> None:
    """Every layout, random shapes and sequence dims, through the real all-gather: unshard(shard(x)) == x."""
    for rank in range(2):
        assert case_result(results, "random_round_trips", rank) == []


def test_unshard_rejects_group_of_wrong_size(results: list[dict[str, Any]]) -> None:
    message = case_result(results, "wrong_group", 0)
    assert "2 ranks" in message
    assert "over 4" in message
