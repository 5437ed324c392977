"""One pipeline plan: how many stages, which decoder layers each holds, which rank runs which stage, how many
microbatches a step has.

`plan_pipeline` is a pure function (no process group, no model, no stage): it turns a request into a frozen
`PipelinePlan`, or raises ONE `PipelinePlanError` listing every problem with its fix. Splitting (`build_stages`)
and schedule building (`build_schedule`) take the plan and do not re-derive it; the upstream spellings
(`split_model_into_stages`, `build_pipeline_schedule`, `pipeline_model`, `AutoPipeline`, `calculate_virtual_stages`,
`stage_ids_this_rank`), the schedule picture and the reference trainer plan through it. Nobody else derives a stage
count, a placement, a layer split or a microbatch rule.

What it must not do: touch torch.distributed, a model or a stage. Schedule classes are looked up through
`am_pipelining._compat` (the only module that knows torch pipelining internals).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import _compat
from ._plan_rules import (
    batch_problems,
    csv_problems,
    explicit_layer_problems,
    min_microbatches_for,
    per_rank_problems,
    place_stages,
    resolve_schedule,
    sayer,
    schedule_placement_style,
    split_layer_ranges,
    stage_count,
    stage_count_fix,
)

__all__ = [
    "PipelinePlan",
    "PipelinePlanError",
    "plan_pipeline",
    "split_layers",
    "schedule_placement_style",
    "calculate_virtual_stages",
    "stage_ids_this_rank",
    "csv_problems",
]


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
# The plan
# ------------------------------------------------------------------------------------------------------------


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
    say = sayer(values, option_labels)
    problems: list[str] = []
    schedule_class = resolve_schedule(schedule, csv, problems, say)
    problems += csv_problems(csv)
    if pp_size < 1:
        problems.append(f"{say('pp_size')}: need at least 1 pipeline rank.")
    if num_layers is not None and num_layers < 1:
        problems.append(f"{say('num_layers')}: the model has no decoder layers to split.")
    multi = _compat.is_multi_stage_schedule(schedule_class) if schedule_class is not None else None
    style = schedule_placement_style(schedule_class) if schedule_class is not None else "loop"
    count = None
    if pp_size >= 1:
        count = stage_count(
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
                fix = stage_count_fix(
                    stages_per_rank=stages_per_rank,
                    layers_per_stage=layers_per_stage,
                    num_layers=num_layers,
                    pp_size=pp_size,
                    multi=multi,
                )
                problems += per_rank_problems(
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
            found = explicit_layer_problems(stage_layers, num_layers, say)
            problems += found
            if not found:
                ranges = tuple(tuple(sorted(int(x) for x in layers)) for layers in stage_layers)
        else:
            ranges = split_layer_ranges(num_layers, count, problems)
    minimum = min_microbatches_for(schedule_class, count) if schedule_class is not None and count is not None else 1
    n_microbatches = batch_problems(local_batch_size, microbatch_size, minimum, schedule_class, count, problems, say)
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
        rank_stages=place_stages(pp_size, count, style),
        local_batch_size=local_batch_size,
        microbatch_size=microbatch_size,
        n_microbatches=n_microbatches,
        min_microbatches=minimum,
    )


def split_layers(num_layers: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """The layer indices of each of `num_stages` stages (the split every plan uses).

    Raises:
        ValueError: fewer than 1 stage, or more stages than layers.
    """
    problems: list[str] = []
    ranges = split_layer_ranges(num_layers, num_stages, problems)
    if ranges is None:
        raise ValueError(problems[0])
    return ranges


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
