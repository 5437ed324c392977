"""The seed API called exactly as NeMo AutoModel documents it (`pipelining/{hf_utils,functional,autopipeline}`,
`loss/mtp`), from where it lives here (the package root; upstream's private helper names in
`am_pipelining.upstream`): positional order, parameter names, defaults, module attributes and error-message key
phrases. Also: the root exports one name per object, and `build_schedule` trusts its plan.

Single process on tiny HF models. The calls that need ranks (`split_model_into_stages`, `build_pipeline_schedule`,
`reset_pp_stage_shapes`, `scale_grads_by_divisor`) run positionally in the 2/4-rank modules (`_cases.py`).
"""

from __future__ import annotations

import ast
import inspect
import logging
import pathlib
import types

import _models as M
import pytest
import torch
from torch import nn

import am_pipelining
from am_pipelining import (
    AutoPipeline,
    MTPLossConfig,
    PipelineCausalLMLoss,
    PipelineConfig,
    calculate_mtp_loss,
    calculate_virtual_stages,
    create_pipeline_forward_causal_lm,
    create_pipeline_forward_inner,
    generate_hf_model_fqn_per_model_part,
    get_mtp_loss_scaling_factor,
    get_text_module,
    hf_utils,
    init_hf_model_buffers,
    model_keeps_self_forward,
    patch_hf_model_for_pp,
    roll_tensor,
    shift_packed_tensor,
    stage_ids_this_rank,
    upstream,
    validate_hf_model_for_pipeline_support,
)
from am_testing import root_api_problems

IGN = -100


def _sum_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum")


def test_hf_utils_module_attributes():
    assert isinstance(hf_utils.logger, logging.Logger)
    assert hf_utils.TEXT_MODULE_ATTRS == ("language_model", "text_model", "text_decoder")
    assert len(hf_utils.MULTIMODAL_SUFFIXES) == 15
    assert {"vision_tower", "multi_modal_projector", "audio_projector"} <= set(hf_utils.MULTIMODAL_SUFFIXES)


def test_functional_names_at_the_root():
    seed = "stage_ids_this_rank generate_hf_model_fqn_per_model_part calculate_virtual_stages split_model_into_stages"
    seed += " build_pipeline_schedule pipeline_model reset_pp_stage_shapes scale_grads_by_divisor ParallelizeFnProtocol"
    assert set(seed.split()) <= set(am_pipelining.__all__)


def test_root_exports_one_public_name_per_object():
    """No aliases at the root (two names bound to one object) and no private names in `__all__`."""
    assert root_api_problems(am_pipelining) == []


def test_core_never_imports_upstream():
    """`am_pipelining.upstream` is built on the core; no other module of the package imports it."""
    package = pathlib.Path(am_pipelining.__file__).parent
    importers = [
        path.name
        for path in package.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.level == 1
        and (node.module == "upstream" or any(alias.name == "upstream" for alias in node.names))
    ]
    assert importers == []


def test_pipeline_model_accepts_upstream_keywords():
    params = inspect.signature(am_pipelining.pipeline_model).parameters
    upstream = [
        "model",
        "world_mesh",
        "moe_mesh",
        "pp_axis_name",
        "dp_axis_names",
        "cp_axis_name",
        "tp_axis_name",
        "ep_axis_name",
        "ep_shard_axis_names",
        "layers_per_stage",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_schedule",
        "microbatch_size",
        "local_batch_size",
        "device",
        "loss_fn",
        "parallelize_fn",
        "module_fqns_per_model_part",
        "patch_inner_model",
        "patch_causal_lm_model",
        "scale_grads",
        "round_to_pp_multiple",
        "patch_stage_backward_maybe_with_nosync",
        "reduce_grad_per_microbatch",
        "seq_len",
        "tensor_dtype",
    ]
    assert set(upstream) <= set(params)
    assert list(params)[:3] == ["model", "world_mesh", "moe_mesh"]


def test_get_text_module():
    assert get_text_module(None) is None
    holder = nn.Module()
    holder.language_model = None
    holder.text_model = nn.Linear(1, 1)
    assert get_text_module(holder) is holder.text_model
    bare = nn.Linear(1, 1)
    assert get_text_module(bare) is bare


