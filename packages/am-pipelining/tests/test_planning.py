"""`plan_pipeline`: the one function that decides stage counts, layer splits, placement and microbatches.

Contract: a request either yields exactly the layout asked for, or ONE `PipelinePlanError` naming every problem.
No process group and no model are needed.
"""

from __future__ import annotations

import json

import pytest

from am_pipelining import PipelinePlan, PipelinePlanError, plan_pipeline
from am_pipelining._compat import get_schedule_class, runtime_schedule_class
from am_pipelining.planning import calculate_virtual_stages, schedule_placement_style, split_layers, stage_ids_this_rank


def test_explicit_stages_per_rank_runs_exactly_that_many_stages():
    """8 layers, pp=2, 3 stages per rank: 6 stages (the old layers-per-stage round trip made it 4)."""
    plan = plan_pipeline(8, 2, "Interleaved1F1B", stages_per_rank=3, local_batch_size=4, microbatch_size=1)
    assert plan.num_stages == 6
    assert plan.stages_per_rank == 3
    assert plan.layers_per_stage == (2, 2, 1, 1, 1, 1)
    assert plan.stage_layers == ((0, 1), (2, 3), (4,), (5,), (6,), (7,))
    assert plan.rank_stages == ((0, 2, 4), (1, 3, 5))
    assert plan.stage_ids(1) == (1, 3, 5)
    assert [plan.rank_of_stage(s) for s in range(6)] == [0, 1, 0, 1, 0, 1]
    assert plan.n_microbatches == 4
    assert plan.placement == "loop"
    assert plan.multi_stage


def test_uneven_split_gives_the_first_stages_one_more_layer():
    plan = plan_pipeline(5, 2, "1F1B")
    assert plan.layers_per_stage == (3, 2)
    assert plan.stage_layers == ((0, 1, 2), (3, 4))
    assert split_layers(10, 3) == ((0, 1, 2, 3), (4, 5, 6), (7, 8, 9))
    assert plan_pipeline(7, 2, "GPipe").layers_per_stage == (4, 3)


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_v_placement(name):
    plan = plan_pipeline(8, 4, name, local_batch_size=8, microbatch_size=1)
    assert plan.placement == "v"
    assert plan.stages_per_rank == 2
    assert plan.rank_stages == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert plan.rank_of_stage(6) == 1


def test_default_stage_counts_follow_the_schedule_kind():
    assert plan_pipeline(8, 2, "gpipe").num_stages == 2
    assert plan_pipeline(8, 2, "1f1b").schedule == "1F1B"
    assert plan_pipeline(8, 2, "interleaved1f1b").num_stages == 4
    assert plan_pipeline(8, 2, get_schedule_class("LoopedBFS")).num_stages == 4


def test_layers_per_stage_keeps_its_upstream_meaning():
    """ceil(L / k) stages, rounded to a multiple of pp when asked; the layers are then split evenly."""
    plan = plan_pipeline(32, 4, "Interleaved1F1B", layers_per_stage=5, round_to_pp_multiple="up")
    assert plan.num_stages == 8
    assert plan.layers_per_stage == (4,) * 8
    assert plan_pipeline(32, 4, "Interleaved1F1B", layers_per_stage=3, round_to_pp_multiple="down").num_stages == 8
    assert calculate_virtual_stages(32, 32, 4, True, "up") == (4, 1)
    assert calculate_virtual_stages(32, 4, 4, False) == (8, 2)


def test_csv_schedules_plan_with_loop_placement(tmp_path):
    csv = tmp_path / "schedule.csv"
    csv.write_text("0F0,0B0\n1F0,1B0\n")
    plan = plan_pipeline(8, 2, None, csv=csv, local_batch_size=4, microbatch_size=1)
    assert plan.schedule_class is runtime_schedule_class()
    assert plan.csv == str(csv)
    assert (plan.placement, plan.num_stages, plan.rank_stages) == ("loop", 4, ((0, 2), (1, 3)))
    named = plan_pipeline(8, 2, "Interleaved1F1B", csv=csv)
    assert named.schedule == "Interleaved1F1B"  # the name still decides stages per rank and placement
    with pytest.raises(PipelinePlanError, match="does not exist or is not a file"):
        plan_pipeline(8, 2, None, csv=tmp_path / "missing.csv")
    # The runtime schedule runs what the file lists, one stage per rank included (stages built for 1F1B, as
    # NeMo AutoModel's build_pipeline_schedule(csv, None, ...) takes them).
    one = plan_pipeline(
        8, 2, None, csv=csv, stage_layers=[[0, 1, 2, 3], [4, 5, 6, 7]], local_batch_size=4, microbatch_size=1
    )
    assert (one.schedule_class, one.stages_per_rank, one.rank_stages) == (runtime_schedule_class(), 1, ((0,), (1,)))


