"""One pipeline plan: how many stages, which decoder layers each holds, which rank runs which stage, how many
microbatches a step has.

`plan_pipeline` is a pure function (no process group, no model, no stage): it turns a request into a frozen
`PipelinePlan`, or raises ONE `PipelinePlanError` listing every problem with its fix. Splitting
(`split_model_into_stages`), schedule building (`build_pipeline_schedule`, `pipeline_model`), `AutoPipeline`, the
schedule picture and the reference trainer all ask it; nobody else derives a stage count, a placement, a layer split
or a microbatch rule. The upstream-named helpers (`calculate_virtual_stages`, `stage_ids_this_rank`,
`min_microbatches`) are thin wrappers over it.

What it must not do: touch torch.distributed, a model or a stage. Schedule classes are looked up through
`am_pipelining._compat` (the only module that knows torch pipelining internals).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from am_pipelining import _compat

__all__ = [
    "PipelinePlan",
    "PipelinePlanError",
    "plan_pipeline",
    "split_layers",
    "schedule_placement_style",
    "calculate_virtual_stages",
    "stage_ids_this_rank",
    "min_microbatches",
]

_V_SHAPED_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_STAGES_PER_RANK_MICROBATCHES = ("Schedule1F1B", "ScheduleDualPipeV")
"""Schedules that need at least as many microbatches as stages (torch raises or stalls with fewer)."""


class PipelinePlanError(ValueError):
    """A pipeline request that cannot run; `problems` lists every reason, each with its fix."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        count = len(self.problems)
        listed = "\n".join(f"{i}. {problem}" for i, problem in enumerate(self.problems, start=1))
        super().__init__(f"Pipeline configuration refused ({count} problem{'s' * (count > 1)}):\n{listed}")


@dataclass(frozen=True)
class PipelinePlan:
    """The whole pipeline layout, decided once.

    Attributes:
        schedule: the schedule's short name ("1F1B", "Interleaved1F1B", ...; "_PipelineScheduleRuntime" for a
            CSV-only plan).
        schedule_class: torch's schedule class.
        csv: the compute-only CSV schedule file, if any.
        multi_stage: whether the schedule takes a list of stages per rank.
        placement: "loop" (rank r owns r, r+p, ...) or "v" (rank r owns r and n-1-r).
        pp_size: pipeline ranks.
        num_layers: decoder layers of the model (None when planned without a model).
        num_stages / stages_per_rank: stage count, and stages on every rank.
        layers_per_stage: decoder layers per stage, e.g. (3, 2) for 5 layers on 2 stages (None without a model).
        stage_layers: the layer indices of each stage, contiguous and in order (None without a model).
        rank_stages: the stage ids of each pipeline rank, indexed by pp rank.
        local_batch_size / microbatch_size / n_microbatches: the batch of one step on one pipeline replica and its
            split (None when planned without a batch).
        min_microbatches: the fewest microbatches the schedule runs for this stage count.
    """

    schedule: str
    schedule_class: type
    csv: str | None
    multi_stage: bool
    placement: str
    pp_size: int
    num_layers: int | None
    num_stages: int
    stages_per_rank: int
    layers_per_stage: tuple[int, ...] | None
    stage_layers: tuple[tuple[int, ...], ...] | None
    rank_stages: tuple[tuple[int, ...], ...]
    local_batch_size: int | None
    microbatch_size: int | None
    n_microbatches: int | None
    min_microbatches: int

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        """Global stage ids run by `pp_rank`, in the order its schedule lists them."""
        return self.rank_stages[pp_rank]

    def rank_of_stage(self, stage_id: int) -> int:
        """The pipeline rank (group-local) that runs `stage_id`."""
        for rank, stages in enumerate(self.rank_stages):
            if stage_id in stages:
                return rank
        raise ValueError(f"Stage {stage_id} does not exist: the plan has {self.num_stages} stages.")

    def layout(self) -> dict[str, Any]:
        """JSON-ready description of what runs (for logs and run summaries)."""
        return {
            "pp": self.pp_size,
            "schedule": self.schedule,
            "csv": self.csv,
            "placement": self.placement,
            "stages": self.num_stages,
            "stages_per_rank": self.stages_per_rank,
            "layers": self.num_layers,
            "layers_per_stage": list(self.layers_per_stage) if self.layers_per_stage is not None else None,
            "rank_stages": [list(stages) for stages in self.rank_stages],
            "microbatch_size": self.microbatch_size,
            "microbatches": self.n_microbatches,
        }


