"""Token-level dispatchers without a process group: what is refused, and the shared permutation logic.

Contract: `dispatcher_problems` lists EVERY problem of a dispatcher choice at once (deepep / uccl_ep / hybridep
without expert parallelism, the missing package, no CUDA, knobs the chosen dispatcher does not have), pure, before
any collective; the receiver-side permutation groups received (token, local expert) pairs by expert and the
weighted un-permutation sums each token's experts (the libraries' combine semantics), equal to a plain loop.
The multi-rank behaviour (parity with one process, bad input on one rank) is in test_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from am_moe import DISPATCHERS, dispatcher_problems
from am_moe.token_dispatch import TokenState, _masked_routing, _permute, _unpermute


def test_deepep_without_ep_and_without_the_library_lists_every_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    from am_moe import token_dispatch

    monkeypatch.setattr(token_dispatch, "_installed", lambda module: False)
    problems = dispatcher_problems("deepep", ep=1, device_type="cpu", num_sms=0)
    assert len(problems) == 4
    assert "ep=1: use dispatcher='torch' without expert parallelism, or ep > 1" in problems[0]
    assert "needs the `deep_ep` package, not installed" in problems[1]
    assert "needs tokens on a CUDA GPU" in problems[2]
    assert "dispatcher_num_sms=0 must be a positive int" in problems[3]
    uccl = dispatcher_problems("uccl_ep", ep=2, device_type="cpu")
    assert any("`uccl_ep` package" in p for p in uccl)
    hybrid = dispatcher_problems("hybridep", ep=2, device_type="cpu", async_dispatch=True)
    assert any("`deep_ep` package" in p for p in hybrid)  # HybridEP ships in DeepEP's package
    assert any("HybridEP's dispatch_with_permute has no asynchronous mode" in p for p in hybrid)


def test_torch_dispatchers_refuse_library_knobs_and_unknown_names() -> None:
    assert dispatcher_problems("torch", ep=2, device_type="cpu") == []
    assert dispatcher_problems("torch_token", ep=2, device_type="cpu") == []
    (problem,) = dispatcher_problems("torch_token", ep=2, device_type="cpu", num_sms=32, async_dispatch=True)
    assert "dispatcher_num_sms=32, dispatcher_async_dispatch=True tune the communication kernels" in problem
    (unknown,) = dispatcher_problems("mok", ep=2, device_type="cpu")
    assert f"choose one of {DISPATCHERS}" in unknown


def test_permute_and_weighted_unpermute_equal_a_loop() -> None:
    """Received tokens [N, H] with local indices [N, K] (-1 = another rank's expert): rows grouped by local expert,
    then per token sum_k weight * f_expert(x) over its local experts only."""
    gen = torch.Generator().manual_seed(0)
    recv_x = torch.randn(6, 4, generator=gen)
    recv_idx = torch.tensor([[0, -1], [2, 1], [-1, -1], [1, 0], [2, -1], [0, 2]])
    recv_w = torch.rand(6, 2, generator=gen)
    rows, sizes, pair_rows, row_w = _permute(recv_x, recv_idx, recv_w, local=3)
    assert sizes == [3, 2, 3]
    experts = [torch.randn(4, 4, generator=gen) for _ in range(3)]
    parts = rows.split(sizes)
    out = torch.cat([p @ w for p, w in zip(parts, experts, strict=True)])
    state = TokenState(torch.zeros(3), None, 6, 2, pair_rows, row_w, None)
    got = _unpermute(out, state, torch.float32, torch.float32)
    want = torch.zeros(6, 4)
    for n in range(6):
        for k in range(2):
            e = int(recv_idx[n, k])
            if e >= 0:
                want[n] += recv_w[n, k] * (recv_x[n] @ experts[e])
    torch.testing.assert_close(got, want)
    assert torch.equal(got[2], torch.zeros(4))  # a token with no local expert contributes nothing


def test_padding_selects_no_expert() -> None:
    idx, w = _masked_routing(torch.tensor([[1, 2], [3, 0]]), torch.ones(2, 2), torch.tensor([True, False]))
    assert idx.tolist() == [[1, 2], [-1, -1]]
    assert w.tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_library_dispatchers_refuse_tokens_that_are_not_bf16() -> None:
    from am_moe.token_dispatch import _library_dtype_problems

    (problem,) = _library_dtype_problems("deepep", torch.zeros(2, 4))
    assert "moves bf16 tokens only, got torch.float32" in problem
    assert _library_dtype_problems("deepep", torch.zeros(2, 4, dtype=torch.bfloat16)) == []
    assert _library_dtype_problems("torch_token", torch.zeros(2, 4)) == []
