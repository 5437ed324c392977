"""`am-train --dry-run`: one real training step of the full-size model, for each rank position of an N-rank job, in
ONE process on the CPU, with fake tensors and a fake process group — does the layout fit, and how fast might it be?

What it is for (issue 23 §3-§4): the same `validate()` and run plan (trainer/plan.py), the same `build()` (meta build,
pipeline split, TP, EP, FSDP2, then each rank's materialization) and the same step (`BatchStep`, the loss all-reduce,
global-norm clipping, the optimizer step) as a real run, executed under torch's `FakeTensorMode` (tensors have
shapes and dtypes, no storage) over a fake process group (`dist.init_process_group("fake")`: every collective
returns at once). One fake run per pipeline stage, as the stage's first rank; the other ranks of a stage hold the
same blocks, and their shard sizes are computed from each DTensor's placements (uneven FSDP2 shards included), so
every rank of the job gets its own exact parameter, gradient and optimizer bytes.
Measured in the fake step, the way a real run measures its first step (trainer/step_memory.py; the real trainer
writes the same numbers into summary.json's "memory"): parameter / gradient / optimizer-state bytes of the local
shards, and the peak of the activations autograd saves for backward (with `--activation-checkpointing`, what a
layer's recomputation keeps for its backward too); bytes sent per mesh axis from the collectives
the step issues and FLOPs of its kernels (trainer/dry_run_comm.py); a predicted step time (trainer/step_time.py).
Output: `<out>/dry_run.json` and a table per stage; exit 0 when the busiest rank fits `--gpu-memory`, 2 when not
(its numbers and its biggest item named).
MoE routing has no values under fake tensors: am-moe assumes balanced routing there (every expert gets its share of
the pairs; `am_moe.dispatch`), the load a balanced run approaches.
What it must not do: allocate a tensor of the model (everything under the fake mode), talk to another process, or
compute anything the real run computes differently.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import RunConfig
from trainer.plan import RunPlan, ValidatedRun

GIB = 1024**3
EXIT_DOES_NOT_FIT = 2


# ------------------------------------------------------------------------------------------------------------------
# A --model-path folder with only config.json
# ------------------------------------------------------------------------------------------------------------------


def has_weights(folder: str) -> bool:
    """Whether an HF folder holds safetensors weights (a dry run also takes a folder with only config.json)."""
    from pathlib import Path

    return any(Path(folder).glob("*.safetensors"))


# ------------------------------------------------------------------------------------------------------------------
# Rank coordinates and exact shard sizes
# ------------------------------------------------------------------------------------------------------------------


def rank_coordinates(plan: RunPlan, rank: int) -> dict[str, int]:
    """The mesh coordinates of global `rank` on every axis the trainer builds (pp, dp, cp, tp; FSDP2's flattened
    dp_cp; ep and expert_dp carved out of dp_cp, ep innermost: trainer/expert_parallel.py)."""
    rest, tp = divmod(rank, plan.tp)
    rest, cp = divmod(rest, plan.cp)
    pp, dp = divmod(rest, plan.dp)
    dp_cp = dp * plan.cp + cp
    expert_dp, ep = divmod(dp_cp, plan.ep)
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "dp_cp": dp_cp, "ep": ep, "expert_dp": expert_dp}


# ------------------------------------------------------------------------------------------------------------------
# One fake step for one rank position
# ------------------------------------------------------------------------------------------------------------------


def _labelled_groups(meshes: Any) -> list[tuple[Any, str]]:
    """(process group, the mesh axis it is) of every axis the trainer builds, for the collectives' accounting."""
    labelled = [(meshes.mesh[axis], axis) for axis in meshes.mesh.mesh_dim_names] + [(meshes.dp_cp, "dp_cp (FSDP2)")]
    labelled += [(m, label) for m, label in ((meshes.ep, "ep"), (meshes.expert_dp, "expert_dp")) if m is not None]
    return [(mesh.get_group(), label) for mesh, label in labelled]


def _fake_materialize(fake_mode: Any) -> Any:
    """The dry run's materialization: fake storage (no bytes) for the rank's blocks under `fake_mode`, tied tensors
    tied again; no values (a fake tensor has none), so no init is run. Everything before it (pipeline split, TP,
    EP, FSDP2 on the meta model) runs exactly as in a real run."""
    from trainer.build import _retie, tied_groups

    def materialize(part: nn.Module, seed: int, device: torch.device) -> None:
        del seed
        groups = tied_groups(part)
        with fake_mode:
            part.to_empty(device=device)
        _retie(part, groups)

    return materialize