def test_planning_without_a_model_or_a_batch():
    plan = plan_pipeline(None, 2, "1F1B")
    assert (plan.num_layers, plan.layers_per_stage, plan.stage_layers) == (None, None, None)
    assert plan.n_microbatches is None
    assert plan.rank_stages == ((0,), (1,))
    with pytest.raises(PipelinePlanError, match="needs the model's number of layers"):
        plan_pipeline(None, 2, "Interleaved1F1B", layers_per_stage=2)


REJECTED = [
    (dict(num_layers=8, pp_size=2, schedule="ZeroBubbleFantasy"), "schedule='ZeroBubbleFantasy' is unknown"),
    (dict(num_layers=8, pp_size=2, schedule=None), "pipeline_parallel_schedule or pipeline_parallel_schedule_csv"),
    (dict(num_layers=8, pp_size=4, schedule="Interleaved1F1B", num_stages=6), "must be evenly divisible"),
    (dict(num_layers=8, pp_size=2, schedule="1F1B", stages_per_rank=2), "requires exactly 1 stage per rank"),
    (dict(num_layers=8, pp_size=2, schedule="Interleaved1F1B", stages_per_rank=1), "at least 2 stages per rank"),
    (dict(num_layers=12, pp_size=2, schedule="ZBVZeroBubble", stages_per_rank=3), "needs exactly 2 stages per rank"),
    (dict(num_layers=3, pp_size=2, schedule="Interleaved1F1B"), "cannot exceed number of layers (3)"),
    (dict(num_layers=8, pp_size=2, schedule="1F1B", stages_per_rank=0), "at least 1 stage"),
    (dict(num_layers=8, pp_size=0, schedule="1F1B"), "at least 1 pipeline rank"),
    (dict(num_layers=0, pp_size=2, schedule="1F1B"), "no decoder layers"),
    (dict(num_layers=32, pp_size=4, schedule="Interleaved1F1B", layers_per_stage=5), "divisible by pipeline parallel"),
    (
        dict(num_layers=32, pp_size=4, schedule="Interleaved1F1B", layers_per_stage=5, round_to_pp_multiple="side"),
        "Use 'up' or 'down'",
    ),
    (dict(num_layers=8, pp_size=2, schedule="1F1B", round_to_pp_multiple="up"), "only rounds the stage count"),
    (dict(num_layers=8, pp_size=2, schedule="1F1B", layers_per_stage=0), "must be >= 1"),
    (
        dict(num_layers=8, pp_size=2, schedule="Interleaved1F1B", stages_per_rank=2, layers_per_stage=2),
        "give only one of them",
    ),
    (dict(num_layers=8, pp_size=2, schedule="1F1B", local_batch_size=5, microbatch_size=2), "is not divisible by"),
    (dict(num_layers=8, pp_size=2, schedule="1F1B", local_batch_size=4), "given alone"),
    (dict(num_layers=8, pp_size=2, schedule="1F1B", local_batch_size=4, microbatch_size=0), "must be >= 1"),
    (
        dict(num_layers=8, pp_size=4, schedule="1F1B", local_batch_size=3, microbatch_size=1),
        "needs at least 4 microbatches for 4 stages",
    ),
    (
        dict(num_layers=8, pp_size=2, schedule="DualPipeV", local_batch_size=3, microbatch_size=1),
        "needs at least 4 microbatches",
    ),
    (dict(num_layers=4, pp_size=2, schedule="1F1B", stage_layers=[[0, 1], [3]]), "leaves out layers [2]"),
    (dict(num_layers=4, pp_size=2, schedule="1F1B", stage_layers=[[0, 1, 2], [2, 3]]), "layer 2 in stages [0, 1]"),
    (dict(num_layers=4, pp_size=2, schedule="1F1B", stage_layers=[[2, 3], [0, 1]]), "out of order"),
    (dict(num_layers=4, pp_size=2, schedule="1F1B", stage_layers=[[0, 1], [2, 3, 7]]), "names layers [7]"),
]


