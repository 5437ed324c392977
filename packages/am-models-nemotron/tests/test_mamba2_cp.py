"""Mamba2 under context parallelism equals the single-process mixer: outputs and every gradient.

The first tests simulate ranks in one process (the sequence split into blocks, the per-block pairs combined in rank
order) against the token-by-token recurrence in fp64. The rest run on one 4-rank gloo group launched for the whole
module: the mixer with CP = 4 (the whole group) and CP = 2 (two independent pairs of ranks), with and without packed
documents (a document spanning every rank, boundaries inside blocks and exactly at rank edges), padding, blocks that
are and are not multiples of the scan's chunk, both forms of the within-chunk SSD step, under activation
checkpointing, in bf16; the scan alone in fp64 at CP = 2, 3 (ranks 0-2) and 4; the bytes sent against
`mamba_cp_bytes_per_layer`; a group of one rank; and the refusals. The reference is the same mixer run on the whole
sequence in the same process; parameter gradients are summed over the CP group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from am_nemotron_dist import case_result, run_cases, run_group
from am_nemotron_helpers import assert_close_rel, randomize_, tiny_hf_config
from torch.utils.checkpoint import checkpoint

from am_models_nemotron import (
    Mamba2CPContext,
    Mamba2Mixer,
    NemotronConfig,
    NemotronHybridCache,
    count_mamba_cp_bytes,
    default_backend,
    mamba_cp_bytes_per_layer,
    ssd_sequential_scan,
)
from am_models_nemotron import ssd as ssd_module
from am_models_nemotron.mamba2_cp import _add_entering_state, _combine, _scan_block, _state_rounds

WORLD = 4
# fp32 with a different summation order (block-local scans, state passed across ranks, gradients summed over ranks).
FP32_RTOL = 1e-5
# fp64 on both sides: only the summation order differs.
FP64_RTOL = 1e-10
# bf16 storage: the reference rounds at other places than the CP run (halo gradients summed on another rank).
BF16_RTOL = 1.5e-2
BATCH = 2
GRAD_NAMES = ("x", "dt", "A", "B", "C", "D")
FORMS = ("factored", "direct")
LAYOUTS = ("plain", "packed", "padded", "packed_padded")
BLOCKS = (11, 16)  # tokens per rank: 11 is not a multiple of the scan chunk (8), 16 is


def _ssd_inputs(seqlen: int, *, seed: int, heads: int = 4, head_dim: int = 3, groups: int = 2, state: int = 5):
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    x = torch.randn(BATCH, seqlen, heads, head_dim, generator=gen, dtype=f64)
    dt = torch.rand(BATCH, seqlen, heads, generator=gen, dtype=f64) * 0.5 + 0.01
    A = -(torch.rand(heads, generator=gen, dtype=f64) + 0.1)
    B = torch.randn(BATCH, seqlen, groups, state, generator=gen, dtype=f64)
    C = torch.randn(BATCH, seqlen, groups, state, generator=gen, dtype=f64)
    D = torch.randn(heads, generator=gen, dtype=f64)
    return x, dt, A, B, C, D


def _document_ids(seqlen: int, block: int) -> torch.Tensor:
    """[2, S] global ids. Row 0: documents start inside the first block (3), exactly at the first rank edge, and 5
    tokens into the block after next (or on the last token), so one document spans a rank edge. Row 1: a document
    starts one token before the first rank edge and runs through every later rank to 2 tokens before the end."""
    starts = torch.zeros(2, seqlen, dtype=torch.long)
    starts[0, [3, block, min(block + 5 + block, seqlen - 1)]] = 1
    starts[1, [block - 1, seqlen - 2]] = 1
    return starts.cumsum(dim=1) + 7  # arbitrary offset: ids are labels, not positions


def _layout(name: str, seqlen: int, block: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(seq_idx, attention_mask) of a case; padding covers the last block + 2 tokens of row 1 (crosses an edge)."""
    seq_idx = _document_ids(seqlen, block) if name.startswith("packed") else None
    mask = None
    if name.endswith("padded"):
        mask = torch.ones(2, seqlen, dtype=torch.long)
        mask[1, seqlen - block - 2 :] = 0
    return seq_idx, mask


