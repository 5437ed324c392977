"""`grouped_mm="auto"`: measure once per process whether `torch._grouped_mm` or the per-expert loop is faster.

What it is for: the rules of `select_grouped_mm_backend` say which backends CAN run; they cannot say which is faster
(on the CPU `torch._grouped_mm` measured 1.3x to 4.6x the CPU time of the sorted per-expert loop, on an H100 the
fused bf16 kernel wins). So where both can run, the first forward of `GroupedExperts` with `grouped_mm="auto"`
times the expert MLP (both projections and the activation, forward and backward) with each backend on its actual
rows and weights, keeps the faster one for the rest of the process, and reports it with both timings
(`grouped_mm_auto_choices()`, `GroupedExperts.grouped_mm_choice`). Both backends compute the same per-expert
matmuls, so the choice changes nothing but fp32 rounding order (tested).
What it must not do: run a collective (ranks may choose differently, which is fine numerically), consume random
numbers, touch the module's parameters, gradients or load counters, or time fake / meta tensors or a graph being
compiled (then the rule's choice is used, and the measurement waits for a real forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .grouped_mm import GroupedMMChoice

__all__ = ["TuningKey", "grouped_mm_auto_choices"]

CANDIDATES: tuple[str, ...] = ("grouped_mm", "loop")
REPEATS = 3  # best of REPEATS after one warm-up run per backend, alternating (noise from other processes)


@dataclass(frozen=True)
class TuningKey:
    """What the timing depends on besides the row count: one measurement per key and process."""

    device: str  # a torch device string ("cuda:0", "cpu"): the timer synchronises this device
    dtype: torch.dtype
    local_experts: int
    hidden: int
    intermediate: int
    gated: bool
    activation: str
    capability: str = ""  # "sm90" on CUDA: the same device index can hold another GPU model in another process

    def describe(self) -> str:
        kind = "gated" if self.gated else "plain"
        where = f"{self.device} {self.capability}" if self.capability else self.device
        return (
            f"{where} {str(self.dtype).removeprefix('torch.')}: {self.local_experts} local experts, "
            f"H={self.hidden}, I={self.intermediate}, {kind} {self.activation}"
        )


_CHOICES: dict[TuningKey, GroupedMMChoice] = {}


def grouped_mm_auto_choices() -> dict[str, GroupedMMChoice]:
    """What `grouped_mm="auto"` picked in this process, and why: `{expert shapes: GroupedMMChoice}`.

    Each choice's `reason` names both timings and the rows they were measured on; `seconds` holds them.
    """
    return {key.describe(): choice for key, choice in _CHOICES.items()}


def measured_choice(key: TuningKey) -> GroupedMMChoice | None:
    """The measured choice for `key`, or None when this process has not measured it yet."""
    return _CHOICES.get(key)


def can_measure(rows: torch.Tensor, num_rows: int) -> bool:
    """Real tensors with at least one routed row, outside compilation (timings of anything else mean nothing)."""
    if num_rows == 0 or rows.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return not isinstance(rows, torch._subclasses.FakeTensor)


def measure_grouped_mm(
    key: TuningKey, run: Callable[[str, bool], None], *, num_rows: int, rule: GroupedMMChoice
) -> GroupedMMChoice:
    """Time `run(backend, backward)` for each candidate backend, cache and return the faster one.

    run: computes the experts once with `backend` on detached copies of the real rows and weights, and its backward
        when `backward` is True (not under inference mode, whose tensors cannot require grad).
    rule: the rules' choice (it said grouped_mm can run); its reason is kept in the measured choice's reason.
    """
    backward = not torch.is_inference_mode_enabled()
    best: dict[str, float] = {}
    with torch.enable_grad() if backward else torch.no_grad():
        for backend in CANDIDATES:  # warm-up: first-call allocations and kernel selection are not timed
            run(backend, backward)
        for _ in range(REPEATS):
            for backend in CANDIDATES:
                seconds = _seconds(lambda b=backend: run(b, backward), key.device)  # type: ignore[misc]
                best[backend] = min(best.get(backend, float("inf")), seconds)
    winner = min(CANDIDATES, key=lambda b: best[b])
    what = "forward+backward" if backward else "forward"
    timings = ", ".join(f"{b} {best[b] * 1e3:.3f} ms" for b in CANDIDATES)
    clock = "wall clock" if key.device.startswith("cuda") else "process CPU time"
    choice = replace(
        rule,
        backend=winner,
        reason=f"measured ({what} on {num_rows} rows, best of {REPEATS}, {clock}): {timings} -> {winner}; "
        f"rule: {rule.reason}",
        seconds=tuple((b, best[b]) for b in CANDIDATES),
    )
    _CHOICES[key] = choice
    return choice


def _seconds(fn: Callable[[], None], device: str) -> float:
    """One timed call: wall clock around device synchronisation on CUDA, process CPU time elsewhere."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start
    start = time.process_time()
    fn()
    return time.process_time() - start
