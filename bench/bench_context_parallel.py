"""Benchmark of am-context-parallel's ring attention, measured in one run on real gloo processes.

(a) Bytes one rank sends per attention call (forward K/V, backward K/V re-fetch and dK/dV) for a sliding-window
    layer versus a full ring, C = 4, on the load-balanced and the contiguous layouts; checked against a
    closed-form count derived from the chunk geometry (not from the library), plus the time ratio.
(b) Ring attention with C = 2 on 2 ranks versus single-process attention on the same total sequence (S = 4096):
    time ratio and peak activation memory per rank.

Memory method: the torch profiler with `profile_memory=True` records every CPU tensor allocation and free made by
torch during one forward + backward; the peak of their running sum is the activation + temporary memory of the
call (inputs allocated before the call are excluded, so the number is comparable between C = 1 and C = 2).
Every process runs torch with ONE thread so that 2 ranks on 2 cores compare fairly with one single process.

Run: `python bench/bench_context_parallel.py` (writes bench/results/context_parallel.json).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from am_context_parallel import (
    AttentionKernel,
    ContiguousLayout,
    Layout,
    LoadBalancedLayout,
    count_ring_bytes,
    ring_attention,
    select_kernel,
)

RESULTS = Path(__file__).resolve().parent / "results" / "context_parallel.json"

# (a) bytes: C = 4, a sliding window smaller than a head-tail chunk
BYTES_CP, BYTES_SEQ, BYTES_HEADS, BYTES_DIM, WINDOW = 4, 2048, 4, 32, 128
# (b) time and memory: S = 4096, 4 heads of 64
SEQ, HEADS, HEAD_DIM = 4096, 4, 64
REPEATS = 2
# per-chunk kernels: the plain-PyTorch reference (materializes each chunk's scores) and torch's fused CPU flash op
KERNELS = ("torch", "flash_cpu")


def _peak_bytes(fn: Any) -> int:
    """Peak of the running sum of torch CPU allocations/frees during `fn()` (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def _timed(fn: Any, group: Any = None) -> float:
    """Median wall time of `fn()` over REPEATS runs after one warm-up (ranks start each run together)."""
    fn()
    times = []
    for _ in range(REPEATS):
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _qkv(seq: int, heads: int, dim: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, seq, dim, generator=gen) for _ in range(4)]  # q, k, v, dout


def _ring_step(
    layout: Layout, full: list[torch.Tensor], group: Any, window: int | None, kernel: AttentionKernel | None = None
) -> Any:
    padded = layout.padded_length(full[0].shape[2])
    q, k, v, dout = (layout.shard(t, seq_dim=2) for t in full)
    positions = layout.local_indices(padded)

    def step() -> None:
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(qs, ks, vs, group=group, positions=positions, sliding_window=window, kernel=kernel)
        out.backward(dout)

    return step


# ------------------------------------------------------------------ closed-form byte counts for (a)
def _needed_sources_load_balanced(rank: int, cp: int, chunk: int, window: int | None) -> set[int]:
    """Ranks holding keys that rank `rank`'s queries can see (causal), from chunk geometry."""
    reach = 2 * cp if window is None else math.ceil((window - 1) / chunk)
    owner = [j if j < cp else 2 * cp - 1 - j for j in range(2 * cp)]
    sources = set()
    for own_chunk in (rank, 2 * cp - 1 - rank):
        sources |= {owner[j] for j in range(max(0, own_chunk - reach), own_chunk)}
    return sources - {rank}


def _needed_sources_contiguous(rank: int, cp: int, s_local: int, window: int | None) -> set[int]:
    reach = cp if window is None else math.ceil((window - 1) / s_local)
    return set(range(max(0, rank - reach), rank))