def test_patch_hf_model_for_pp_positional_flags():
    model = M.llama(2)
    data = M.batch("llama", 2)
    expected = model(input_ids=data["input_ids"]).logits
    patch_hf_model_for_pp(model, True, True)
    assert model.forward.__func__.__name__ == "pipeline_forward_causal_lm"
    assert model.model.forward.__func__.__name__ == "pipeline_forward"
    torch.testing.assert_close(model(data["input_ids"]), expected)

    only_outer = M.llama(2)
    inner_forward = only_outer.model.forward
    patch_hf_model_for_pp(only_outer, False, True)
    assert only_outer.model.forward == inner_forward
    assert only_outer.forward.__func__.__name__ == "pipeline_forward_causal_lm"
    assert model_keeps_self_forward(model) is False


def test_forward_factories_bind_like_upstream():
    model = M.llama(2)
    data = M.batch("llama", 2)
    expected = model(input_ids=data["input_ids"]).logits
    model.model.forward = types.MethodType(create_pipeline_forward_inner("PipelineStage"), model.model)
    model.forward = types.MethodType(create_pipeline_forward_causal_lm(), model)
    torch.testing.assert_close(model(data["input_ids"]), expected)
    inner = M.llama(2).model
    inner.forward = types.MethodType(create_pipeline_forward_inner(), inner)  # default "AutoModel"
    out = inner(data["input_ids"])
    assert out.last_hidden_state.shape == (2, M.SEQ, 16)
    with pytest.raises(ValueError, match="You must provide either input_ids or inputs_embeds"):
        inner()


def test_init_hf_model_buffers_rebuilds_inv_freq():
    model = M.llama(2)
    rotary = model.model.rotary_emb
    expected = rotary.inv_freq.clone()
    rotary.inv_freq.zero_()
    init_hf_model_buffers(model, "cpu")
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected)


def test_validate_keeps_upstream_key_phrases():
    model = M.llama(2)
    validate_hf_model_for_pipeline_support(model)  # a plain decoder passes
    model.config.is_encoder_decoder = True
    with pytest.raises(ValueError, match="is not compatible with pipeline parallelism") as err:
        validate_hf_model_for_pipeline_support(model)
    assert "1. Encoder-Decoder models with cross-attention are not supported" in str(err.value)


def test_planning_functions_positional():
    assert stage_ids_this_rank(1, 4, 8) == (1, 5)
    assert stage_ids_this_rank(0, 4, 8, "v") == (0, 7)
    assert stage_ids_this_rank(3, 4, 8, "v") == (3, 4)
    stages = generate_hf_model_fqn_per_model_part(3, 10, True, True, True, False, None, "model.", "lm_head")
    assert [sum(n.startswith("model.layers.") for n in s) for s in stages] == [4, 3, 3]
    assert stages[0][0] == "model.embed_tokens"
    assert stages[-1][-3:] == ["model.norm", "lm_head", "model.rotary_emb"]
    assert calculate_virtual_stages(32, 32, 4, True, "up") == (4, 1)
    assert calculate_virtual_stages(32, 5, 4, False, "up") == (8, 2)
    assert calculate_virtual_stages(32, 3, 4, False, "down") == (8, 2)
    with pytest.raises(ValueError, match="Number of stages must be at least 1"):
        generate_hf_model_fqn_per_model_part(0, 4)


