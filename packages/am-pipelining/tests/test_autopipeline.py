"""AutoPipeline / PipelineConfig checks that need no process group (built pipelines are tested on real ranks in
test_pipeline_2ranks.py: `autopipeline` and `hooked-mtp` cases)."""

from __future__ import annotations

import pytest
from torch import nn

from am_pipelining import AutoPipeline, PipelineConfig


class _FakeMesh:
    mesh_dim_names = ("pp",)

    def size(self):
        return 2


def test_constructor_errors_name_the_fix():
    with pytest.raises(ValueError, match="pipeline_parallel_schedule or pipeline_parallel_schedule_csv"):
        AutoPipeline(world_mesh=_FakeMesh(), pp_schedule=None, pp_batch_size=2)
    with pytest.raises(ValueError, match="local_batch_size must be divisible by microbatch_size"):
        AutoPipeline(world_mesh=_FakeMesh(), pp_microbatch_size=3, pp_batch_size=8)
    with pytest.raises(ValueError, match="world_mesh must be provided"):
        AutoPipeline()


def test_plan_problems_are_refused_at_construction():
    """The defaults (1 microbatch) cannot feed 1F1B on 2 ranks: refused now, not at the first step."""
    with pytest.raises(ValueError, match=r"needs at least 2 microbatches .* pp_batch_size=1 / pp_microbatch_size=1"):
        AutoPipeline(world_mesh=_FakeMesh())
    with pytest.raises(ValueError, match=r"\(2 problems\)") as caught:
        AutoPipeline(
            world_mesh=_FakeMesh(), pp_schedule="gpipe", pp_batch_size=5, pp_microbatch_size=2, stages_per_rank=2
        )
    for expected in ("pp_batch_size=5 is not divisible by pp_microbatch_size=2", "exactly 1 stage per rank"):
        assert expected in str(caught.value)


def test_unbuilt_pipeline():
    pipe = AutoPipeline(world_mesh=_FakeMesh(), pp_batch_size=2)
    assert not pipe.info.enabled
    assert pipe.list_stage_modules() == []
    assert pipe.get_stage_param_counts() == []
    assert pipe.pretty_print_stages() == "<no stages>"
    with pytest.raises(RuntimeError, match="not built"):
        _ = pipe.parts
    with pytest.raises(RuntimeError, match=r"build\(\) must be called before running"):
        pipe.step(None)
    with pytest.raises(RuntimeError, match=r"before update_seq_len"):
        pipe.update_seq_len(16)
    with pytest.raises(ValueError, match="loss_fn must be provided"):
        pipe.build(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="must be a PyTorch module"):
        pipe.build("model", loss_fn=lambda o, t: o)  # type: ignore[arg-type]
    assert "PP degree: 2" in pipe.debug_summary()


def test_config_round_trip():
    config = PipelineConfig(pp_schedule="interleaved1f1b", pp_microbatch_size=2, pp_batch_size=8, pp_seq_len=128)
    data = config.to_dict()
    assert len(data) == 15  # upstream's 14 fields + stages_per_rank
    assert data["stages_per_rank"] is None
    assert data["pp_seq_len"] == 128
    assert data["pp_schedule"] == "interleaved1f1b"
    pipe = AutoPipeline.from_config(config, world_mesh=_FakeMesh())
    assert pipe.pp_microbatch_size == 2
    assert pipe.pp_batch_size == 8
    assert pipe.pp_seq_len == 128


def test_param_count_deduplicates_tied_weights():
    model = nn.Module()
    model.a = nn.Linear(4, 4, bias=False)
    model.b = nn.Linear(4, 4, bias=False)
    model.b.weight = model.a.weight
    model.c = nn.Linear(2, 2)
    model.c.requires_grad_(False)
    assert AutoPipeline._count_parameters(model) == 16 + 6
    assert AutoPipeline._count_parameters(model, trainable_only=True) == 16


def test_backward_options_are_kept_for_build():
    """Both stage-backward options are accepted (also via PipelineConfig) and kept for `build`, which passes them to
    `pipeline_model`; what they do is checked on real ranks (the fsdp2 cases of test_pipeline_4ranks.py)."""
    pipe = AutoPipeline(
        world_mesh=_FakeMesh(),
        pp_batch_size=2,
        patch_stage_backward_maybe_with_nosync=True,
        defer_fsdp_grad_sync=False,
    )
    assert pipe.patch_stage_backward_maybe_with_nosync
    assert not pipe.defer_fsdp_grad_sync
    config = PipelineConfig(pp_batch_size=2, patch_stage_backward_maybe_with_nosync=True)
    assert AutoPipeline.from_config(config, world_mesh=_FakeMesh()).patch_stage_backward_maybe_with_nosync


def test_config_loss_fn_is_used_by_build():
    """PipelineConfig.loss_fn reaches build() (it used to be dropped); two different loss functions are an error."""

    def loss_a(output, target):
        return output.sum()

    def loss_b(output, target):
        return output.sum()

    pipe = AutoPipeline.from_config(PipelineConfig(pp_batch_size=2, loss_fn=loss_a), world_mesh=_FakeMesh())
    assert pipe.loss_fn is loss_a
    with pytest.raises(ValueError, match="differ: give the loss function once"):
        pipe.build(nn.Linear(2, 2), loss_fn=loss_b)


def test_mesh_options_without_parallelize_fn_are_refused():
    """moe_mesh / cp / tp / ep axis names only reach parallelize_fn: without one they would be ignored."""
    from am_pipelining import pipeline_model

    with pytest.raises(ValueError, match=r"cp_axis_name, ep_axis_name given without a parallelize_fn"):
        pipeline_model(nn.Linear(2, 2), _FakeMesh(), cp_axis_name="cp", ep_axis_name="ep")
