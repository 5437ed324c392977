"""Benchmark of am-models-gemma4, measured in one run.

(1) One training step (forward + backward, fp32, CPU) of our Gemma 4 MoE versus transformers' `Gemma4ForCausalLM`
    with the same weights (loaded from one checkpoint folder): hidden 256, 6 layers (5 sliding + 1 full), 8 experts
    top-2, sequence 1024. Both run in this process on ONE thread; runs alternate and the best of REPEATS is kept.
    The ratio uses process CPU time (the development machines are shared: wall time also counts the time other
    jobs hold the cores); wall times are reported next to it. Target ratio <= 0.8.
(2) A CP=2 step on 2 gloo ranks versus the CP=1 step, sequence 4096, a small dense model (hidden 128, 4 layers):
    time ratio and peak memory per rank. Every process runs torch with ONE thread so that 2 ranks on 2 cores
    compare fairly with one single process. Memory method (as bench/bench_context_parallel.py): the torch profiler
    with `profile_memory=True` records every CPU tensor allocation and free during one forward + backward; the
    peak of their running sum is the activation + temporary memory of the step (weights allocated before the step
    are excluded). The ring's per-chunk kernel: the model's default (block-sparse around torch's fused CPU flash op:
    only the keys a query block can see) and plain `flash_cpu` on whole chunks, for comparison.
(3) Greedy decoding, ours (`generate` with `Gemma4HybridCache`) versus transformers' `generate` (its `DynamicCache`),
    same weights as (1): a prompt of DECODE_PROMPT tokens (twice the sliding window, so sliding layers drop keys),
    DECODE_NEW_TOKENS new tokens (forced: `min_new_tokens`), batch 1, fp32, ONE thread; runs alternate and the best
    of DECODE_REPEATS is kept. tokens/s = new tokens / seconds of the whole `generate` call (prefill included), as
    bench/bench_nemotron.py reports it. Also: whether the tokens are equal, and the bytes each cache holds at the end.

Run: `python bench/bench_gemma4.py` (writes bench/results/gemma4.json).
"""

from __future__ import annotations

import datetime
import json
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

RESULTS = Path(__file__).resolve().parent / "results" / "gemma4.json"

MOE = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=256,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=256,
)
MOE_SEQ = 1024
REPEATS = 5

CP_MODEL = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=512,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0,
)
CP_SEQ = 4096
CP_REPEATS = 2
CP_KERNELS = ("default", "flash_cpu")  # default: block-sparse around flash_cpu; flash_cpu: whole chunks

DECODE_PROMPT = 512
DECODE_NEW_TOKENS = 64
DECODE_REPEATS = 2


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


# ------------------------------------------------------------------ (1) ours vs transformers, MoE training step
def _moe_step_ratio() -> dict[str, Any]:
    from transformers import Gemma4ForCausalLM as HFGemma4ForCausalLM
    from transformers import Gemma4TextConfig

    from am_models_gemma4 import Gemma4ForCausalLM

    torch.manual_seed(0)
    hf = HFGemma4ForCausalLM(Gemma4TextConfig(**MOE))
    folder = tempfile.mkdtemp(prefix="am_g4_bench_")
    hf.save_pretrained(folder)
    ours = Gemma4ForCausalLM.from_pretrained(folder)
    ids = torch.randint(1, MOE["vocab_size"], (1, MOE_SEQ), generator=torch.Generator().manual_seed(0))

    def step(model: torch.nn.Module) -> float:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    losses = {"transformers": step(hf), "ours": step(ours)}  # warm-up, and the same-weights check
    if abs(losses["ours"] - losses["transformers"]) > 1e-4 * abs(losses["transformers"]):
        raise RuntimeError(f"the two models do not compute the same step (losses {losses}); the ratio would be void")
    cpu = {"transformers": float("inf"), "ours": float("inf")}
    wall = {"transformers": float("inf"), "ours": float("inf")}
    for _ in range(REPEATS):
        for name, model in (("transformers", hf), ("ours", ours)):
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            step(model)
            cpu[name] = min(cpu[name], time.process_time() - cpu_start)
            wall[name] = min(wall[name], time.perf_counter() - wall_start)
    return {
        "config": {**MOE, "seq_len": MOE_SEQ, "batch": 1, "dtype": "float32", "threads": torch.get_num_threads()},
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "ratio_ours_over_transformers": cpu["ours"] / cpu["transformers"],
        "wall_ratio_ours_over_transformers": wall["ours"] / wall["transformers"],
        "loss": losses,
    }