def _expected_bytes(kind: str, rank: int, window: int | None, kv_bytes: int) -> dict[str, int]:
    cp, s_local = BYTES_CP, BYTES_SEQ // BYTES_CP
    if kind == "load_balanced":
        sources = [_needed_sources_load_balanced(r, cp, s_local // 2, window) for r in range(cp)]
    else:
        sources = [_needed_sources_contiguous(r, cp, s_local, window) for r in range(cp)]
    receivers = sum(rank in sources[r] for r in range(cp) if r != rank)
    fetched = len(sources[rank])
    return {
        "forward_kv_bytes": receivers * kv_bytes,
        "backward_kv_bytes": receivers * kv_bytes,
        "backward_grad_bytes": fetched * kv_bytes,  # fp32 inputs: gradients travel in fp32 too
    }


def _bytes_worker(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    full = _qkv(BYTES_SEQ, BYTES_HEADS, BYTES_DIM)
    out: dict[str, Any] = {}
    for kind, layout in (
        ("load_balanced", LoadBalancedLayout(cp_size=world, cp_rank=rank)),
        ("contiguous", ContiguousLayout(cp_size=world, cp_rank=rank)),
    ):
        for window in (None, WINDOW):
            step = _ring_step(layout, full, group, window)
            with count_ring_bytes() as stats:
                step()
            kv_bytes = 2 * (BYTES_SEQ // world) * BYTES_HEADS * BYTES_DIM * 4
            out[f"{kind}/{'window' if window else 'full'}"] = {
                "measured": {
                    "forward_kv_bytes": stats.forward_kv_bytes,
                    "backward_kv_bytes": stats.backward_kv_bytes,
                    "backward_grad_bytes": stats.backward_grad_bytes,
                },
                "metadata_bytes": stats.metadata_bytes,
                "expected": _expected_bytes(kind, rank, window, kv_bytes),
                "seconds": _timed(step, group),
            }
    return out


def _time_memory_worker(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    full = _qkv(SEQ, HEADS, HEAD_DIM)
    out = {}
    for name in KERNELS:
        step = _ring_step(LoadBalancedLayout(cp_size=world, cp_rank=rank), full, group, None, select_kernel(name=name))
        seconds = _timed(step, group)
        dist.barrier(group)
        out[name] = {"seconds": seconds, "peak_bytes": _peak_bytes(step)}
    return out


def _single_process() -> dict[str, Any]:
    q, k, v, dout = _qkv(SEQ, HEADS, HEAD_DIM)

    def ours(name: str) -> Any:
        def step() -> None:
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            out = ring_attention(qs, ks, vs, group=None, positions=torch.arange(SEQ), kernel=select_kernel(name=name))
            out.backward(dout)

        return step

    def sdpa() -> None:
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).backward(dout)

    result = {name: {"seconds": _timed(ours(name)), "peak_bytes": _peak_bytes(ours(name))} for name in KERNELS}
    result["torch_sdpa"] = {"seconds": _timed(sdpa), "peak_bytes": _peak_bytes(sdpa)}
    return result


def _entry(rank: int, worker: Any, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )
    result = worker(rank, world)
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _launch(worker: Any, world: int) -> list[dict[str, Any]]:
    folder = tempfile.mkdtemp(prefix="am_cp_bench_")
    mp.start_processes(_entry, args=(worker, world, folder), nprocs=world, start_method="spawn")
    return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def main() -> None:
    started = time.perf_counter()
    torch.set_num_threads(1)
    mib = 1024 * 1024

    print(f"(a) bytes sent per attention call, C={BYTES_CP}, S={BYTES_SEQ}, {BYTES_HEADS} heads x {BYTES_DIM}, fp32")
    bytes_ranks = _launch(_bytes_worker, BYTES_CP)
    part_a: dict[str, Any] = {}
    all_match = True
    for kind in ("load_balanced", "contiguous"):
        for what in ("full", "window"):
            key = f"{kind}/{what}"
            per_rank = [r[key] for r in bytes_ranks]
            match = all(r["measured"] == r["expected"] for r in per_rank)
            all_match &= match
            part_a[key] = {
                "forward_kv_bytes_per_rank": [r["measured"]["forward_kv_bytes"] for r in per_rank],
                "backward_bytes_per_rank": [
                    r["measured"]["backward_kv_bytes"] + r["measured"]["backward_grad_bytes"] for r in per_rank
                ],
                "metadata_bytes_per_rank": [r["metadata_bytes"] for r in per_rank],
                "equals_formula": match,
                "seconds_max_rank": max(r["seconds"] for r in per_rank),
            }
        full, window = part_a[f"{kind}/full"], part_a[f"{kind}/window"]
        bytes_ratio = sum(window["forward_kv_bytes_per_rank"]) / sum(full["forward_kv_bytes_per_rank"])
        time_ratio = window["seconds_max_rank"] / full["seconds_max_rank"]
        part_a[f"{kind}/ratios"] = {"bytes_window_over_full": bytes_ratio, "time_window_over_full": time_ratio}
        print(
            f"  {kind:>13}: forward K/V bytes per rank full={full['forward_kv_bytes_per_rank']} "
            f"window{WINDOW}={window['forward_kv_bytes_per_rank']}  (formula match: "
            f"{full['equals_formula'] and window['equals_formula']})"
        )
        print(f"  {'':>13}  bytes ratio window/full = {bytes_ratio:.3f}, time ratio window/full = {time_ratio:.3f}")
    print(f"  all measured byte counts equal the closed-form formula: {all_match}")

    print(f"(b) ring C=2 on 2 ranks vs single process, S={SEQ}, {HEADS} heads x {HEAD_DIM}, causal, fp32, fwd+bwd")
    single = _single_process()
    ring_ranks = _launch(_time_memory_worker, 2)
    part_b: dict[str, Any] = {"single_process_torch_sdpa": single["torch_sdpa"]}
    sdpa = single["torch_sdpa"]
    print(
        f"  single process, torch SDPA (fused CPU flash, for scale): {sdpa['seconds']:.2f} s, "
        f"peak {sdpa['peak_bytes'] / mib:.0f} MiB"
    )
    for name in KERNELS:
        ring_seconds = max(r[name]["seconds"] for r in ring_ranks)
        ring_peak = max(r[name]["peak_bytes"] for r in ring_ranks)
        base = single[name]
        part_b[name] = {
            "single_process": base,
            "ring_c2_per_rank": [r[name] for r in ring_ranks],
            "time_ratio_ring_over_single": ring_seconds / base["seconds"],
            "memory_ratio_ring_rank_over_single": ring_peak / base["peak_bytes"],
        }
        print(
            f"  kernel {name!r}: single process {base['seconds']:.2f} s, peak {base['peak_bytes'] / mib:.0f} MiB; "
            f"ring C=2 per rank {ring_seconds:.2f} s, peak {ring_peak / mib:.0f} MiB"
        )
        print(
            f"  {'':>9}time ratio ring/single = {part_b[name]['time_ratio_ring_over_single']:.3f}, peak memory "
            f"ratio ring rank/single = {part_b[name]['memory_ratio_ring_rank_over_single']:.3f} (target ~1/C = 0.5)"
        )
    print(
        "  memory method: torch profiler memory events (every CPU tensor alloc/free during one fwd+bwd), peak of the "
        "running sum; inputs allocated before the call excluded. 1 torch thread per process."
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "context_parallel",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "threads_per_process": 1,
        "bytes": part_a,
        "ring_vs_single": part_b,
        "memory_method": "torch.profiler profile_memory=True; peak of running sum of [memory] events over fwd+bwd",
        "wall_seconds": time.perf_counter() - started,
    }
    RESULTS.write_text(json.dumps(payload, indent=2))
    print(f"wrote {RESULTS} in {payload['wall_seconds']:.0f} s")
    if not all_match:
        sys.exit("measured byte counts differ from the formula")


if __name__ == "__main__":
    main()
