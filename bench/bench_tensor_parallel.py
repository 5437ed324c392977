"""Benchmark of am-tensor-parallel, measured in one run.

A Llama-architecture model from transformers (built from its config, fp32, CPU, eager attention): hidden 256,
intermediate 704, 8 heads, 4 KV heads, vocabulary 4096, batch 2 x 256 tokens, the plan transformers declares.
(1) Per-rank parameter memory at tp=2 over tp=1: the sharded layers (every parameter the plan shards) and the whole
    model (norms stay replicated). Target <= 0.55 for the sharded layers.
(2) Bytes one rank's collectives move per decoder layer and training step (forward + backward), counted by
    `am_tensor_parallel.count_collective_bytes` as the difference between a 2-layer and a 1-layer model, against
    the formula: without sequence parallelism 4 all-reduces of the activations A = B x S x H x 4 bytes; with it
    4 reduce-scatters of A and 4 all-gathers of A / tp.
(3) Step CPU time (forward + backward, best of REPEATS, one thread per process) of a tp=2 rank over the
    single-process step, both in this run (the ideal is 1/2 plus communication).

Run: `python bench/bench_tensor_parallel.py` (writes bench/results/tensor_parallel.json).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Shard

from am_tensor_parallel import apply_tensor_parallel, count_collective_bytes

RESULTS = Path(__file__).resolve().parent / "results" / "tensor_parallel.json"
TP = 2
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 704, 8, 4, 4096, 4
BATCH, SEQ = 2, 256
REPEATS = 3


def _model(layers: int = LAYERS) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        attn_implementation="eager",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _step_cpu_seconds(model: torch.nn.Module) -> float:
    ids = _batch()
    best = float("inf")
    for _ in range(REPEATS + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        start = time.process_time()
        model(input_ids=ids, labels=ids).loss.backward()
        best = min(best, time.process_time() - start)
    return best


def _param_bytes(model: torch.nn.Module) -> dict[str, int]:
    sharded = whole = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        size = local.numel() * local.element_size()
        whole += size
        if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements):
            sharded += size
    return {"sharded_layers": sharded, "whole_model": whole}


def _worker(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    result: dict[str, Any] = {}
    model = _model()
    plan = apply_tensor_parallel(model, mesh)
    result["param_bytes"] = _param_bytes(model)
    result["sharded_names"] = sorted(
        name for name, p in model.named_parameters() if isinstance(p, DTensor) and isinstance(p.placements[0], Shard)
    )
    result["step_cpu_seconds"] = _step_cpu_seconds(model)
    result["styles"] = len(plan.styles)
    for sp in (False, True):
        counted = {}
        for layers in (1, 2):
            model = _model(layers)
            apply_tensor_parallel(model, mesh, sequence_parallel=sp)
            ids = _batch()
            with count_collective_bytes() as stats:
                model(input_ids=ids, labels=ids).loss.backward()
            counted[layers] = dict(stats.bytes)
        kinds = set(counted[1]) | set(counted[2])
        result[f"bytes_per_layer_sp{int(sp)}"] = {k: counted[2].get(k, 0) - counted[1].get(k, 0) for k in kinds}
    return result


def _entry(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )
    torch.save(_worker(rank), os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    started = time.perf_counter()
    torch.set_num_threads(1)  # as each rank
    single = _model()
    single_bytes = sum(p.numel() * p.element_size() for p in single.parameters())
    single_time = _step_cpu_seconds(single)

    folder = tempfile.mkdtemp(prefix="am_tp_bench_")
    mp.start_processes(_entry, args=(TP, folder), nprocs=TP, start_method="spawn")
    ranks = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(TP)]

    names = set(ranks[0]["sharded_names"])
    sharded_full = sum(p.numel() * p.element_size() for n, p in single.named_parameters() if n in names)
    worst = max(ranks, key=lambda r: r["param_bytes"]["sharded_layers"])
    memory = {
        "single_sharded_layers_bytes": sharded_full,
        "single_whole_model_bytes": single_bytes,
        "rank_sharded_layers_bytes": worst["param_bytes"]["sharded_layers"],
        "rank_whole_model_bytes": worst["param_bytes"]["whole_model"],
        "ratio_sharded_layers_tp2_over_tp1": worst["param_bytes"]["sharded_layers"] / sharded_full,
        "ratio_whole_model_tp2_over_tp1": worst["param_bytes"]["whole_model"] / single_bytes,
    }
    act = BATCH * SEQ * HIDDEN * 4
    formula = {
        "sp0": {"all_reduce": 4 * act},
        "sp1": {"reduce_scatter": 4 * act, "all_gather": 4 * act // TP},
    }
    traffic: dict[str, Any] = {"activation_bytes": act, "formula": formula}
    for key in ("sp0", "sp1"):
        measured = ranks[0][f"bytes_per_layer_{key}"]
        measured = {k: v for k, v in measured.items() if v}
        traffic[f"measured_{key}"] = measured
        # the sequence-parallel norms' weight gradients (2 per layer, H floats each) are all-reduced too
        extra = {"all_reduce": 2 * HIDDEN * 4} if key == "sp1" else {}
        expected = {**formula[key], **extra}
        traffic[f"ratio_measured_over_formula_{key}"] = sum(measured.values()) / sum(expected.values())
    step = max(r["step_cpu_seconds"] for r in ranks)
    timing = {
        "single_step_cpu_seconds": single_time,
        "tp2_rank_step_cpu_seconds": step,
        "step_cpu_time_ratio_tp2_over_tp1": step / single_time,
    }

    print(
        f"Llama-architecture model: hidden {HIDDEN}, intermediate {INTER}, {HEADS} heads / {KV_HEADS} KV heads, "
        f"vocabulary {VOCAB}, {LAYERS} layers; batch {BATCH} x {SEQ}; fp32 CPU; tp={TP}"
    )
    print(
        f"(1) parameter memory per rank, tp=2 / tp=1: sharded layers {memory['ratio_sharded_layers_tp2_over_tp1']:.3f}"
        f" (target <= 0.55; {memory['rank_sharded_layers_bytes']:,} of {sharded_full:,} B), whole model "
        f"{memory['ratio_whole_model_tp2_over_tp1']:.3f}"
    )
    for key in ("sp0", "sp1"):
        label = "without" if key == "sp0" else "with"
        print(
            f"(2) bytes per layer and step {label} sequence parallelism: measured {traffic[f'measured_{key}']}, "
            f"formula {formula[key]}{' + norm gradients' if key == 'sp1' else ''}; ratio "
            f"{traffic[f'ratio_measured_over_formula_{key}']:.3f}"
        )
    print(
        f"(3) step CPU time: tp=2 rank {step:.3f} s / single process {single_time:.3f} s = "
        f"{timing['step_cpu_time_ratio_tp2_over_tp1']:.3f}"
    )
    payload = {
        "benchmark": "am-tensor-parallel",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "memory": memory,
        "bytes_per_layer": traffic,
        "step": timing,
        "wall_seconds": time.perf_counter() - started,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