def test_pipeline_config_and_autopipeline_constructor():
    config = PipelineConfig()
    assert config.pp_schedule == "1f1b"
    assert config.pp_microbatch_size == 1
    assert config.pp_seq_len is None
    upstream_keys = {
        "pp_schedule",
        "pp_schedule_csv",
        "pp_microbatch_size",
        "pp_batch_size",
        "layers_per_stage",
        "round_virtual_stages_to_pp_multiple",
        "module_fqns_per_model_part",
        "patch_inner_model",
        "patch_causal_lm_model",
        "patch_stage_backward_maybe_with_nosync",
        "dtype",
        "scale_grads_in_schedule",
        "loss_fn",
        "pp_seq_len",
    }
    assert upstream_keys <= set(config.to_dict())
    upstream_order = list(inspect.signature(AutoPipeline).parameters)[:23]
    assert upstream_order[:4] == ["world_mesh", "moe_mesh", "pp_axis_name", "dp_axis_names"]
    assert upstream_order[-1] == "pp_seq_len"
    mesh = types.SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 0, mesh_dim_names=None)
    with pytest.raises(ValueError, match="Either pipeline_parallel_schedule or pipeline_parallel_schedule_csv"):
        AutoPipeline(mesh, pp_schedule=None)
    with pytest.raises(ValueError, match="local_batch_size must be divisible by microbatch_size"):
        AutoPipeline(mesh, pp_microbatch_size=3, pp_batch_size=4)
    pipe = AutoPipeline(mesh, None, "pp", ("dp",), pp_schedule="1f1b", pp_microbatch_size=1, pp_batch_size=4)
    with pytest.raises(RuntimeError, match="Autopipeline not built"):
        _ = pipe.parts
    with pytest.raises(RuntimeError, match=r"AutoPipeline\.build\(\) must be called before update_seq_len"):
        pipe.update_seq_len(8)
    with pytest.raises(ValueError, match="world_mesh must be provided"):
        AutoPipeline()


def test_mtp_helpers_as_documented():
    t = torch.tensor([[10, 11, 12, 13]])
    assert roll_tensor(t).tolist() == [[11, 12, 13, 0]]
    assert roll_tensor(t, 1, -1).tolist() == [[0, 10, 11, 12]]
    seq_idx = torch.tensor([[0, 0, 1, 1]])
    assert shift_packed_tensor(t, depth=1, seq_idx=seq_idx, fill_value=-1).tolist() == [[11, -1, 13, -1]]

    labels = torch.arange(1, 9).unsqueeze(0)
    captured = []

    def capture(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        captured.append(targets.clone())
        return logits.sum() * 0

    calculate_mtp_loss(
        capture,
        mtp_per_depth_logits=[torch.zeros(1, 8, 4)] * 2,
        labels=labels,
        seq_idx=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]),
    )
    assert captured[0].tolist() == [[2, 3, 4, IGN, 6, 7, 8, IGN]]
    assert captured[1].tolist() == [[3, 4, IGN, IGN, 7, 8, IGN, IGN]]


def test_pipeline_causal_lm_loss_positional():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 7, bias=False)
            self.mtp_config = types.SimpleNamespace(loss_scaling_factor=0.5)

    model = Model()
    assert get_mtp_loss_scaling_factor(model) == 0.5
    assert get_mtp_loss_scaling_factor(nn.Module(), 0.2) == 0.2
    logits, h1 = torch.randn(2, 5, 7), torch.randn(2, 5, 4)
    labels = torch.randint(0, 7, (2, 5))
    loss = PipelineCausalLMLoss(_sum_ce, model, 2.0, -100, None)  # (loss_fn, model, scaling, ignore, group)
    expected = _sum_ce(logits, labels) + calculate_mtp_loss(
        _sum_ce, mtp_per_depth_h=[h1], labels=labels, model=model, scaling_factor=2.0
    )
    torch.testing.assert_close(loss((logits, h1), labels), expected)
    built = MTPLossConfig(2.0, -100).build(_sum_ce, model)
    torch.testing.assert_close(built((logits, h1), labels), expected)


