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
The same three figures for our two models' declared plans (`MODEL_PLANS`: Gemma 4 dense and Nemotron-H with every
block kind, hidden 256, 8 heads / 4 KV heads, vocabulary 4096, no MTP): (1) counts DTensor shards and the plain-tensor
shards of modules that shard themselves (Nemotron-H's Mamba2 mixer: every parameter whose local shape is not the
single process's); (2) is measured per added layer of each kind (a model with 2 layers of the kind minus one with 1),
against the formula: each TP region (an attention, an MLP, a Mamba2 mixer, the MoE's shared expert) all-reduces the
activations A once forward (its row-parallel output) and once backward (its input's gradient), plus the all-reduced
gradients of parameters that stay replicated inside the regions (Gemma 4's per-head q/k norms).

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
    result["models"] = _model_plans_worker(mesh)
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


# Our models' plans: (name, layer kinds -> (config of 1 layer of the kind, of 2 layers), TP regions per layer).
def _gemma4(layers: int) -> torch.nn.Module:
    from transformers import Gemma4TextConfig

    from am_models_gemma4 import Gemma4ForCausalLM

    config = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
        global_head_dim=2 * HIDDEN // HEADS, num_global_key_value_heads=KV_HEADS, attention_k_eq_v=True,
        sliding_window=64, layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB, final_logit_softcapping=30.0,
        tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(config)
    model.model.init_weights()
    return model.float()


def _nemotron(pattern: str) -> torch.nn.Module:
    from transformers import NemotronHConfig

    from am_models_nemotron import NemotronHForCausalLM

    head_dim = HIDDEN // HEADS
    config = NemotronHConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB, hidden_size=HIDDEN, hybrid_override_pattern=pattern, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=head_dim, intermediate_size=INTER, mamba_num_heads=HEADS,
        mamba_head_dim=head_dim, ssm_state_size=16, n_groups=2, chunk_size=64, conv_kernel=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=HIDDEN,
        moe_shared_expert_intermediate_size=HIDDEN, num_nextn_predict_layers=0, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return NemotronHForCausalLM(config).float()


MODEL_PLANS: dict[str, dict[str, Any]] = {
    "gemma4": {
        "build": lambda: _gemma4(LAYERS),
        # 4 layers minus 2: one sliding and one full-attention layer (attention + MLP each); a model of 1 layer would
        # have no sliding layer, whose v_proj the plan names (the full layers share K = V)
        "kinds": {"sliding + full attention, + MLP": ((lambda: _gemma4(2)), (lambda: _gemma4(4)), ("2", "3"), 2)},
    },
    "nemotron": {
        "build": lambda: _nemotron("M*-E"),
        "kinds": {
            name: ((lambda k=kind: _nemotron(k)), (lambda k=kind: _nemotron(2 * k)), ("1",), 1)
            for name, kind in (("mamba2", "M"), ("attention", "*"), ("mlp", "-"), ("moe (shared expert)", "E"))
        },
    },
}


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def _model_step_cpu_seconds(model: torch.nn.Module) -> float:
    ids = _batch()
    best = float("inf")
    for _ in range(REPEATS + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        start = time.process_time()
        _loss(model, ids).backward()
        best = min(best, time.process_time() - start)
    return best


def _sharded_bytes(model: torch.nn.Module, full_shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, list[str]]:
    """(bytes of this rank's sharded parameters, bytes of all its parameters, the sharded names): DTensor shards
    and plain tensors whose shape is not the unsharded one (a module that shards itself)."""
    sharded, whole, names = 0, 0, []
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        size = local.numel() * local.element_size()
        whole += size
        if isinstance(param, DTensor):
            is_shard = any(isinstance(p, Shard) for p in param.placements)
        else:
            is_shard = tuple(param.shape) != full_shapes[name]
        if is_shard:
            sharded += size
            names.append(name)
    return sharded, whole, names


def _replicated_in_layer(model: torch.nn.Module, layer: str) -> int:
    """Bytes of the replicated TP parameters of one layer (their gradients are all-reduced over tp; the tiny models'
    per-head q/k norms in Gemma 4)."""
    from torch.distributed.tensor import Replicate

    return sum(
        p.to_local().numel() * p.to_local().element_size()
        for name, p in model.named_parameters()
        if f".layers.{layer}." in name
        and isinstance(p, DTensor)
        and all(isinstance(q, Replicate) for q in p.placements)
    )


def _model_plans_worker(mesh: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, spec in MODEL_PLANS.items():
        model = spec["build"]()
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        apply_tensor_parallel(model, mesh)
        sharded, whole, names = _sharded_bytes(model, shapes)
        entry: dict[str, Any] = {"rank_sharded_bytes": sharded, "rank_whole_bytes": whole, "sharded_names": names}
        entry["step_cpu_seconds"] = _model_step_cpu_seconds(model)
        layers = {}
        for kind, (one, two, added, regions) in spec["kinds"].items():
            counted = {}
            for count, build in ((1, one), (2, two)):
                model = build()
                apply_tensor_parallel(model, mesh)
                with count_collective_bytes() as stats:
                    _loss(model, _batch()).backward()
                counted[count] = dict(stats.bytes)
            kinds = set(counted[1]) | set(counted[2])
            measured = {k: counted[2].get(k, 0) - counted[1].get(k, 0) for k in kinds}
            layers[kind] = {
                "measured": {k: v for k, v in measured.items() if v},
                "layers": len(added),
                "regions": regions,
                "replicated_grad_bytes": sum(_replicated_in_layer(model, layer) for layer in added),
            }
        entry["bytes_per_layer"] = layers
        result[name] = entry
    return result


def _model_plans_report(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The models' figures from the ranks' measurements and the single-process models built here."""
    torch.set_num_threads(1)
    act = BATCH * SEQ * HIDDEN * 4
    report: dict[str, Any] = {}
    for name, spec in MODEL_PLANS.items():
        single = spec["build"]()
        single_time = _model_step_cpu_seconds(single)
        params = dict(single.named_parameters())
        worst = max((r["models"][name] for r in ranks), key=lambda e: e["rank_sharded_bytes"])
        full = sum(params[n].numel() * params[n].element_size() for n in worst["sharded_names"])
        everything = sum(p.numel() * p.element_size() for p in params.values())
        layers = {}
        for kind, found in ranks[0]["models"][name]["bytes_per_layer"].items():
            per = found["layers"]  # figures per layer: the added layers' bytes over their count
            formula = {"all_reduce": (2 * found["regions"] * act * per + found["replicated_grad_bytes"]) // per}
            measured = {k: v // per for k, v in found["measured"].items()}
            layers[kind] = {
                "measured": measured,
                "formula": formula,
                "ratio_measured_over_formula": sum(measured.values()) / sum(formula.values()),
            }
        step = max(r["models"][name]["step_cpu_seconds"] for r in ranks)
        report[name] = {
            "ratio_sharded_layers_tp2_over_tp1": worst["rank_sharded_bytes"] / full,
            "ratio_whole_model_tp2_over_tp1": worst["rank_whole_bytes"] / everything,
            "sharded_layers_bytes": {"rank": worst["rank_sharded_bytes"], "single": full},
            "bytes_per_layer": layers,
            "step": {
                "single_step_cpu_seconds": single_time,
                "tp2_rank_step_cpu_seconds": step,
                "step_cpu_time_ratio_tp2_over_tp1": step / single_time,
            },
        }
        print(
            f"{name}: (1) parameter memory per rank, tp=2 / tp=1: sharded layers "
            f"{report[name]['ratio_sharded_layers_tp2_over_tp1']:.3f} (target <= 0.55), whole model "
            f"{report[name]['ratio_whole_model_tp2_over_tp1']:.3f}; (3) step CPU time {step:.3f} s / "
            f"{single_time:.3f} s = {step / single_time:.3f}"
        )
        for kind, figures in layers.items():
            print(
                f"{name}: (2) bytes per {kind} layer and step: measured {figures['measured']}, formula "
                f"{figures['formula']}; ratio {figures['ratio_measured_over_formula']:.3f}"
            )
    return report


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
    models = _model_plans_report(ranks)
    payload = {
        "benchmark": "am-tensor-parallel",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "memory": memory,
        "bytes_per_layer": traffic,
        "step": timing,
        "models": models,
        "wall_seconds": time.perf_counter() - started,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
