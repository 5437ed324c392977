"""A predicted step time from the dry run's counts: FLOPs per rank and bytes per mesh axis, on named hardware.

What it is for (issue 23 §4): `predict_step_time` turns what the fake step really executed (FLOPs counted by
`FlopCounterMode`, bytes counted from its collectives: trainer/dry_run_comm.py) into seconds on a GPU and
interconnect given as numbers (`Hardware`; `GPUS` names a few, public figures), then MFU and tokens/s.

The model, plainly (the README says the same): per pipeline stage, compute = FLOPs / peak dense TFLOP/s (no kernel
efficiency below peak), communication = bytes sent per axis / that axis's link bandwidth (NVLink inside a node,
InfiniBand across nodes, per GPU and direction), added with NO overlap of communication and compute (an upper
bound for both); a pipeline stretches the slowest stage by the schedule's bubble, (microbatches + pp - 1) /
microbatches. It leaves out: kernel efficiency (real matmuls reach 50-80 % of peak), launch latency and small-message
latency, overlap (FSDP2 prefetch, EP/compute overlap), memory-bandwidth-bound kernels (norms, elementwise, the
optimizer step), network contention and topology, stragglers and data loading. Treat it as an order of magnitude.
What it must not do: pretend to be a measurement (every number is labelled "predicted").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links: `tflops` dense bf16 peak; `nvlink_gbps` GB/s per direction per GPU inside a node;
    `network_gbps` GB/s per GPU across nodes (400 Gb/s InfiniBand = 50 GB/s); `gpus_per_node`; `memory_gib`."""

    name: str
    tflops: float
    nvlink_gbps: float
    network_gbps: float
    gpus_per_node: int
    memory_gib: float


# Public figures (vendor data sheets): dense bf16 peak without sparsity, NVLink bandwidth per direction.
GPUS = {
    "h100-sxm": Hardware("H100 SXM", tflops=989.0, nvlink_gbps=450.0, network_gbps=50.0, gpus_per_node=8,
                         memory_gib=80.0),
    "h200": Hardware("H200 SXM", tflops=989.0, nvlink_gbps=450.0, network_gbps=50.0, gpus_per_node=8,
                     memory_gib=141.0),
    "a100-sxm": Hardware("A100 SXM 80GB", tflops=312.0, nvlink_gbps=300.0, network_gbps=25.0, gpus_per_node=8,
                         memory_gib=80.0),
    "b200": Hardware("B200", tflops=2250.0, nvlink_gbps=900.0, network_gbps=50.0, gpus_per_node=8,
                     memory_gib=180.0),
}  # fmt: skip
DEFAULT_GPU = "h100-sxm"


def hardware(*, gpu: str, tflops: float | None, nvlink_gbps: float | None, network_gbps: float | None,
             gpus_per_node: int | None) -> Hardware:  # fmt: skip
    """The named GPU (`GPUS`) with any figure the caller gives instead."""
    given: dict[str, Any] = {
        "tflops": tflops,
        "nvlink_gbps": nvlink_gbps,
        "network_gbps": network_gbps,
        "gpus_per_node": gpus_per_node,
    }
    return replace(GPUS[gpu], **{name: value for name, value in given.items() if value is not None})


def predict_step_time(
    stages: list[dict[str, Any]],
    *,
    hw: Hardware,
    pp: int,
    microbatches: int,
    world_size: int,
    tokens_per_step: int,
) -> dict[str, Any]:
    """The predicted step (see the module docstring).

    stages: one per pipeline stage (rank position): {"flops": FLOPs of one rank in one step, "axes": {axis:
        {"sent_bytes": ..., "crosses_nodes": bool}}}.
    Returns: {"hardware", "stages": [{"compute_s", "communication_s", "step_s"}], "step_s", "tokens_per_s",
        "mfu", "total_flops"}.
    """
    per_stage = []
    for stage in stages:
        compute = stage["flops"] / (hw.tflops * 1e12)
        comm = 0.0
        for traffic in stage["axes"].values():
            bandwidth = hw.network_gbps if traffic["crosses_nodes"] else hw.nvlink_gbps
            comm += traffic["sent_bytes"] / (bandwidth * 1e9)
        per_stage.append({"compute_s": compute, "communication_s": comm, "step_s": compute + comm})
    bubble = (microbatches + pp - 1) / microbatches if pp > 1 else 1.0
    step = max(s["step_s"] for s in per_stage) * bubble
    ranks_per_stage = world_size // pp
    total_flops = sum(stage["flops"] for stage in stages) * ranks_per_stage
    return {
        "hardware": asdict(hw),
        "pipeline_bubble": bubble,
        "stages": per_stage,
        "step_s": step,
        "tokens_per_s": tokens_per_step / step if step > 0 else None,
        "total_flops": total_flops,
        "mfu": total_flops / (world_size * hw.tflops * 1e12 * step) if step > 0 else None,
    }


__all__ = ["DEFAULT_GPU", "GPUS", "Hardware", "hardware", "predict_step_time"]