# --- single process: the combine math with simulated ranks ---------------------------------------------------------


def _simulated_ranks(inputs, *, blocks: int, seq_idx: torch.Tensor | None, chunk_size: int) -> torch.Tensor:
    """Split the sequence into `blocks` contiguous blocks, scan each from zero, combine the pairs in rank order."""
    x, dt, A, B, C, D = inputs
    length = x.shape[1] // blocks
    outputs, entering = [], None
    for rank in range(blocks):
        part = slice(rank * length, (rank + 1) * length)
        block = _scan_block(
            x[:, part],
            dt[:, part],
            A,
            B[:, part],
            C[:, part],
            chunk_size=chunk_size,
            D=D,
            seq_idx=None if seq_idx is None else seq_idx[:, part],
            previous_seq_idx=None if seq_idx is None or rank == 0 else seq_idx[:, rank * length - 1],
            is_first_block=rank == 0,
        )
        entering = torch.zeros_like(block.pair) if entering is None else entering
        outputs.append(_add_entering_state(block, entering))
        entering = _combine(entering, block.pair)
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("blocks", [2, 3, 5])
@pytest.mark.parametrize("packed", [False, True])
def test_simulated_ranks_equal_the_recurrence_with_gradients(blocks: int, packed: bool) -> None:
    seqlen = 30
    inputs = [t.requires_grad_() for t in _ssd_inputs(seqlen, seed=blocks)]
    seq_idx = _document_ids(seqlen, seqlen // blocks) if packed else None
    weights = torch.randn(BATCH, seqlen, 4, 3, dtype=torch.float64)
    y = _simulated_ranks(inputs, blocks=blocks, seq_idx=seq_idx, chunk_size=4)
    grads = torch.autograd.grad((y * weights).sum(), inputs)
    y_ref, _ = ssd_sequential_scan(*inputs[:5], D=inputs[5], seq_idx=seq_idx)
    grads_ref = torch.autograd.grad((y_ref * weights).sum(), inputs)
    assert_close_rel(y, y_ref, rtol=FP64_RTOL, what="y")
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert_close_rel(g, g_ref, rtol=FP64_RTOL, what=f"grad {name}")


def test_a_reset_stops_earlier_states_without_nan() -> None:
    earlier = torch.tensor([[2.0, 3.0, -1.0]], requires_grad=True)  # state (2, 3), log-decay -1
    later = torch.tensor([[5.0, 7.0, -torch.inf]], requires_grad=True)  # a document starts in this block
    combined = _combine(earlier, later)
    assert combined.tolist() == [[5.0, 7.0, -torch.inf]]
    combined[..., :-1].sum().backward()
    assert earlier.grad is not None
    assert later.grad is not None
    assert earlier.grad.tolist() == [[0.0, 0.0, 0.0]]
    assert later.grad.tolist() == [[1.0, 1.0, 0.0]]


@pytest.mark.parametrize("size", range(1, 65))
def test_the_scan_schedule_gives_every_rank_exactly_the_lower_ranks(size: int) -> None:
    """Follow the rounds of `_exclusive_scan_across_ranks` on rank intervals: rank r must end with [0, r - 1]."""
    first, *rest = _state_rounds(size)
    held = [(r - first, r - first) if r >= first else None for r in range(size)]  # closed interval or identity
    for offset in rest:
        received = [held[r - offset] if r >= offset else None for r in range(size)]
        for r, (earlier, mine) in enumerate(zip(received, held, strict=True)):
            if earlier is not None and mine is not None:
                assert earlier[1] + 1 == mine[0], f"size {size}: rank {r} would combine non-adjacent blocks"
                held[r] = (earlier[0], mine[1])
            elif earlier is not None:
                held[r] = earlier
    assert held == [None] + [(0, r - 1) for r in range(1, size)]
    assert len(_state_rounds(size)) == 1 + max(0, size - 2).bit_length()  # 1 + ceil(log2(C - 1))


# --- real ranks ----------------------------------------------------------------------------------------------------


def _mixer(dtype: torch.dtype = torch.float32) -> Mamba2Mixer:
    cfg = NemotronConfig.from_any(tiny_hf_config("M"))
    torch.manual_seed(0)
    mixer = Mamba2Mixer(cfg, 0, backend=default_backend())
    mixer.init_weights(num_hidden_layers=1, rescale_prenorm_residual=False)
    randomize_(mixer, seed=5)
    return mixer.to(dtype) if dtype != torch.float32 else mixer


@contextlib.contextmanager
def _forced_form(form: str) -> Iterator[list[str]]:
    """Force one within-chunk form of the SSD scan (as in test_ssd) and record which ran."""
    saved = {name: getattr(ssd_module, name) for name in ("_FACTORED_HALF_RANGE", *_FORM_FUNCTIONS)}
    bound = float("inf") if form == "factored" else -1.0
    ssd_module._FACTORED_HALF_RANGE = dict.fromkeys(saved["_FACTORED_HALF_RANGE"], bound)
    ran: list[str] = []
    for name in _FORM_FUNCTIONS:

        def spy(*args, _real=saved[name], _name=name, **kwargs):
            ran.append(_name)
            return _real(*args, **kwargs)

        setattr(ssd_module, name, spy)
    try:
        yield ran
    finally:
        for name, value in saved.items():
            setattr(ssd_module, name, value)


_FORM_FUNCTIONS = ("_factored_intra_and_states", "_direct_intra_and_states")


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float(
        (actual.detach().double() - expected.detach().double()).abs().max()
        / expected.detach().double().abs().max().clamp(min=1e-30)
    )


def _mixer_case(
    cp: Mamba2CPContext,
    *,
    block: int,
    layout: str,
    form: str,
    dtype: torch.dtype = torch.float32,
    checkpointed: bool = False,
) -> dict[str, float]:
    """Relative errors of the CP block's output and of every gradient against the single-process run.

    checkpointed: the CP forward runs under activation checkpointing, so its transfers run again inside the backward.
    """
    mixer = _mixer(dtype)
    seqlen = block * cp.size
    gen = torch.Generator().manual_seed(block + len(layout))
    x = torch.randn(BATCH, seqlen, 32, generator=gen).to(dtype)
    weights = torch.randn(BATCH, seqlen, 32, generator=gen).to(dtype)
    seq_idx, mask = _layout(layout, seqlen, block)
    part = slice(cp.rank * block, (cp.rank + 1) * block)
    with _forced_form(form) as ran:
        x_ref = x.clone().requires_grad_()
        out_ref = mixer(x_ref, seq_idx=seq_idx, attention_mask=mask)
        (out_ref.float() * weights.float()).sum().backward()
        grads_ref = {n: p.grad.clone() for n, p in mixer.named_parameters()}
        mixer.zero_grad(set_to_none=True)

        x_local = x[:, part].clone().requires_grad_()
        run = functools.partial(
            mixer,
            seq_idx=None if seq_idx is None else seq_idx[:, part],
            attention_mask=None if mask is None else mask[:, part],
            cp=cp,
        )
        out = checkpoint(run, x_local, use_reentrant=False) if checkpointed else run(x_local)
        (out.float() * weights[:, part].float()).sum().backward()
    if not ran or not all(form in name for name in ran):
        raise AssertionError(f"expected only the {form} form, ran {set(ran)}")
    errors = {"output": _rel(out, out_ref[:, part].detach()), "grad input": _rel(x_local.grad, x_ref.grad[:, part])}
    for name, param in mixer.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=cp.group)
        errors[f"grad {name}"] = _rel(grad, grads_ref[name])
    return errors