# ------------------------------------------------------------------ (3) greedy decoding, ours vs transformers
def _cache_bytes(cache: Any) -> int:
    """Bytes of the K/V a finished `generate` left in its cache (ours: `memory_bytes`; transformers: its layers)."""
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
    )


def _decoding() -> dict[str, Any]:
    from transformers import Gemma4ForCausalLM as HFGemma4ForCausalLM
    from transformers import Gemma4TextConfig

    from am_models_gemma4 import Gemma4ForCausalLM

    torch.manual_seed(0)
    hf = HFGemma4ForCausalLM(Gemma4TextConfig(**MOE)).eval()
    folder = tempfile.mkdtemp(prefix="am_g4_bench_")
    hf.save_pretrained(folder)
    ours = Gemma4ForCausalLM.from_pretrained(folder).eval()
    prompt = torch.randint(1, MOE["vocab_size"], (1, DECODE_PROMPT), generator=torch.Generator().manual_seed(3))
    kwargs = {"max_new_tokens": DECODE_NEW_TOKENS, "min_new_tokens": DECODE_NEW_TOKENS, "do_sample": False}
    outputs = {
        name: model.generate(prompt, return_dict_in_generate=True, **kwargs)
        for name, model in (("transformers", hf), ("ours", ours))
    }  # warm-up, the tokens and the caches
    best = {"transformers": float("inf"), "ours": float("inf")}
    for _ in range(DECODE_REPEATS):
        for name, model in (("transformers", hf), ("ours", ours)):
            start = time.perf_counter()
            model.generate(prompt, **kwargs)
            best[name] = min(best[name], time.perf_counter() - start)
    return {
        "config": {**MOE, "prompt": DECODE_PROMPT, "new_tokens": DECODE_NEW_TOKENS, "batch": 1, "dtype": "float32"},
        "seconds": best,
        "tokens_per_second": {name: DECODE_NEW_TOKENS / seconds for name, seconds in best.items()},
        "speedup_ours_over_transformers": best["transformers"] / best["ours"],
        "greedy_tokens_equal": bool(torch.equal(outputs["ours"].sequences, outputs["transformers"].sequences)),
        "cache_bytes": {name: _cache_bytes(out.past_key_values) for name, out in outputs.items()},
    }


# ------------------------------------------------------------------ (2) CP=2 vs CP=1
def _cp_model() -> Any:
    from transformers import Gemma4TextConfig

    from am_models_gemma4 import Gemma4ForCausalLM

    torch.manual_seed(0)
    return Gemma4ForCausalLM(Gemma4TextConfig(**CP_MODEL))


def _cp_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, CP_MODEL["vocab_size"], (1, CP_SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return {"input_ids": ids, "labels": labels}


def _timed(fn: Any, group: Any = None) -> float:
    """Median wall time of `fn()` over CP_REPEATS runs after one warm-up (ranks start each run together)."""
    fn()
    times = []
    for _ in range(CP_REPEATS):
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cp1() -> dict[str, Any]:
    import torch.nn.functional as F

    model = _cp_model()
    batch = _cp_batch()

    def step() -> None:
        logits = model(input_ids=batch["input_ids"]).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)).backward()
        model.zero_grad(set_to_none=True)

    return {"seconds": _timed(step), "peak_bytes": _peak_bytes(step)}


def _cp2_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from am_context_parallel import all_reduce_cp_gradients, make_cp_batch_and_ctx, select_kernel
    from am_models_gemma4.kernels import default_ring_kernel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    group = mesh["cp"].get_group()
    model = _cp_model()
    out: dict[str, Any] = {}
    for kernel in CP_KERNELS:
        ctx, batch = make_cp_batch_and_ctx(mesh, _cp_batch(), model=model)
        ctx.kernel = default_ring_kernel("cpu") if kernel == "default" else select_kernel(name=kernel)

        def step(ctx: Any = ctx, batch: dict[str, torch.Tensor] = batch) -> None:
            with ctx():
                model(**batch).loss.backward()
            all_reduce_cp_gradients(model, group=group)
            model.zero_grad(set_to_none=True)

        seconds = _timed(step, group)
        dist.barrier(group)
        out[kernel] = {"seconds": seconds, "peak_bytes": _peak_bytes(step)}
    return out


