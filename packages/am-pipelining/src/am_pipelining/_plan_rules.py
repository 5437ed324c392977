"""The rules `plan_pipeline` composes: stage counts, per-rank limits of each schedule kind, placement, layer
splits, explicit layer lists and batch divisibility. Each rule appends its problems (with their fix) to a list, so
the plan can report all of them at once.

Private to `am_pipelining.planning`: everyone else asks `plan_pipeline`. Must not touch torch.distributed, a model or
a stage; schedule classes come from `am_pipelining._compat`.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import _compat

_V_SHAPED_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_STAGES_PER_RANK_MICROBATCHES = ("Schedule1F1B", "ScheduleDualPipeV")
"""Schedules that need at least as many microbatches as stages (torch raises or stalls with fewer)."""


def schedule_placement_style(schedule_class: type) -> str:
    """ "v" for V-shaped schedules (ZBVZeroBubble, DualPipeV): rank r owns stages r and n-1-r; else "loop"."""
    names = {cls.__name__ for cls in schedule_class.__mro__}
    return "v" if names & set(_V_SHAPED_SCHEDULES) else "loop"


def min_microbatches_for(schedule_class: type, num_stages: int) -> int:
    return num_stages if schedule_class.__name__ in _STAGES_PER_RANK_MICROBATCHES else 1


def place_stages(pp_size: int, num_stages: int, style: str) -> tuple[tuple[int, ...], ...]:
    per_rank = num_stages // pp_size
    if style == "v":
        return tuple((rank, num_stages - 1 - rank) for rank in range(pp_size))
    return tuple(tuple(rank + s * pp_size for s in range(per_rank)) for rank in range(pp_size))


def split_layer_ranges(num_layers: int, num_stages: int, problems: list[str]) -> tuple[tuple[int, ...], ...] | None:
    """Contiguous layer ranges, the first `L % n` stages one layer longer (10 layers / 3 stages -> 4, 3, 3)."""
    if num_stages < 1:
        problems.append(f"Number of stages must be at least 1, got {num_stages}.")
        return None
    if num_stages > num_layers:
        problems.append(
            f"Number of stages ({num_stages}) cannot exceed number of layers ({num_layers}): every stage needs at "
            "least one decoder layer. Use fewer pipeline ranks or fewer stages per rank (or a larger "
            "layers_per_stage), or give a model with more layers."
        )
        return None
    base, extra = divmod(num_layers, num_stages)
    starts = [stage * base + min(stage, extra) for stage in range(num_stages + 1)]  # stage k's first layer
    return tuple(tuple(range(start, end)) for start, end in itertools.pairwise(starts))


def explicit_layer_problems(stage_layers: Sequence[Sequence[int]], num_layers: int, say: Say) -> list[str]:
    """Every layer exactly once, known indices, and stage order = layer order."""
    problems = []
    owners: dict[int, list[int]] = {}
    for stage, layers in enumerate(stage_layers):
        for layer in layers:
            owners.setdefault(int(layer), []).append(stage)
    unknown = sorted(layer for layer in owners if not 0 <= layer < num_layers)
    if unknown:
        problems.append(
            f"{say('stage_layers')} names layers {unknown} but the model has layers 0..{num_layers - 1}: fix the "
            "layer names."
        )
    missing = [layer for layer in range(num_layers) if layer not in owners]
    if missing:
        problems.append(
            f"{say('stage_layers')} leaves out layers {missing}: every decoder layer must be in exactly one stage "
            "(a left-out layer would silently not run). Add them to the stage that should run them."
        )
    repeated = {layer: stages for layer, stages in sorted(owners.items()) if len(stages) > 1}
    if repeated:
        shown = ", ".join(f"layer {layer} in stages {stages}" for layer, stages in repeated.items())
        problems.append(
            f"{say('stage_layers')} puts a layer in more than one stage ({shown}): keep each layer in exactly one "
            "stage."
        )
    flat = [layer for layers in stage_layers for layer in sorted(int(x) for x in layers)]
    if not unknown and not missing and not repeated and flat != sorted(flat):
        problems.append(
            f"{say('stage_layers')} runs the layers out of order ({[sorted(s) for s in stage_layers]}): stage k+1 "
            "must hold the layers that follow stage k's. List contiguous layer ranges in stage order."
        )
    return problems


Say = Callable[[str], str]
"""Names a request value the caller's way (`option_labels`, e.g. "--stages-per-rank 3"), else `name=value`."""