# ------------------------------------------------------------------------------------------------------------
# Rules (each used by plan_pipeline; the public wrappers below call plan_pipeline)
# ------------------------------------------------------------------------------------------------------------


def schedule_placement_style(schedule_class: type) -> str:
    """ "v" for V-shaped schedules (ZBVZeroBubble, DualPipeV): rank r owns stages r and n-1-r; else "loop"."""
    names = {cls.__name__ for cls in schedule_class.__mro__}
    return "v" if names & set(_V_SHAPED_SCHEDULES) else "loop"


def _min_microbatches(schedule_class: type, num_stages: int) -> int:
    return num_stages if schedule_class.__name__ in _STAGES_PER_RANK_MICROBATCHES else 1


def _placement(pp_size: int, num_stages: int, style: str) -> tuple[tuple[int, ...], ...]:
    per_rank = num_stages // pp_size
    if style == "v":
        return tuple((rank, num_stages - 1 - rank) for rank in range(pp_size))
    return tuple(tuple(rank + s * pp_size for s in range(per_rank)) for rank in range(pp_size))


def _split_layers(num_layers: int, num_stages: int, problems: list[str]) -> tuple[tuple[int, ...], ...] | None:
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
    ranges, start = [], 0
    for stage in range(num_stages):
        count = base + (1 if stage < extra else 0)
        ranges.append(tuple(range(start, start + count)))
        start += count
    return tuple(ranges)


