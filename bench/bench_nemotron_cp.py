"""Benchmark of Nemotron-H under context parallelism (am-models-nemotron + am-context-parallel), measured in one run.

A training step (forward + backward, fp32, CPU) of one small Nemotron-H with every block kind and one MTP depth
(hidden 128, 6 layers `M*M-ME`, MTP `*-`, vocabulary 1024), one row of S = 4096 tokens, at CP = 2 on 2 gloo ranks
against the same step in one process (CP = 1). Every process runs torch with ONE thread, so 2 ranks on 2 cores
compare fairly with one process. The CP step is the trainer's path: `model.prepare_batch_for_cp` on the whole
batch, `make_cp_batch_and_ctx(mesh, batch, model=model)`, forward + `combined_loss` + backward in the ring context,
gradients summed over the group.

Reported, each against its reference from this run:
  (1) peak activation memory per rank, CP = 2 over CP = 1 (target <= 0.6). Method (as bench_context_parallel.py and
      bench_gemma4.py): the torch profiler with `profile_memory=True` records every CPU tensor allocation and free
      during one step; the peak of their running sum is the memory the step adds on top of what existed before it
      (weights, optimizer-free), i.e. activations, temporaries and gradients. Measured on every rank; the larger
      rank is reported.
  (2) bytes one Mamba layer sends from each rank in one forward + backward (`count_mamba_cp_bytes`, divided by the
      number of Mamba layers) against `mamba_cp_bytes_per_layer` (conv halo + the state pairs of the rank scan),
      at S = 4096 and at S = 1024 to show they do not depend on S;
  (3) the step time, CP = 2 over CP = 1 (median of CP_REPEATS after a warm-up; ranks start each run together).

Run: `python bench/bench_nemotron_cp.py` (writes bench/results/nemotron_cp.json).
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
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results" / "nemotron_cp.json"
SEQ = 4096
SHORT_SEQ = 1024
REPEATS = 2
PATTERN = "M*M-ME"
CONFIG = dict(
    vocab_size=1024,
    hidden_size=128,
    hybrid_override_pattern=PATTERN,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=32,
    n_groups=2,
    chunk_size=128,
    conv_kernel=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=64,
    moe_shared_expert_intermediate_size=64,
    num_nextn_predict_layers=1,
    mtp_hybrid_override_pattern="*-",
    pad_token_id=0,
)


def _model() -> Any:
    from transformers import NemotronHConfig

    from am_models_nemotron import NemotronHForCausalLM

    torch.manual_seed(0)
    return NemotronHForCausalLM(NemotronHConfig(**CONFIG)).train()


def _batch(seqlen: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, CONFIG["vocab_size"], (1, seqlen), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _loss_fn(count: float) -> Any:
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum") / count

    return loss


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
    fn()
    times = []
    for _ in range(REPEATS):
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cp1() -> dict[str, Any]:
    model = _model()
    batch = _batch(SEQ)
    loss_fn = _loss_fn(float(SEQ))

    def step() -> None:
        out = model(input_ids=batch["input_ids"])
        model.combined_loss(out, batch["labels"], loss_fn=loss_fn).backward()
        model.zero_grad(set_to_none=True)

    return {"seconds": _timed(step), "peak_bytes": _peak_bytes(step)}


def _cp2_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from am_context_parallel import all_reduce_cp_gradients, make_cp_batch_and_ctx
    from am_models_nemotron import count_mamba_cp_bytes, mamba_cp_bytes_per_layer

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    group = mesh["cp"].get_group()
    model = _model()
    mamba_layers = sum(1 for block in model.model.layers.values() if block.block_type == "mamba")
    result: dict[str, Any] = {}
    for seqlen in (SEQ, SHORT_SEQ):
        ctx, batch = make_cp_batch_and_ctx(mesh, model.prepare_batch_for_cp(_batch(seqlen)), model=model)
        labels = batch.pop("labels")
        loss_fn = _loss_fn(float(seqlen))

        def step(ctx: Any = ctx, batch: dict[str, torch.Tensor] = batch, labels: Any = labels, fn: Any = loss_fn):
            with ctx():
                out = model(**batch)
                model.combined_loss(out, labels, loss_fn=fn, labels_shifted=True).backward()
            all_reduce_cp_gradients(model, group=group)
            model.zero_grad(set_to_none=True)

        with count_mamba_cp_bytes() as stats:
            step()
        measured = {k: v // mamba_layers for k, v in vars(stats).items()}
        formula = mamba_cp_bytes_per_layer(
            model.config, batch_size=1, cp_rank=rank, cp_size=world, conv_dtype=torch.float32, packed=True
        )
        entry: dict[str, Any] = {
            "mamba_bytes_per_layer_measured": measured,
            "mamba_bytes_per_layer_formula": vars(formula),
        }
        if seqlen == SEQ:
            entry["seconds"] = _timed(step, group)
            dist.barrier(group)
            entry["peak_bytes"] = _peak_bytes(step)
        result[str(seqlen)] = entry
    return result


def _entry(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world, timeout=datetime.timedelta(900)
    )
    result = _cp2_worker(rank, world)
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _launch(world: int) -> list[dict[str, Any]]:
    folder = tempfile.mkdtemp(prefix="am_nemotron_cp_bench_")
    mp.start_processes(_entry, args=(world, folder), nprocs=world, start_method="spawn")
    return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def main() -> None:
    started = time.perf_counter()
    mib = 1024 * 1024
    torch.set_num_threads(1)
    print(f"Nemotron-H {PATTERN} + MTP, hidden 128, seq {SEQ}, fp32, 1 thread per process: CP=2 (2 ranks) vs CP=1")
    base = _cp1()
    ranks = _launch(2)
    long = [r[str(SEQ)] for r in ranks]
    seconds = max(r["seconds"] for r in long)
    peak = max(r["peak_bytes"] for r in long)
    memory_ratio = peak / base["peak_bytes"]
    time_ratio = seconds / base["seconds"]
    print(f"  CP=1: {base['seconds']:.2f} s, peak {base['peak_bytes'] / mib:.0f} MiB")
    print(
        f"  CP=2: {seconds:.2f} s, peak per rank {[round(r['peak_bytes'] / mib) for r in long]} MiB -> "
        f"memory ratio {memory_ratio:.3f} (target <= 0.6), time ratio {time_ratio:.3f}"
    )
    bytes_ok = True
    for rank, result in enumerate(ranks):
        for seqlen in (SEQ, SHORT_SEQ):
            entry = result[str(seqlen)]
            measured, formula = entry["mamba_bytes_per_layer_measured"], entry["mamba_bytes_per_layer_formula"]
            bytes_ok &= measured == formula
            print(
                f"  rank {rank}, S={seqlen}: bytes per Mamba layer (fwd+bwd) measured {sum(measured.values())} "
                f"{measured} / formula {sum(formula.values())}"
            )
        bytes_ok &= (
            result[str(SEQ)]["mamba_bytes_per_layer_measured"]
            == result[str(SHORT_SEQ)]["mamba_bytes_per_layer_measured"]
        )
    print(f"  Mamba bytes equal the formula and do not depend on S: {bytes_ok}")
    payload = {
        "benchmark": "am-models-nemotron context parallelism",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "config": {"pattern": PATTERN, "seq": SEQ, "short_seq": SHORT_SEQ, **CONFIG},
        "cp1": base,
        "cp2": {"seconds": seconds, "per_rank": ranks},
        "memory_ratio_cp2_rank_over_cp1": memory_ratio,
        "time_ratio_cp2_over_cp1": time_ratio,
        "memory_target_met": memory_ratio <= 0.6,
        "mamba_bytes_match_formula_and_independent_of_seq": bytes_ok,
        "memory_method": "torch.profiler profile_memory=True; peak of running sum of [memory] events over one step",
        "wall_seconds": time.perf_counter() - started,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(payload, indent=2))
    print(f"wrote {RESULTS} ({payload['wall_seconds']:.0f} s)")
    if not bytes_ok:
        raise SystemExit("Mamba CP bytes differ from mamba_cp_bytes_per_layer")


if __name__ == "__main__":
    main()