@pytest.mark.parametrize(("request_", "expected"), REJECTED, ids=[e for _, e in REJECTED])
def test_every_rejected_request_names_its_problem(request_, expected):
    args = (request_.pop("num_layers"), request_.pop("pp_size"), request_.pop("schedule"))
    with pytest.raises(PipelinePlanError) as caught:
        plan_pipeline(*args, **request_)
    assert expected in str(caught.value), str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_several_problems_are_named_in_one_message():
    with pytest.raises(PipelinePlanError) as caught:
        plan_pipeline(3, 2, "1F1B", stages_per_rank=2, local_batch_size=5, microbatch_size=2)
    message = str(caught.value)
    assert message.startswith("Pipeline configuration refused (3 problems):")
    assert len(caught.value.problems) == 3
    for expected in ("requires exactly 1 stage per rank", "cannot exceed number of layers (3)", "not divisible by"):
        assert expected in message, message
    with pytest.raises(PipelinePlanError) as caught:
        plan_pipeline(8, 2, "NoSuchSchedule", round_to_pp_multiple="up", local_batch_size=3, microbatch_size=2)
    assert len(caught.value.problems) == 3, caught.value.problems


def test_option_labels_speak_the_callers_language():
    labels = {"stages_per_rank": "--stages-per-rank 2", "local_batch_size": "the batch (8 / 2 = 4)"}
    with pytest.raises(PipelinePlanError) as caught:
        plan_pipeline(8, 2, "1F1B", stages_per_rank=2, local_batch_size=4, microbatch_size=3, option_labels=labels)
    assert "the batch (8 / 2 = 4) is not divisible by microbatch_size=3" in str(caught.value)
    assert "Use stages_per_rank=1" in str(caught.value)


def test_plan_is_frozen_and_its_layout_is_json():
    plan = plan_pipeline(6, 2, "Interleaved1F1B", local_batch_size=4, microbatch_size=2)
    assert isinstance(plan, PipelinePlan)
    with pytest.raises(AttributeError):
        plan.num_stages = 3  # type: ignore[misc]
    layout = json.loads(json.dumps(plan.layout()))
    assert layout["stages"] == 4
    assert layout["layers_per_stage"] == [2, 2, 1, 1]
    assert layout["microbatches"] == 2
    assert layout["rank_stages"] == [[0, 2], [1, 3]]


def test_upstream_wrappers_answer_from_the_plan():
    assert stage_ids_this_rank(1, 4, 8, "loop") == (1, 5)
    assert stage_ids_this_rank(3, 4, 8, "v") == (3, 4)
    with pytest.raises(ValueError, match="Unknown stage placement style"):
        stage_ids_this_rank(0, 2, 4, "zigzag")


def test_stage_ids_loop_and_v():
    assert stage_ids_this_rank(1, 4, 8, "loop") == (1, 5)
    assert stage_ids_this_rank(0, 2, 2) == (0,)
    assert stage_ids_this_rank(0, 4, 8, "v") == (0, 7)
    assert stage_ids_this_rank(3, 4, 8, "v") == (3, 4)
    with pytest.raises(ValueError, match="evenly divisible"):
        stage_ids_this_rank(0, 4, 5)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        stage_ids_this_rank(0, 2, 6, "v")


@pytest.mark.parametrize(
    ("name", "style"),
    [
        ("ZBVZeroBubble", "v"),
        ("DualPipeV", "v"),
        ("1F1B", "loop"),
        ("Interleaved1F1B", "loop"),
        ("InterleavedZeroBubble", "loop"),
    ],
)
def test_v_placement_for_every_v_shaped_schedule(name, style):
    assert schedule_placement_style(get_schedule_class(name)) == style


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((32, 32, 4, True, "up"), (4, 1)),
        ((32, 4, 4, False, None), (8, 2)),
        ((32, 5, 4, False, "up"), (8, 2)),
        ((32, 3, 4, False, "down"), (8, 2)),
        ((32, None, 4, True, None), (4, 1)),
        ((32, None, 4, False, None), (8, 2)),
    ],
)
def test_virtual_stages(args, expected):
    assert calculate_virtual_stages(*args) == expected


def test_virtual_stage_errors():
    with pytest.raises(ValueError, match="exactly 1 stage per rank"):
        calculate_virtual_stages(32, 6, 4, True, "up")
    with pytest.raises(ValueError, match="at least 2 stages per rank"):
        calculate_virtual_stages(32, 16, 2, False)
    with pytest.raises(ValueError, match="must be divisible by pipeline parallel size"):
        calculate_virtual_stages(32, 5, 4, False)
    with pytest.raises(ValueError, match="Use 'up' or 'down'"):
        calculate_virtual_stages(32, 5, 4, False, "sideways")