def fake_step(cfg: RunConfig, validated: ValidatedRun, *, rank: int, world_size: int, gpus_per_node: int) -> dict:
    """Build and run one training step as global `rank` of `world_size` under fake tensors and a fake process
    group. Returns this position's numbers: memory (its own and every rank's of the stage), traffic per axis,
    FLOPs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.data import BatchStream
    from trainer.dry_run_comm import CollectiveBytes, extra_flop_formulas
    from trainer.loop import build, make_meshes
    from trainer.step_memory import SavedActivations, state_bytes
    from trainer.step_parts import clip_grad_norm

    plan = validated.plan
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        device = torch.device("cpu")
        meshes = make_meshes(plan, device=device, rank=rank)
        stream = BatchStream(validated.corpus.train, seq_len=cfg.seq_len, global_batch=cfg.global_batch)
        input_ids, labels = stream.next_batch()  # real token ids (the data path of a real run)
        denominator = float((labels != -100).sum())
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        spec = dataclasses.replace(validated.spec, materialize=_fake_materialize(fake_mode))
        built = build(cfg, dataclasses.replace(validated, spec=spec), meshes)
        axis_of_group: dict[str, str] = {}  # group_name -> the mesh axis it is
        groups = {}
        for group, label in _labelled_groups(meshes):  # one group may be several axes (dp 2 x ep 2: dp is ep)
            if group.size() > 1:
                name = group.group_name
                axis_of_group[name] = f"{axis_of_group[name]} = {label}" if name in axis_of_group else label
                groups[name] = group
        traffic = CollectiveBytes(axis_of_group)
        flops = FlopCounterMode(display=False, custom_mapping=extra_flop_formulas())
        saved = SavedActivations(recomputation=cfg.activation_checkpointing)
        # the ranks of this stage (as build() names its exporter's), read off the real mesh tensor before the fake mode
        stage_ranks = meshes.mesh.mesh[meshes.mesh.get_local_rank("pp")].flatten().tolist()
        with fake_mode:
            built.loss_fn.denominator = denominator
            if built.balance is not None:
                built.balance.before_step(input_ids.numel())
            with flops, traffic:
                with saved:
                    local = built.run_batch(input_ids, labels, train=True)
                dist.all_reduce(local)
                pp_group = meshes.mesh["pp"].get_group()
                tp_group = meshes.tp.get_group() if meshes.tp is not None else None
                clip_grad_norm(built.parts, max_norm=cfg.grad_clip, pp_group=pp_group, tp_group=tp_group)
                for optimizer in built.optimizers:
                    optimizer.step()
            per_rank = {r: state_bytes(built.parts, built.optimizers, rank_coordinates(plan, r)) for r in stage_ranks}
        axes = {}
        for name, axis in axis_of_group.items():
            if axis in traffic.axes and axis not in axes:
                nodes = {r // gpus_per_node for r in dist.get_process_group_ranks(groups[name])}
                axes[axis] = traffic.axes[axis].to_json() | {"crosses_nodes": len(nodes) > 1}
        if "other" in traffic.axes:
            axes["other"] = traffic.axes["other"].to_json() | {"crosses_nodes": True}
        # FSDP2's transient buffers: the largest unsharded unit of each sharding axis, twice (the unit computing and
        # the next one prefetched)
        buffer_bytes = 2 * sum(t.largest_gather_bytes for t in traffic.axes.values())
        return {
            "rank": rank,
            "stage_ranks": stage_ranks,
            "per_rank": per_rank,
            "activation_peak_bytes": saved.peak_bytes,
            "buffer_bytes": buffer_bytes,
            "axes": axes,
            "flops": int(flops.get_total_flops()),
        }
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------------------
# The whole job: every position, the verdict, the report
# ------------------------------------------------------------------------------------------------------------------

_ITEMS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_peak_bytes", "buffer_bytes")


def dry_run(cfg: RunConfig) -> dict[str, Any]:
    """The dry run of `cfg`'s layout (validated like a real run of `--world-size` ranks); returns dry_run.json's
    content (also written to `<out>/dry_run.json`)."""
    from trainer.models import build_meta_model
    from trainer.step_time import hardware, predict_step_time
    from trainer.validation import validate

    world_size = cfg.world_size_override if cfg.world_size_override is not None else cfg.world_size
    validated = validate(cfg, world_size=world_size)
    plan = validated.plan
    parameters = sum(p.numel() for p in validated.model.parameters())
    hw = hardware(
        gpu=cfg.gpu,
        tflops=cfg.gpu_tflops,
        nvlink_gbps=cfg.nvlink_gbps,
        network_gbps=cfg.network_gbps,
        gpus_per_node=cfg.gpus_per_node,
    )
    gpu_memory_gib = cfg.gpu_memory if cfg.gpu_memory is not None else hw.memory_gib
    ranks_per_stage = world_size // plan.pp
    positions = []
    for stage in range(plan.pp):
        run = validated if stage == 0 else dataclasses.replace(validated, model=build_meta_model(validated.spec))
        positions.append(fake_step(cfg, run, rank=stage * ranks_per_stage, world_size=world_size,
                                   gpus_per_node=hw.gpus_per_node))  # fmt: skip
    limit = gpu_memory_gib * GIB
    ranks = []
    for position_index, position in enumerate(positions):
        for r in position["stage_ranks"]:
            entry: dict[str, Any] = {"rank": r, "position": position_index} | position["per_rank"][r]
            entry |= {item: position[item] for item in ("activation_peak_bytes", "buffer_bytes")}
            entry["total_bytes"] = sum(entry[item] for item in _ITEMS)
            ranks.append(entry)
    ranks.sort(key=lambda e: e["rank"])
    busiest = max(ranks, key=lambda e: e["total_bytes"])
    fits = busiest["total_bytes"] <= limit
    tokens = plan.global_batch * plan.seq_len
    prediction = predict_step_time(
        positions, hw=hw, pp=plan.pp, microbatches=plan.microbatches, world_size=world_size, tokens_per_step=tokens
    )
    report = {
        "model": cfg.model_path or cfg.model,
        "parameters": parameters,
        "parameter_bytes_total": sum(p.numel() * p.element_size() for p in validated.model.parameters()),
        "world_size": world_size,
        "gpu_memory_gib": gpu_memory_gib,
        "fits": fits,
        "busiest_rank": busiest["rank"],
        "biggest_item": max(_ITEMS, key=lambda item: busiest[item]),
        "plan": plan.to_json(),
        "ranks": ranks,
        "positions": [
            {"stage": i, "ranks": p["stage_ranks"]}
            | {key: p[key] for key in ("flops", "activation_peak_bytes", "buffer_bytes", "axes")}
            for i, p in enumerate(positions)
        ],
        "predicted": prediction,
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "dry_run.json").write_text(json.dumps(report, indent=1))
    return report


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f}"


def format_report(report: dict[str, Any]) -> str:
    """The printed table: one row per stage (rank position), memory in GiB, traffic per axis, the verdict and the
    predicted time."""
    lines = [
        f"dry run: {report['model']}, {report['parameters'] / 1e9:.2f}B parameters, {report['world_size']} ranks, "
        f"layout {report['plan']['mesh']}",
        "stage  ranks        params    grads    optim  activ.  buffers    total  (GiB, busiest rank of the stage)",
    ]
    by_position: dict[int, list[dict[str, Any]]] = {}
    for entry in report["ranks"]:
        by_position.setdefault(entry["position"], []).append(entry)
    for position, entries in sorted(by_position.items()):
        top = max(entries, key=lambda e: e["total_bytes"])
        ranks = f"{entries[0]['rank']}-{entries[-1]['rank']}"
        lines.append(f"{position:5d}  {ranks:9s} " + " ".join(_gib(top[item]) for item in (*_ITEMS, "total_bytes")))
    lines.append("bytes sent per step by one rank, per mesh axis:")
    for position in report["positions"]:
        for axis, traffic in position["axes"].items():
            kinds = ", ".join(f"{k} {v / GIB:.3f}" for k, v in traffic["by_kind"].items())
            link = "network" if traffic["crosses_nodes"] else "NVLink"
            lines.append(
                f"  stage {position['stage']} {axis:26s} {traffic['sent_bytes'] / GIB:9.3f} GiB ({kinds}; {link})"
            )
    pred = report["predicted"]
    hw = pred["hardware"]
    lines.append(
        f"predicted on {hw['name']} ({hw['tflops']:.0f} TFLOP/s, NVLink {hw['nvlink_gbps']:.0f} GB/s, network "
        f"{hw['network_gbps']:.0f} GB/s per GPU): step {pred['step_s']:.3f} s, {pred['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {100 * pred['mfu']:.1f} % (a model, not a measurement: see the README)"
    )
    busiest = next(e for e in report["ranks"] if e["rank"] == report["busiest_rank"])
    verdict = "fits" if report["fits"] else "does NOT fit"
    lines.append(
        f"verdict: {verdict} in {report['gpu_memory_gib']:g} GiB: busiest rank {busiest['rank']} needs "
        f"{busiest['total_bytes'] / GIB:.2f} GiB, biggest item {report['biggest_item']} "
        f"({busiest[report['biggest_item']] / GIB:.2f} GiB)"
    )
    return "\n".join(lines)


def main(cfg: RunConfig) -> int:
    """`am-train --dry-run`: run, print the table, exit 0 when it fits, 2 when it does not."""
    report = dry_run(cfg)
    print(format_report(report), flush=True)
    if not report["fits"]:
        print(
            f"error: the layout does not fit --gpu-memory {report['gpu_memory_gib']:g} GiB (see the table above)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_DOES_NOT_FIT
    return 0


__all__ = ["dry_run", "fake_step", "format_report", "main", "rank_coordinates"]