@pytest.fixture
def one_rank_group(tmp_path):
    """A real 1-rank gloo group: `PipelineStage` reads its rank from the default group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_private_stage_metadata_helpers_under_upstream_names():
    from torch.distributed.pipelining import PipelineStage

    model = M.llama(2)
    names = [["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb", "lm_head"]]
    (stage_model,) = am_pipelining.build_stage_modules(model, names, [0])
    stage = PipelineStage(stage_model, 0, 1, torch.device("cpu"))

    upstream._precompute_stage_shapes([stage], model.config, 2, 8)  # (stages, model_config, microbatch_size, seq_len)
    assert [tuple(t.shape) for t in stage._user_meta.inputs] == [(2, 8)]
    assert [tuple(t.shape) for t in stage._user_meta.outputs] == [(2, 8, model.config.vocab_size)]
    assert stage._user_meta.outputs[0].dtype == torch.float32

    meta = torch.device("meta")
    inputs = (torch.empty(3, 5, dtype=torch.long, device=meta),)
    outputs = (torch.empty(3, 5, model.config.vocab_size, device=meta, requires_grad=True),)
    upstream._set_stage_metas(stage, inputs, outputs)
    assert [tuple(t.shape) for t in stage._user_meta.inputs] == [(3, 5)]
    assert [tuple(t.shape) for t in stage._user_meta.outputs] == [(3, 5, model.config.vocab_size)]
    with pytest.raises(RuntimeError, match="Unsupported PipelineStage metadata API"):
        upstream._set_stage_metas(types.SimpleNamespace(), inputs, outputs)

    # stages without the hook are skipped
    upstream._preserve_grads_across_stage_reinit([stage, types.SimpleNamespace()])
    wrapped = stage._post_metadata_inference_cleanup
    assert wrapped._am_pp_preserves_grads
    upstream._preserve_grads_across_stage_reinit([stage])
    assert stage._post_metadata_inference_cleanup is wrapped  # idempotent

    assert upstream._get_hidden_and_vocab_size(model.config) == (model.config.hidden_size, model.config.vocab_size)
    hooks = dict(stage_model._forward_hooks)
    assert hooks  # build_stage_modules made the stage emit tensors through a forward hook, not a new forward
    assert upstream._wrap_stage_forward_to_emit_tensor(stage_model) is stage_model
    assert dict(stage_model._forward_hooks) == hooks  # idempotent
    logits = stage_model(torch.ones(1, 4, dtype=torch.long))
    assert isinstance(logits, torch.Tensor)
    assert logits.shape == (1, 4, model.config.vocab_size)


@pytest.mark.usefixtures("one_rank_group")
def test_build_schedule_trusts_the_plan(monkeypatch):
    """`build_stages` / `build_schedule` run the plan they are given and never call the planner again: with the
    planner disabled, a plan of 6 sequences in microbatches of 2 runs 3 microbatches (upstream's
    `build_pipeline_schedule` options would re-plan to another count), and stages of another plan are refused."""
    import torch.distributed as dist

    from am_pipelining import build_schedule, build_stages, plan_pipeline, planning

    model = M.llama(2)
    plan = plan_pipeline(2, 1, "GPipe", local_batch_size=6, microbatch_size=2)
    for module in ("planning", "schedules", "stage_names", "autopipeline", "schedule_picture"):  # all its importers
        monkeypatch.setattr(f"am_pipelining.{module}.plan_pipeline", lambda *_, **__: pytest.fail("planned again"))
    stages, _ = build_stages(model, dist.group.WORLD, plan, device="cpu", seq_len=M.SEQ)
    schedule = build_schedule(stages, plan, loss_fn=M.mean_ce)
    assert schedule._n_microbatches == 3
    data = M.batch("llama", 6)
    losses: list[torch.Tensor] = []
    schedule.step(data["input_ids"], target=data["labels"], losses=losses)
    assert len(losses) == 3
    monkeypatch.undo()
    assert planning.plan_pipeline is plan_pipeline

    with pytest.raises(ValueError, match="the plan has no batch"):
        build_schedule(stages, plan_pipeline(2, 1, "GPipe"), loss_fn=M.mean_ce)
    interleaved = plan_pipeline(2, 1, "Interleaved1F1B", local_batch_size=2, microbatch_size=1)
    with pytest.raises(ValueError, match=r"runs 2 of 2 stage\(s\) per rank but this rank has 1"):
        build_schedule(stages, interleaved, loss_fn=None)
    with pytest.raises(ValueError, match="the plan is for 3 layers but the model has 2"):
        build_stages(model, dist.group.WORLD, plan_pipeline(3, 1, "GPipe"), device="cpu")
