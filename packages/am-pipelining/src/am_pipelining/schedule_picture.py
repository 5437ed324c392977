"""Draw a pipeline schedule: ranks × time with F/B/I/W actions per microbatch, as text, SVG or PNG.

The action order per rank comes from torch's own schedule action lists (`pipeline_order`), so the picture is of
what torch runs; when torch's list for a single-stage schedule fails a consistency check (torch 2.15's 1F1B list
numbers the last rank's forwards 1..m), the textbook order of that schedule is drawn instead and the timeline
says so. Time comes from a dependency simulation with per-action durations (default F=1, I=1, W=1, B=I+W=2) and
zero-cost communication, which gives the bubble fraction reported next to the textbook formula.

SVG is written by hand (no dependency); PNG needs matplotlib (`pip install am-pipelining[plot]`), imported
lazily. This module runs no collective and needs no process group.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import _compat
from .planning import plan_pipeline

__all__ = [
    "TimelineAction",
    "ScheduleTimeline",
    "schedule_timeline",
    "textbook_bubble_fraction",
    "render_text",
    "render_svg",
    "save_schedule_picture",
]

_DEFAULT_DURATIONS = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
_COLORS = {"F": "#4C9BE8", "B": "#F28E2B", "I": "#E15759", "W": "#59A14F"}


@dataclass(frozen=True)
class TimelineAction:
    rank: int
    stage: int
    kind: str
    microbatch: int
    start: float
    duration: float


@dataclass
class ScheduleTimeline:
    """A simulated schedule: actions with start times, makespan, and measured vs textbook bubble fraction."""

    schedule_name: str
    pp_size: int
    n_microbatches: int
    stages_per_rank: int
    actions: list[TimelineAction]
    makespan: float
    bubble_fraction: float
    textbook_bubble_fraction: float | None
    textbook_formula: str
    source: str
    durations: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        textbook = "n/a" if self.textbook_bubble_fraction is None else f"{self.textbook_bubble_fraction:.4f}"
        return (
            f"{self.schedule_name}: p={self.pp_size} m={self.n_microbatches} v={self.stages_per_rank} "
            f"bubble={self.bubble_fraction:.4f} textbook={textbook} ({self.textbook_formula}); order from {self.source}"
        )


def textbook_bubble_fraction(
    schedule_name: str, *, p: int, m: int, v: int = 1, durations: Mapping[str, float] | None = None
) -> tuple[float | None, str]:
    """(bubble fraction, formula) from the literature for a schedule, None where no closed form applies.

    GPipe / 1F1B: (p−1)/(m+p−1). Interleaved1F1B / LoopedBFS: (p−1)/(v·m+p−1). InterleavedZeroBubble (ZB-H1):
    bubble time (p−1)(T_F+T_B−T_W). ZBVZeroBubble (ZB-V): (p−1)(T_F+T_B−2T_W), zero when the three are equal.
    For the zero-bubble ones the fraction is bubble / (bubble + v·m·(T_F+T_B+T_W)) with T_B the input-gradient time.
    """
    d = {**_DEFAULT_DURATIONS, **(durations or {})}
    name = schedule_name.lower()
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if name in ("interleaved1f1b", "loopedbfs"):
        return (p - 1) / (v * m + p - 1), "(p-1)/(v·m+p-1)"
    work = v * m * (d["F"] + d["I"] + d["W"])
    if name == "interleavedzerobubble":
        bubble = (p - 1) * (d["F"] + d["I"] - d["W"])
        return bubble / (bubble + work), "ZB-H1: (p-1)(T_F+T_B-T_W) / total"
    if name == "zbvzerobubble":
        bubble = max(0.0, (p - 1) * (d["F"] + d["I"] - 2 * d["W"]))
        return bubble / (bubble + work), "ZB-V: (p-1)(T_F+T_B-2T_W) / total"
    return None, "no closed-form textbook formula"


def _textbook_order(name: str, pp_size: int, m: int) -> dict[int, list[_compat.ComputeAction]]:
    order: dict[int, list[_compat.ComputeAction]] = {}
    for rank in range(pp_size):
        if name == "gpipe":
            order[rank] = [(rank, "F", i) for i in range(m)] + [(rank, "B", i) for i in range(m)]
            continue
        warmup = min(pp_size - 1 - rank, m)
        steady = [action for i in range(m - warmup) for action in ((rank, "F", warmup + i), (rank, "B", i))]
        cooldown = [(rank, "B", i) for i in range(m - warmup, m)]
        order[rank] = [(rank, "F", i) for i in range(warmup)] + steady + cooldown
    return order


def _consistency_problem(
    order: Mapping[int, list[_compat.ComputeAction]], stage_to_rank: Mapping[int, int], num_stages: int, m: int
) -> str | None:
    seen: dict[tuple[int, str, int], int] = {}
    for rank, actions in order.items():
        for stage, kind, mb in actions:
            if stage_to_rank.get(stage) != rank:
                return f"stage {stage} scheduled on rank {rank}, placed on rank {stage_to_rank.get(stage)}"
            seen[(stage, kind, mb)] = seen.get((stage, kind, mb), 0) + 1
    for stage in range(num_stages):
        for mb in range(m):
            if seen.get((stage, "F", mb)) != 1:
                return f"forward of stage {stage} microbatch {mb} appears {seen.get((stage, 'F', mb), 0)} times"
            full, split = seen.get((stage, "B", mb), 0), (seen.get((stage, "I", mb), 0), seen.get((stage, "W", mb), 0))
            if not (full == 1 and split == (0, 0)) and not (full == 0 and split == (1, 1)):
                return f"backward of stage {stage} microbatch {mb} is incomplete or repeated"
    return None


def _simulate(
    order: Mapping[int, list[_compat.ComputeAction]], num_stages: int, durations: Mapping[str, float]
) -> list[TimelineAction]:
    finish: dict[tuple[str, int, int], float] = {}
    clocks = dict.fromkeys(order, 0.0)
    cursor = dict.fromkeys(order, 0)
    placed: list[TimelineAction] = []
    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while cursor[rank] < len(actions):
                stage, kind, mb = actions[cursor[rank]]
                deps: list[tuple[str, int, int]] = []
                if kind == "F" and stage > 0:
                    deps.append(("F", stage - 1, mb))
                if kind in ("B", "I"):
                    deps.append(("F", stage, mb))
                    if stage < num_stages - 1:
                        deps.append(("G", stage + 1, mb))
                if kind == "W":
                    deps.append(("G", stage, mb))
                if any(dep not in finish for dep in deps):
                    break
                start = max([clocks[rank], *(finish[dep] for dep in deps)])
                duration = float(durations[kind])
                end = start + duration
                finish[(kind, stage, mb)] = end
                if kind in ("B", "I"):
                    finish[("G", stage, mb)] = end
                placed.append(TimelineAction(rank, stage, kind, mb, start, duration))
                clocks[rank] = end
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: order[r][cursor[r]] for r in order if cursor[r] < len(order[r])}
            raise ValueError(f"Schedule cannot progress (deadlock); next action per rank: {stuck}")
    return placed


def schedule_timeline(
    schedule: Any,
    *,
    pp_size: int | None = None,
    n_microbatches: int | None = None,
    stages_per_rank: int | None = None,
    durations: Mapping[str, float] | None = None,
) -> ScheduleTimeline:
    """Simulate a schedule (a name like "1F1B", a torch schedule class, or a built schedule instance).

    For a name or class give `pp_size` and `n_microbatches` (and `stages_per_rank`, default 1 for single-stage
    schedules and 2 for multi-stage ones). A built schedule supplies its own sizes and stage placement.

    Raises:
        ValueError: missing sizes, or an action list that cannot progress.
    """
    built = not isinstance(schedule, (str, type))
    schedule_class = (
        type(schedule) if built else (_compat.get_schedule_class(schedule) if isinstance(schedule, str) else schedule)
    )
    name = _compat.schedule_class_name(schedule_class)
    multi = _compat.is_multi_stage_schedule(schedule_class)
    if built:
        stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
        first = stages[0]
        pp_size = pp_size or first.group_size
        n_microbatches = n_microbatches or schedule._n_microbatches
        stages_per_rank = stages_per_rank or (first.num_stages // pp_size)
    if pp_size is None or n_microbatches is None:
        raise ValueError("schedule_timeline needs pp_size and n_microbatches for a schedule name or class.")
    plan = plan_pipeline(None, pp_size, schedule_class, stages_per_rank=stages_per_rank)
    stages_per_rank, num_stages = plan.stages_per_rank, plan.num_stages
    d = {**_DEFAULT_DURATIONS, **(durations or {})}
    mapping = _compat.schedule_stage_to_rank(schedule) if built and multi else None
    if mapping is None:
        mapping = {s: plan.rank_of_stage(s) for s in range(num_stages)}
    order = _compat.schedule_compute_actions(
        schedule, pp_size=pp_size, n_microbatches=n_microbatches, stages_per_rank=stages_per_rank
    )
    source = "torch pipeline_order"
    problem = _consistency_problem(order, mapping, num_stages, n_microbatches) if order else "torch gave no list"
    if problem is not None:
        if name.lower() not in ("gpipe", "1f1b"):
            raise ValueError(f"torch's action list for {name} is unusable ({problem}) and no textbook order exists.")
        order = _textbook_order(name.lower(), pp_size, n_microbatches)
        source = f"textbook order (torch's list rejected: {problem})"
    actions = _simulate(order, num_stages, d)
    makespan = max(a.start + a.duration for a in actions)
    busy = sum(a.duration for a in actions)
    textbook, formula = textbook_bubble_fraction(name, p=pp_size, m=n_microbatches, v=stages_per_rank, durations=d)
    return ScheduleTimeline(
        schedule_name=name,
        pp_size=pp_size,
        n_microbatches=n_microbatches,
        stages_per_rank=stages_per_rank,
        actions=sorted(actions, key=lambda a: (a.rank, a.start)),
        makespan=makespan,
        bubble_fraction=1.0 - busy / (pp_size * makespan),
        textbook_bubble_fraction=textbook,
        textbook_formula=formula,
        source=source,
        durations=d,
    )


def _label(action: TimelineAction, multi: bool) -> str:
    return f"{action.kind}{action.microbatch}" + (f"s{action.stage}" if multi else "")


def render_text(timeline: ScheduleTimeline) -> str:
    """Rank rows of fixed-width cells, one per unit of time; idle cells show '.'; summary line last."""
    multi = timeline.stages_per_rank > 1
    width = max(len(_label(a, multi)) for a in timeline.actions) + 1
    steps = round(timeline.makespan)
    lines = []
    for rank in range(timeline.pp_size):
        cells = [".".ljust(width)] * steps
        for action in (a for a in timeline.actions if a.rank == rank):
            for t in range(round(action.start), round(action.start + action.duration)):
                cells[t] = _label(action, multi).ljust(width)
        lines.append(f"rank {rank}: " + "".join(cells).rstrip())
    lines.append(timeline.summary())
    return "\n".join(lines)


def render_svg(timeline: ScheduleTimeline, *, unit: int = 28, row: int = 30) -> str:
    """A standalone SVG document of the timeline (boxes colored by F/B/I/W, labeled with the microbatch)."""
    multi = timeline.stages_per_rank > 1
    left, top = 70, 30
    width = left + int(timeline.makespan * unit) + 20
    height = top + timeline.pp_size * row + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
        'font-size="11">',
        f'<text x="{left}" y="18">{html.escape(timeline.summary(), quote=False)}</text>',
    ]
    for rank in range(timeline.pp_size):
        y = top + rank * row
        parts.append(f'<text x="4" y="{y + row // 2 + 4}">rank {rank}</text>')
    for a in timeline.actions:
        x = left + a.start * unit
        y = top + a.rank * row
        parts.append(
            f'<rect x="{x:.1f}" y="{y + 2}" width="{a.duration * unit - 1:.1f}" height="{row - 4}" '
            f'fill="{_COLORS.get(a.kind, "#999999")}" stroke="#333333"><title>{_label(a, True)}</title></rect>'
        )
        parts.append(f'<text x="{x + 3:.1f}" y="{y + row // 2 + 4}">{_label(a, multi)}</text>')  # "F3s1": no markup
    parts.append("</svg>")
    return "\n".join(parts)


def save_schedule_picture(timeline: ScheduleTimeline, path: str | os.PathLike[str]) -> str:
    """Write the timeline to `path`: `.svg` (no dependency), `.png` (matplotlib), anything else as text.

    Raises:
        ImportError: `.png` without matplotlib installed (install the `plot` extra).
    """
    path = os.fspath(path)
    if path.endswith(".svg"):
        content = render_svg(timeline)
    elif path.endswith(".png"):
        _save_png(timeline, path)
        return path
    else:
        content = render_text(timeline) + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)
    return path


def _save_png(timeline: ScheduleTimeline, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "Saving a schedule picture as PNG needs matplotlib: `pip install am-pipelining[plot]` "
            "(or save as .svg / .txt, which need nothing)."
        ) from error
    multi = timeline.stages_per_rank > 1
    fig, ax = plt.subplots(figsize=(max(6.0, timeline.makespan * 0.35), 0.6 * timeline.pp_size + 1.2))
    for a in timeline.actions:
        ax.broken_barh([(a.start, a.duration)], (a.rank - 0.4, 0.8), facecolors=_COLORS.get(a.kind, "#999999"))
        ax.text(a.start + a.duration / 2, a.rank, _label(a, multi), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(timeline.pp_size))
    ax.set_yticklabels([f"rank {r}" for r in range(timeline.pp_size)])
    ax.invert_yaxis()
    ax.set_xlabel("time (action units)")
    ax.set_title(timeline.summary(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