def sayer(values: Mapping[str, Any], labels: Mapping[str, str] | None) -> Say:
    return lambda name: (labels or {}).get(name, f"{name}={values.get(name)!r}")


def resolve_schedule(schedule: str | type | None, csv: Any, problems: list[str], say: Say) -> type | None:
    if schedule is None and csv is None:
        problems.append(
            "Either pipeline_parallel_schedule or pipeline_parallel_schedule_csv must be provided: name a schedule "
            f"({', '.join(_compat.SCHEDULE_NAMES)}) or give a CSV schedule file."
        )
        return None
    if schedule is None:
        return _compat.runtime_schedule_class()
    if isinstance(schedule, type):
        if not _compat.is_schedule_class(schedule):
            problems.append(f"{say('schedule')} is not a torch pipeline schedule class.")
            return None
        return schedule
    try:
        return _compat.get_schedule_class(schedule)
    except ValueError:
        problems.append(
            f"{say('schedule')} is unknown: use one of {', '.join(_compat.SCHEDULE_NAMES)} (case-insensitive)."
        )
        return None


def stage_count(
    *,
    num_layers: int | None,
    pp_size: int,
    multi: bool | None,
    stages_per_rank: int | None,
    layers_per_stage: int | None,
    round_to_pp_multiple: str | None,
    num_stages: int | None,
    stage_layers: Sequence[Sequence[int]] | None,
    problems: list[str],
    say: Say,
) -> int | None:
    """The requested number of stages (None when it cannot be known); conflicting requests are problems."""
    if round_to_pp_multiple is not None and round_to_pp_multiple not in ("up", "down"):
        problems.append(f"Invalid value for round_to_pp_multiple: {round_to_pp_multiple!r}. Use 'up' or 'down'.")
    requests = [
        name
        for name, value in (
            ("stages_per_rank", stages_per_rank),
            ("layers_per_stage", layers_per_stage),
            ("num_stages", num_stages),
            ("stage_layers", stage_layers),
        )
        if value is not None
    ]
    if len(requests) > 1:
        problems.append(
            f"{' and '.join(say(name) for name in requests)} each fix the number of stages: give only one of them."
        )
        return None
    if round_to_pp_multiple is not None and layers_per_stage is None:
        problems.append(
            f"{say('round_to_pp_multiple')} only rounds the stage count derived from layers_per_stage; drop it or "
            "give layers_per_stage."
        )
    if stage_layers is not None:
        return len(stage_layers)
    if num_stages is not None:
        if num_stages < 1:
            problems.append(f"{say('num_stages')}: need at least 1 stage.")
            return None
        return num_stages
    if stages_per_rank is not None:
        if stages_per_rank < 1:
            problems.append(f"{say('stages_per_rank')}: every rank needs at least 1 stage.")
            return None
        return stages_per_rank * pp_size
    if layers_per_stage is None:
        return None if multi is None else pp_size * (2 if multi else 1)
    if layers_per_stage < 1:
        problems.append(f"{say('layers_per_stage')}: must be >= 1.")
        return None
    if num_layers is None:
        problems.append(f"{say('layers_per_stage')} needs the model's number of layers (num_layers).")
        return None
    count = math.ceil(num_layers / layers_per_stage)
    if count % pp_size != 0:
        if round_to_pp_multiple == "up":
            count = math.ceil(count / pp_size) * pp_size
        elif round_to_pp_multiple == "down":
            count = max(pp_size, count // pp_size * pp_size)
        elif round_to_pp_multiple is None:
            problems.append(
                f"Number of virtual stages ({count}) must be divisible by pipeline parallel size ({pp_size}). "
                f"Model has {num_layers} layers with {say('layers_per_stage')}. Please adjust layers_per_stage or "
                "set round_to_pp_multiple='up' or 'down' (or give stages_per_rank instead)."
            )
            return None
        else:
            return None  # invalid rounding mode, reported above
    return count


def per_rank_problems(
    schedule_class: type, *, multi: bool, style: str, stages_per_rank: int, num_stages: int, fix: str, say: Say
) -> list[str]:
    name = schedule_class.__name__
    got = f"{stages_per_rank} stage{'s' * (stages_per_rank != 1)} per rank ({num_stages} stages / {say('pp_size')})"
    problems = []
    if not multi and stages_per_rank != 1:
        problems.append(
            f"Single stage schedule {name} requires exactly 1 stage per rank, but got {got}. {fix} Or pick a "
            "multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)."
        )
    elif multi and stages_per_rank < 2 and schedule_class is not _compat.runtime_schedule_class():
        # The CSV runtime schedule runs whatever the file lists: one stage per rank (a 1F1B written as a CSV, what
        # NeMo AutoModel's build_pipeline_schedule accepts) is as valid as several.
        problems.append(
            f"Multi-stage schedule {name} requires at least 2 stages per rank, but got {got}. {fix} Or pick 1F1B "
            "or GPipe."
        )
    elif style == "v" and stages_per_rank != 2:
        problems.append(
            f"V-shaped schedule {name} needs exactly 2 stages per rank (rank r runs stages r and n-1-r), but got "
            f"{got}. Use {2 * num_stages // stages_per_rank} stages (stages_per_rank=2)."
        )
    return problems


def stage_count_fix(
    *, stages_per_rank: int | None, layers_per_stage: int | None, num_layers: int | None, pp_size: int, multi: bool
) -> str:
    if layers_per_stage is not None and num_layers is not None:
        if multi:
            return f"Decrease layers_per_stage to {max(1, num_layers // (2 * pp_size))} or lower."
        return f"Increase layers_per_stage to {math.ceil(num_layers / pp_size)} or higher."
    if stages_per_rank is not None:
        return f"Use stages_per_rank={2 if multi else 1}."
    return "Change the number of stages."


def csv_problems(csv: str | os.PathLike[str] | None) -> list[str]:
    """The CSV schedule file must exist (empty list when it does or when there is none)."""
    if csv is None or os.path.isfile(csv):
        return []
    return [f"The specified path {os.fspath(csv)} does not exist or is not a file (pipeline_parallel_schedule_csv)."]


def batch_problems(
    local_batch_size: int | None,
    microbatch_size: int | None,
    minimum: int,
    schedule_class: type | None,
    num_stages: int | None,
    problems: list[str],
    say: Say,
) -> int | None:
    if local_batch_size is None and microbatch_size is None:
        return None
    if local_batch_size is None or microbatch_size is None:
        given = "local_batch_size" if local_batch_size is not None else "microbatch_size"
        problems.append(f"{say(given)} was given alone: give local_batch_size and microbatch_size together.")
        return None
    if local_batch_size < 1 or microbatch_size < 1:
        problems.append(f"{say('local_batch_size')} and {say('microbatch_size')}: both must be >= 1.")
        return None
    if local_batch_size % microbatch_size:
        problems.append(
            f"{say('local_batch_size')} is not divisible by {say('microbatch_size')}: local_batch_size must be "
            "divisible by microbatch_size (every microbatch has the same size). Change either."
        )
        return None
    n_microbatches = local_batch_size // microbatch_size
    if schedule_class is not None and num_stages is not None and n_microbatches < minimum:
        problems.append(
            f"{schedule_class.__name__} needs at least {minimum} microbatches for {num_stages} stages, but "
            f"{say('local_batch_size')} / {say('microbatch_size')} gives {n_microbatches}. Fix: raise the batch "
            f"to >= {minimum * microbatch_size} sequences or lower the microbatch size."
        )
    return n_microbatches