def _entry(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )
    result = _cp2_worker(rank, world)
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _launch(world: int) -> list[dict[str, Any]]:
    folder = tempfile.mkdtemp(prefix="am_g4_cp_bench_")
    mp.start_processes(_entry, args=(world, folder), nprocs=world, start_method="spawn")
    return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def main() -> None:
    started = time.perf_counter()
    mib = 1024 * 1024
    print("(1) MoE training step, fp32 CPU: ours vs transformers (same weights)")
    torch.set_num_threads(1)
    part1 = _moe_step_ratio()
    print(
        f"  hidden 256, 6 layers (5 sliding + 1 full), 8 experts top-2, seq {MOE_SEQ}, "
        f"{part1['config']['threads']} threads, best of {REPEATS}"
    )
    print(
        f"  CPU time: transformers {part1['cpu_seconds']['transformers']:.3f} s, "
        f"ours {part1['cpu_seconds']['ours']:.3f} s -> ratio {part1['ratio_ours_over_transformers']:.3f} "
        "(target <= 0.8); wall: "
        f"{part1['wall_seconds']['transformers']:.3f} s vs {part1['wall_seconds']['ours']:.3f} s -> ratio "
        f"{part1['wall_ratio_ours_over_transformers']:.3f}; loss {part1['loss']['transformers']:.6f} vs "
        f"{part1['loss']['ours']:.6f}"
    )

    torch.set_num_threads(1)
    print(f"(2) CP=2 on 2 ranks vs CP=1, seq {CP_SEQ}, hidden 128, 4 layers (3 sliding w=512 + 1 full), 1 thread each")
    base = _cp1()
    ranks = _launch(2)
    print(f"  CP=1: {base['seconds']:.2f} s, peak {base['peak_bytes'] / mib:.0f} MiB")
    part2: dict[str, Any] = {"cp1": base, "cp2": {}}
    for kernel in CP_KERNELS:
        seconds = max(r[kernel]["seconds"] for r in ranks)
        peak = max(r[kernel]["peak_bytes"] for r in ranks)
        part2["cp2"][kernel] = {
            "seconds": seconds,
            "peak_bytes_per_rank": [r[kernel]["peak_bytes"] for r in ranks],
            "time_ratio_cp2_over_cp1": seconds / base["seconds"],
            "memory_ratio_cp2_rank_over_cp1": peak / base["peak_bytes"],
        }
        print(
            f"  CP=2 ring kernel {kernel!r}: {seconds:.2f} s, peak per rank "
            f"{[round(r[kernel]['peak_bytes'] / mib) for r in ranks]} MiB -> time ratio "
            f"{part2['cp2'][kernel]['time_ratio_cp2_over_cp1']:.3f}, memory ratio "
            f"{part2['cp2'][kernel]['memory_ratio_cp2_rank_over_cp1']:.3f} (ideal ~1/C = 0.5)"
        )
    torch.set_num_threads(1)
    print(
        f"(3) greedy decoding, fp32 CPU, 1 thread: prompt {DECODE_PROMPT}, {DECODE_NEW_TOKENS} new tokens "
        "(model of (1))"
    )
    part3 = _decoding()
    kib = 1024
    print(
        f"  ours {part3['tokens_per_second']['ours']:.1f} tok/s, transformers "
        f"{part3['tokens_per_second']['transformers']:.1f} tok/s -> {part3['speedup_ours_over_transformers']:.2f}x; "
        f"tokens equal: {part3['greedy_tokens_equal']}; cache at the end: ours "
        f"{part3['cache_bytes']['ours'] / kib:.0f} KiB, "
        f"transformers {part3['cache_bytes']['transformers'] / kib:.0f} KiB"
    )
    payload = {
        "benchmark": "am-models-gemma4",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "moe_training_step": part1,
        "context_parallel": part2,
        "greedy_decoding": part3,
        "memory_method": "torch.profiler profile_memory=True; peak of running sum of [memory] events over fwd+bwd",
        "wall_seconds": time.perf_counter() - started,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(payload, indent=2))
    print(f"wrote {RESULTS} ({payload['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