def _scan_case(cp: Mamba2CPContext, *, block: int, packed: bool) -> dict[str, float]:
    """The scan alone in fp64 (rtol 1e-10): outputs and gradients of x, dt, A, B, C, D."""
    from am_models_nemotron import ssd_chunked_scan_cp

    seqlen = block * cp.size
    inputs = [t.requires_grad_() for t in _ssd_inputs(seqlen, seed=block)]
    seq_idx = _document_ids(seqlen, block) if packed else None
    weights = torch.randn(BATCH, seqlen, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y_ref, _ = ssd_sequential_scan(*inputs[:5], D=inputs[5], seq_idx=seq_idx)
    grads_ref = torch.autograd.grad((y_ref * weights).sum(), inputs)
    part = slice(cp.rank * block, (cp.rank + 1) * block)
    local = [t.detach()[:, part].clone().requires_grad_() if t.dim() > 1 else t for t in inputs]
    y = ssd_chunked_scan_cp(
        local[0],
        local[1],
        local[2],
        local[3],
        local[4],
        chunk_size=4,
        cp=cp,
        D=local[5],
        seq_idx=None if seq_idx is None else seq_idx[:, part],
        previous_seq_idx=None if seq_idx is None or cp.rank == 0 else seq_idx[:, cp.rank * block - 1],
    )
    grads = torch.autograd.grad((y * weights[:, part]).sum(), local)
    errors = {"y": _rel(y, y_ref[:, part])}
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if g.dim() == 1:  # A and D: every rank holds a partial sum
            g = g.clone()
            dist.all_reduce(g, group=cp.group)
            errors[f"grad {name}"] = _rel(g, g_ref)
        else:
            errors[f"grad {name}"] = _rel(g, g_ref[:, part])
    return errors


def _bytes_case(cp: Mamba2CPContext, *, block: int, packed: bool) -> tuple[dict[str, int], dict[str, int]]:
    """(measured, formula) bytes of one mixer forward + backward on this rank."""
    mixer = _mixer()
    seqlen = block * cp.size
    x = torch.randn(BATCH, seqlen, 32)[:, cp.rank * block : (cp.rank + 1) * block].requires_grad_()
    seq_idx = _document_ids(seqlen, block)[:, cp.rank * block : (cp.rank + 1) * block] if packed else None
    with count_mamba_cp_bytes() as stats:
        mixer(x, seq_idx=seq_idx, cp=cp).sum().backward()
    formula = mamba_cp_bytes_per_layer(
        NemotronConfig.from_any(tiny_hf_config("M")),
        batch_size=BATCH,
        cp_rank=cp.rank,
        cp_size=cp.size,
        conv_dtype=torch.float32,
        packed=packed,
    )
    return vars(stats), vars(formula)


def _size_one_case(cp: Mamba2CPContext) -> bool:
    """A CP group of one rank runs the single-process path: bitwise equal outputs."""
    mixer = _mixer()
    x = torch.randn(BATCH, 13, 32, generator=torch.Generator().manual_seed(3))
    seq_idx = _document_ids(13, 6)
    return torch.equal(mixer(x, seq_idx=seq_idx, cp=cp), mixer(x, seq_idx=seq_idx))


def _refusal_case(cp: Mamba2CPContext) -> str:
    """Every problem in one error, raised before any transfer (all ranks raise together)."""
    mixer = _mixer()
    cfg = NemotronConfig.from_any(tiny_hf_config("M"))
    with pytest.raises(ValueError, match="under context parallelism") as error:
        mixer(torch.randn(BATCH, 2, 32), cache=NemotronHybridCache(cfg, BATCH), seq_idx=torch.zeros(1, 2), cp=cp)
    return str(error.value)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    whole = Mamba2CPContext(dist.new_group(list(range(world_size))))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    singles = [dist.new_group([r]) for r in range(world_size)]
    triple = dist.new_group([0, 1, 2])  # an odd size: rank 3 sits those cases out
    contexts = {4: whole, 2: Mamba2CPContext(pairs[rank // 2])}
    cases: dict[str, Any] = {}
    for size, cp in contexts.items():
        for block in BLOCKS:
            for layout in LAYOUTS:
                for form in FORMS:
                    key = f"mixer cp={size} block={block} {layout} {form}"
                    cases[key] = functools.partial(_mixer_case, cp, block=block, layout=layout, form=form)
            for packed in (False, True):
                cases[f"scan cp={size} block={block} packed={packed}"] = functools.partial(
                    _scan_case, cp, block=block, packed=packed
                )
        for block in (5, 24):
            for packed in (False, True):
                cases[f"bytes cp={size} block={block} packed={packed}"] = functools.partial(
                    _bytes_case, cp, block=block, packed=packed
                )
        cases[f"bf16 cp={size}"] = functools.partial(
            _mixer_case, cp, block=11, layout="packed", form="factored", dtype=torch.bfloat16
        )
        cases[f"checkpointed cp={size}"] = functools.partial(
            _mixer_case, cp, block=11, layout="packed", form="factored", checkpointed=True
        )
        cases[f"refusal cp={size}"] = functools.partial(_refusal_case, cp)
    for packed in (False, True):
        cases[f"scan cp=3 block=11 packed={packed}"] = (
            functools.partial(_scan_case, Mamba2CPContext(triple), block=11, packed=packed) if rank < 3 else dict
        )
    cases["size one"] = functools.partial(_size_one_case, Mamba2CPContext(singles[rank]))
    return run_cases(cases)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(WORLD, _worker)


def _check_errors(results: list[dict[str, Any]], key: str, rtol: float) -> None:
    for rank in range(WORLD):
        errors = case_result(results, key, rank)  # {} on a rank outside the case's group
        bad = {name: err for name, err in errors.items() if not err <= rtol}
        assert not bad, f"{key}, rank {rank}: relative errors above {rtol}: {bad}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("size", [2, 4])
def test_mixer_output_and_every_gradient_equal_the_single_process_mixer(
    results: list[dict[str, Any]], size: int, block: int, layout: str, form: str
) -> None:
    _check_errors(results, f"mixer cp={size} block={block} {layout} {form}", FP32_RTOL)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("size", "block"), [(2, 11), (2, 16), (3, 11), (4, 11), (4, 16)])
def test_scan_across_ranks_equals_the_recurrence_in_fp64(
    results: list[dict[str, Any]], size: int, block: int, packed: bool
) -> None:
    _check_errors(results, f"scan cp={size} block={block} packed={packed}", FP64_RTOL)


@pytest.mark.parametrize("size", [2, 4])
def test_activation_checkpointing_recomputes_the_transfers_in_step(results: list[dict[str, Any]], size: int) -> None:
    _check_errors(results, f"checkpointed cp={size}", FP32_RTOL)


@pytest.mark.parametrize("size", [2, 4])
def test_bf16_mixer_runs_and_stays_close(results: list[dict[str, Any]], size: int) -> None:
    _check_errors(results, f"bf16 cp={size}", BF16_RTOL)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("size", [2, 4])
def test_bytes_sent_match_the_formula_and_do_not_depend_on_the_sequence_length(
    results: list[dict[str, Any]], size: int, packed: bool
) -> None:
    for rank in range(WORLD):
        short_measured, short_formula = case_result(results, f"bytes cp={size} block=5 packed={packed}", rank)
        long_measured, long_formula = case_result(results, f"bytes cp={size} block=24 packed={packed}", rank)
        assert short_measured == short_formula, f"rank {rank}: measured {short_measured} != formula {short_formula}"
        assert long_measured == short_measured, f"rank {rank}: bytes depend on S: {short_measured} vs {long_measured}"
        assert long_formula == short_formula
        cp_rank = rank % size
        assert (short_measured["forward_halo_bytes"] > 0) == (cp_rank < size - 1)
        assert (short_measured["backward_halo_bytes"] > 0) == (cp_rank > 0)
        assert short_measured["forward_state_bytes"] + short_measured["backward_state_bytes"] > 0


def test_bad_inputs_are_refused_with_every_problem_listed(results: list[dict[str, Any]]) -> None:
    for size in (2, 4):
        for rank in range(WORLD):
            message = case_result(results, f"refusal cp={size}", rank)
            assert "generation cache" in message
            assert "shorter than the conv halo" in message
            assert "seq_idx has shape" in message


def test_a_group_of_one_rank_runs_the_single_process_path(results: list[dict[str, Any]]) -> None:
    assert all(case_result(results, "size one", rank) for rank in range(WORLD))