def split_layers(num_layers: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """The layer indices of each of `num_stages` stages (the split every plan uses).

    Raises:
        ValueError: fewer than 1 stage, or more stages than layers.
    """
    problems: list[str] = []
    ranges = _split_layers(num_layers, num_stages, problems)
    if ranges is None:
        raise ValueError(problems[0])
    return ranges


def _explicit_layer_problems(stage_layers: Sequence[Sequence[int]], num_layers: int, say: _Say) -> list[str]:
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


class _Say:
    """Names a request value the caller's way (`option_labels`, e.g. "--stages-per-rank 3"), else `name=value`."""

    def __init__(self, values: Mapping[str, Any], labels: Mapping[str, str] | None) -> None:
        self.values = values
        self.labels = dict(labels or {})

    def __call__(self, name: str) -> str:
        if name in self.labels:
            return self.labels[name]
        return f"{name}={self.values.get(name)!r}"


# ------------------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------------------


def _resolve_schedule(schedule: str | type | None, csv: Any, problems: list[str], say: _Say) -> type | None:
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


def _stage_count(
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
    say: _Say,
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


def _per_rank_problems(
    schedule_class: type, *, multi: bool, style: str, stages_per_rank: int, num_stages: int, fix: str, say: _Say
) -> list[str]:
    name = schedule_class.__name__
    got = f"{stages_per_rank} stage{'s' * (stages_per_rank != 1)} per rank ({num_stages} stages / {say('pp_size')})"
    problems = []
    if not multi and stages_per_rank != 1:
        problems.append(
            f"Single stage schedule {name} requires exactly 1 stage per rank, but got {got}. {fix} Or pick a "
            "multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)."
        )
    elif multi and stages_per_rank < 2:
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


def _stage_count_fix(
    *, stages_per_rank: int | None, layers_per_stage: int | None, num_layers: int | None, pp_size: int, multi: bool
) -> str:
    if layers_per_stage is not None and num_layers is not None:
        if multi:
            return f"Decrease layers_per_stage to {max(1, num_layers // (2 * pp_size))} or lower."
        return f"Increase layers_per_stage to {math.ceil(num_layers / pp_size)} or higher."
    if stages_per_rank is not None:
        return f"Use stages_per_rank={2 if multi else 1}."
    return "Change the number of stages."


def plan_pipeline(
    num_layers: int | None,
    pp_size: int,
    schedule: str | type | None,
    *,
    csv: str | os.PathLike[str] | None = None,
    stages_per_rank: int | None = None,
    layers_per_stage: int | None = None,
    round_to_pp_multiple: str | None = None,
    num_stages: int | None = None,
    stage_layers: Sequence[Sequence[int]] | None = None,
    local_batch_size: int | None = None,
    microbatch_size: int | None = None,
    option_labels: Mapping[str, str] | None = None,
) -> PipelinePlan:
    """Plan a pipeline, or refuse it with every problem at once.

    Args:
        num_layers: decoder layers of the model; None plans without a model (no layer split, no layer checks).
        pp_size: pipeline ranks.
        schedule: a torch schedule name (case-insensitive: "1F1B", "interleaved1f1b", ...) or class; None with a
            `csv` runs the CSV with torch's runtime schedule (loop placement, 2 stages per rank by default). With
            both, the name decides stages per rank and placement.
        stages_per_rank: run EXACTLY this many stages per rank (8 layers, pp=2, 3 per rank -> 6 stages holding
            2, 2, 1, 1, 1, 1 layers).
        layers_per_stage / round_to_pp_multiple: upstream's request: `ceil(num_layers / layers_per_stage)` stages,
            rounded "up"/"down" to a multiple of `pp_size` when asked; the layers are then split evenly.
        num_stages: an exact stage count.
        stage_layers: explicit layer indices per stage (from `module_names_per_stage`); every layer exactly once,
            stage order = layer order.
        local_batch_size / microbatch_size: one step's batch on one pipeline replica and its microbatch size; both
            or neither (None skips the batch rules).
        option_labels: how to name each request in messages, e.g. `{"stages_per_rank": "--stages-per-rank 3"}`
            (default `stages_per_rank=3`). Keys: the argument names above, plus "pp_size" and "schedule".

    Without a stage request, single-stage schedules (GPipe, 1F1B) get 1 stage per rank, multi-stage ones 2.

    Raises:
        PipelinePlanError (a ValueError): listing every problem (unknown schedule, conflicting requests, stages not
            divisible by ranks, a single-stage schedule with several stages per rank, a multi-stage one with fewer
            than 2, a V schedule without exactly 2, more stages than layers, explicit layers missing / repeated /
            out of order, a batch not divisible by the microbatch size, too few microbatches, a missing CSV file).
    """
    values = {
        "num_layers": num_layers,
        "pp_size": pp_size,
        "schedule": schedule,
        "csv": csv,
        "stages_per_rank": stages_per_rank,
        "layers_per_stage": layers_per_stage,
        "round_to_pp_multiple": round_to_pp_multiple,
        "num_stages": num_stages,
        "stage_layers": None if stage_layers is None else [list(s) for s in stage_layers],
        "local_batch_size": local_batch_size,
        "microbatch_size": microbatch_size,
    }
    say = _Say(values, option_labels)
    problems: list[str] = []
    schedule_class = _resolve_schedule(schedule, csv, problems, say)
    problems += csv_problems(csv)
    if pp_size < 1:
        problems.append(f"{say('pp_size')}: need at least 1 pipeline rank.")
    if num_layers is not None and num_layers < 1:
        problems.append(f"{say('num_layers')}: the model has no decoder layers to split.")
    multi = _compat.is_multi_stage_schedule(schedule_class) if schedule_class is not None else None
    style = schedule_placement_style(schedule_class) if schedule_class is not None else "loop"
    count = None
    if pp_size >= 1:
        count = _stage_count(
            num_layers=num_layers,
            pp_size=pp_size,
            multi=multi,
            stages_per_rank=stages_per_rank,
            layers_per_stage=layers_per_stage,
            round_to_pp_multiple=round_to_pp_multiple,
            num_stages=num_stages,
            stage_layers=stage_layers,
            problems=problems,
            say=say,
        )
    per_rank = None
    if count is not None:
        if count % pp_size != 0:
            problems.append(
                f"num_stages {count} must be evenly divisible by {say('pp_size')}: every rank runs the same number "
                "of stages. Change the number of stages."
            )
        else:
            per_rank = count // pp_size
            if schedule_class is not None and multi is not None:
                fix = _stage_count_fix(
                    stages_per_rank=stages_per_rank,
                    layers_per_stage=layers_per_stage,
                    num_layers=num_layers,
                    pp_size=pp_size,
                    multi=multi,
                )
                problems += _per_rank_problems(
                    schedule_class,
                    multi=multi,
                    style=style,
                    stages_per_rank=per_rank,
                    num_stages=count,
                    fix=fix,
                    say=say,
                )
    ranges: tuple[tuple[int, ...], ...] | None = None
    if num_layers is not None and num_layers >= 1 and count is not None:
        if stage_layers is not None:
            found = _explicit_layer_problems(stage_layers, num_layers, say)
            problems += found
            if not found:
                ranges = tuple(tuple(sorted(int(x) for x in layers)) for layers in stage_layers)
        else:
            ranges = _split_layers(num_layers, count, problems)
    minimum = _min_microbatches(schedule_class, count) if schedule_class is not None and count is not None else 1
    n_microbatches = _batch_problems(local_batch_size, microbatch_size, minimum, schedule_class, count, problems, say)
    if problems:
        raise PipelinePlanError(problems)
    assert schedule_class is not None
    assert count is not None
    assert per_rank is not None
    assert multi is not None
    return PipelinePlan(
        schedule=_compat.schedule_class_name(schedule_class),
        schedule_class=schedule_class,
        csv=os.fspath(csv) if csv is not None else None,
        multi_stage=multi,
        placement=style,
        pp_size=pp_size,
        num_layers=num_layers,
        num_stages=count,
        stages_per_rank=per_rank,
        layers_per_stage=tuple(len(r) for r in ranges) if ranges is not None else None,
        stage_layers=ranges,
        rank_stages=_placement(pp_size, count, style),
        local_batch_size=local_batch_size,
        microbatch_size=microbatch_size,
        n_microbatches=n_microbatches,
        min_microbatches=minimum,
    )


def csv_problems(csv: str | os.PathLike[str] | None) -> list[str]:
    """The CSV schedule file must exist (empty list when it does or when there is none)."""
    if csv is None or os.path.isfile(csv):
        return []
    return [f"The specified path {os.fspath(csv)} does not exist or is not a file (pipeline_parallel_schedule_csv)."]


def _batch_problems(
    local_batch_size: int | None,
    microbatch_size: int | None,
    minimum: int,
    schedule_class: type | None,
    num_stages: int | None,
    problems: list[str],
    say: _Say,
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


# ------------------------------------------------------------------------------------------------------------
# Upstream-named wrappers
# ------------------------------------------------------------------------------------------------------------


def calculate_virtual_stages(
    num_layers: int,
    layers_per_stage: int | None,
    pp_size: int,
    is_single_stage_schedule: bool,
    round_to_pp_multiple: str | None = None,
) -> tuple[int, int]:
    """(number of stages, stages per rank) for a schedule kind and an optional layers-per-stage target.

    Without `layers_per_stage`: 1 stage per rank for single-stage schedules, 2 for multi-stage ones. With it:
    `ceil(L / layers_per_stage)` stages, rounded "up"/"down" to a multiple of `pp_size` when asked.

    Raises:
        PipelinePlanError (a ValueError): see `plan_pipeline`.
    """
    kind = "PipelineScheduleSingle" if is_single_stage_schedule else "PipelineScheduleMulti"
    plan = plan_pipeline(
        num_layers, pp_size, kind, layers_per_stage=layers_per_stage, round_to_pp_multiple=round_to_pp_multiple
    )
    return plan.num_stages, plan.stages_per_rank


def stage_ids_this_rank(pp_rank: int, pp_size: int, num_stages: int, style: str = "loop") -> tuple[int, ...]:
    """Global stage indices owned by `pp_rank`.

    "loop": r, r+p, r+2p, ... (p=4, n=8: rank 1 -> (1, 5)). "v": exactly two stages per rank, (r, n-1-r)
    (p=4, n=8: rank 0 -> (0, 7), rank 3 -> (3, 4)).

    Raises:
        ValueError: stages not divisible by ranks, "v" without exactly 2 stages per rank, unknown style.
    """
    if style == "v":
        kind = "ZBVZeroBubble"
    elif style == "loop":
        kind = "PipelineScheduleSingle" if num_stages == pp_size else "PipelineScheduleMulti"
    else:
        raise ValueError(f"Unknown stage placement style {style!r}; use 'loop' or 'v'.")
    return plan_pipeline(None, pp_size, kind, num_stages=num_stages).stage_ids(pp_rank)


def min_microbatches(schedule_class: type, *, num_stages: int) -> int:
    """Fewest microbatches the schedule runs on `num_stages` stages without erroring or stalling (1: any count)."""
    return _min_microbatches(schedule_class, num_stages)
