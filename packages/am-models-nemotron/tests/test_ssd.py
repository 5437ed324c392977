"""The chunked SSD scan equals the token-by-token recurrence (fp64), across chunk boundaries, ragged lengths, packed
documents and cached initial states; and matches transformers' reference scan in fp32. Every test runs both forms of
the within-chunk step: factored (decay scaled out of the Q x Q matrices, the default while decay ranges allow) and
direct (explicit per-head decay matrices, the fallback for strong decay)."""

from __future__ import annotations

import pytest
import torch
from am_nemotron_helpers import assert_close_rel

from am_models_nemotron import segment_sum, ssd_chunked_scan, ssd_sequential_scan
from am_models_nemotron import ssd as ssd_module

# fp64 on both sides: only summation order differs.
FP64_TOL = 1e-10


@pytest.fixture(autouse=True, params=["factored", "direct"])
def within_chunk_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Force one form: a range bound of +inf always allows the factored form, -1 never does."""
    bound = float("inf") if request.param == "factored" else -1.0
    monkeypatch.setattr(ssd_module, "_FACTORED_HALF_RANGE", dict.fromkeys(ssd_module._FACTORED_HALF_RANGE, bound))
    calls: list[str] = []
    for name in ("_factored_intra_and_states", "_direct_intra_and_states"):
        real = getattr(ssd_module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ssd_module, name, spy)
    yield request.param
    assert all(request.param in call for call in calls), f"expected only the {request.param} form, ran {calls}"


def _inputs(
    batch: int, seqlen: int, *, heads: int = 4, head_dim: int = 3, groups: int = 2, state: int = 5, seed: int = 0
):
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    x = torch.randn(batch, seqlen, heads, head_dim, generator=gen, dtype=f64)
    dt = torch.rand(batch, seqlen, heads, generator=gen, dtype=f64) * 0.5 + 0.01
    A = -(torch.rand(heads, generator=gen, dtype=f64) + 0.1)
    B = torch.randn(batch, seqlen, groups, state, generator=gen, dtype=f64)
    C = torch.randn(batch, seqlen, groups, state, generator=gen, dtype=f64)
    D = torch.randn(heads, generator=gen, dtype=f64)
    return x, dt, A, B, C, D


def test_segment_sum_is_sum_over_the_open_closed_interval() -> None:
    a = torch.tensor([1.0, 2.0, 4.0, 8.0])
    seg = segment_sum(a)
    for i in range(4):
        for j in range(4):
            expected = a[j + 1 : i + 1].sum() if i >= j else -torch.inf
            assert seg[i, j] == expected


@pytest.mark.parametrize("seqlen", [1, 8, 21, 40])
def test_chunked_equals_sequential_for_ragged_lengths(seqlen: int) -> None:
    x, dt, A, B, C, D = _inputs(2, seqlen)
    y, final = ssd_chunked_scan(x, dt, A, B, C, chunk_size=8, D=D, return_final_state=True)
    y_ref, final_ref = ssd_sequential_scan(x, dt, A, B, C, D=D)
    assert_close_rel(y, y_ref, rtol=FP64_TOL, what="y")
    assert_close_rel(final, final_ref, rtol=FP64_TOL, what="final state")


def test_initial_state_from_a_cache_continues_the_sequence() -> None:
    x, dt, A, B, C, D = _inputs(2, 29, seed=1)
    split = 13
    _, state = ssd_chunked_scan(
        x[:, :split], dt[:, :split], A, B[:, :split], C[:, :split], chunk_size=8, D=D, return_final_state=True
    )
    y_tail, final = ssd_chunked_scan(
        x[:, split:],
        dt[:, split:],
        A,
        B[:, split:],
        C[:, split:],
        chunk_size=8,
        D=D,
        initial_state=state,
        return_final_state=True,
    )
    y_full, final_full = ssd_sequential_scan(x, dt, A, B, C, D=D)
    assert_close_rel(y_tail, y_full[:, split:], rtol=FP64_TOL, what="continued y")
    assert_close_rel(final, final_full, rtol=FP64_TOL, what="continued state")


def test_packed_documents_equal_each_document_alone() -> None:
    lengths = [5, 11, 3, 13]  # boundaries inside and on chunk edges (5 + 11 = 16)
    seqlen = sum(lengths)
    x, dt, A, B, C, D = _inputs(1, seqlen, seed=2)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    y, final = ssd_chunked_scan(x, dt, A, B, C, chunk_size=8, D=D, seq_idx=seq_idx, return_final_state=True)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        y_doc, final_doc = ssd_sequential_scan(x[:, part], dt[:, part], A, B[:, part], C[:, part], D=D)
        assert_close_rel(y[:, part], y_doc, rtol=FP64_TOL, what=f"document at {start}")
        start += length
    assert_close_rel(final, final_doc, rtol=FP64_TOL, what="final state = last document's state")
    y_seq, _ = ssd_sequential_scan(x, dt, A, B, C, D=D, seq_idx=seq_idx)
    assert_close_rel(y, y_seq, rtol=FP64_TOL, what="sequential with resets")


def test_initial_state_applies_to_the_first_packed_document_only() -> None:
    x, dt, A, B, C, D = _inputs(2, 24, seed=3)
    init = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    seq_idx = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    y, final = ssd_chunked_scan(
        x, dt, A, B, C, chunk_size=8, D=D, seq_idx=seq_idx, initial_state=init, return_final_state=True
    )
    y_ref, final_ref = ssd_sequential_scan(x, dt, A, B, C, D=D, seq_idx=seq_idx, initial_state=init)
    assert_close_rel(y, y_ref, rtol=FP64_TOL, what="y")
    assert_close_rel(final, final_ref, rtol=FP64_TOL, what="final")


def test_gradients_match_the_sequential_recurrence() -> None:
    inputs = [t.requires_grad_() for t in _inputs(1, 19, seed=4)]
    y, _ = ssd_chunked_scan(*inputs[:5], chunk_size=8, D=inputs[5], return_final_state=True)
    grads = torch.autograd.grad(y.square().sum(), inputs)
    y_ref, _ = ssd_sequential_scan(*inputs[:5], D=inputs[5])
    grads_ref = torch.autograd.grad(y_ref.square().sum(), inputs)
    for name, g, g_ref in zip(["x", "dt", "A", "B", "C", "D"], grads, grads_ref, strict=True):
        assert_close_rel(g, g_ref, rtol=1e-9, what=f"grad {name}")


def test_fp32_inputs_compute_in_fp32_and_match_transformers_reference_scan() -> None:
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    x, dt, A, B, C, D = (t.float() for t in _inputs(2, 37, seed=5))
    y, final = ssd_chunked_scan(x, dt, A, B, C, chunk_size=8, D=D, return_final_state=True)
    y_hf, final_hf = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=8, D=D, return_final_states=True)
    assert y.dtype == torch.float32
    assert_close_rel(y, y_hf, rtol=1e-5, what="y vs transformers")
    assert_close_rel(final, final_hf, rtol=1e-5, what="state vs transformers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_strong_decay_falls_back_to_the_direct_form_and_stays_exact(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    monkeypatch.undo()  # the real bounds, not the fixture's
    x, dt, A, B, C, D = _inputs(1, 32, seed=6)
    dt = dt * 400.0  # decay ranges of thousands within an 8-token chunk: exp of them overflows even in fp64
    ran: list[str] = []
    for name in ("_factored_intra_and_states", "_direct_intra_and_states"):
        real = getattr(ssd_module, name)
        monkeypatch.setattr(
            ssd_module, name, lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k)
        )
    y = ssd_chunked_scan(x.to(dtype), dt.to(dtype), A.to(dtype), B.to(dtype), C.to(dtype), chunk_size=8, D=D.to(dtype))
    y_ref, _ = ssd_sequential_scan(x, dt, A, B, C, D=D)
    assert ran == ["_direct_intra_and_states"]
    assert torch.isfinite(y).all()
    assert_close_rel(y.double(), y_ref, rtol=FP64_TOL if dtype == torch.float64 else 1e-5, what="y")
    weak = ssd_chunked_scan(x.to(dtype), (dt / 4000).to(dtype), A.to(dtype), B.to(dtype), C.to(dtype), chunk_size=8)
    assert torch.isfinite(weak).all()
    assert ran[-1] == "_factored_intra_and_states"


def test_runs_under_fake_tensors_with_the_factored_form(within_chunk_form: str) -> None:
    """A dry run (FakeTensorMode: shapes, no values) takes the factored form instead of failing on its range check
    (the fixture checks which form ran)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if within_chunk_form != "factored":
        pytest.skip("fake tensors take the factored form whatever the bound")

    with FakeTensorMode(allow_non_fake_inputs=True):
        x, dt, A, B, C, D = _inputs(2, 21)
        y, final = ssd_chunked_scan(x, dt, A, B, C, chunk_size=8, D=D, return_final_state=True)
    assert y.shape == x.shape
    assert final.shape[:2] == (2, x.shape[2])
