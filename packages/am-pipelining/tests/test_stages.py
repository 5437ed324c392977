"""Single-process tests of stage lists, stage building (names, memory, meta device, tied weights), static stage
shapes and the early errors of `am_pipelining.stages` / `am_pipelining.stage_modules`."""

from __future__ import annotations

import copy

import _models as M
import pytest
import torch
from torch import nn

from am_pipelining import (
    MULTIMODAL_SUFFIXES,
    build_stage_modules,
    generate_hf_model_fqn_per_model_part,
)
from am_pipelining.layers import find_layers
from am_pipelining.planning import split_layers
from am_pipelining.stage_modules import stage_metas
from am_pipelining.stage_names import _default_module_names


def _names(model, num_stages):
    """Module names per stage for an even split of the model's layers into `num_stages`."""
    layout = find_layers(model)
    return _default_module_names(model, split_layers(layout.num_layers, num_stages), layout), layout


def test_fqn_generation_uneven_split_and_extras():
    stages = generate_hf_model_fqn_per_model_part(3, 10, extra_module_fqns=["model.extra"])
    layer_counts = [sum(".layers." in n for n in stage) for stage in stages]
    assert layer_counts == [4, 3, 3]
    assert stages[0][0] == "model.embed_tokens"
    assert "model.extra" in stages[0]
    assert all(f"model.{s}" in stages[0] for s in MULTIMODAL_SUFFIXES)
    assert "model.layers.4" in stages[1]
    assert "model.layers.9" in stages[2]
    assert stages[2][-3:] == ["model.norm", "lm_head", "model.rotary_emb"]
    assert all(stage[-1] == "model.rotary_emb" for stage in stages)
    bare = generate_hf_model_fqn_per_model_part(
        1,
        2,
        include_embeddings=False,
        include_lm_head=False,
        include_rotary_emb=False,
        include_multimodal_encoders=False,
        fqn_prefix="",
        lm_head_fqn="head",
    )
    assert bare == [["layers.0", "layers.1", "norm"]]


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ValueError, match=r"Number of stages \(5\) cannot exceed number of layers \(4\)"):
        generate_hf_model_fqn_per_model_part(5, 4)
    with pytest.raises(ValueError, match="at least 1"):
        generate_hf_model_fqn_per_model_part(0, 4)


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_stage_modules_hold_only_their_parameters():
    model = M.llama(4)
    full = dict(model.named_parameters())
    names, _ = _names(model, 2)
    first, last = build_stage_modules(model, names, [0, 1])
    assert list(first.model.layers.keys()) == ["0", "1"]
    assert list(last.model.layers.keys()) == ["2", "3"]
    for stage, owned in (
        (first, ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")),
        (last, ("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")),
    ):
        expected = {n for n in full if n.startswith(owned)}
        assert {n for n, _ in stage.named_parameters()} == expected
        assert _param_bytes(stage) == sum(full[n].numel() * 4 for n in expected)
        for n, p in stage.named_parameters():
            assert torch.equal(p, full[n])
            assert p.data_ptr() != full[n].data_ptr()
    assert _param_bytes(first) + _param_bytes(last) == _param_bytes(model)
    assert isinstance(model.model.layers, nn.ModuleList)
    assert len(model.model.layers) == 4
    assert model.model.embed_tokens is not None
    assert model.lm_head is not None


@pytest.mark.parametrize("name", ["llama", "gemma4_vlm", "mistral3_vlm"])
def test_stages_run_the_pipeline_forward_as_their_class_without_patching(name):
    """No forward is bound onto an instance and no class changes: a stage's text decoder and top-level model are
    instances of subclasses of their own classes (class attributes, `isinstance`, names and state-dict keys kept)
    whose `forward` is the pipeline forward; the model they were copied from runs its own forward still."""
    model = M.FACTORIES[name](2)
    classes = {n: type(m) for n, m in model.named_modules()}
    forwards = {cls: cls.forward for cls in classes.values()}
    names, layout = _names(model, 2)
    text_name = layout.layers_prefix.rstrip(".")
    stages = build_stage_modules(model, names, [0, 1])
    for stage in stages:
        text = stage.get_submodule(text_name)
        for module, cls in ((stage, type(model)), (text, classes[text_name])):
            assert type(module) is not cls
            assert isinstance(module, cls)
            assert type(module).__name__ == cls.__name__
            assert type(module)._am_pipeline_stage_of is cls
            assert "forward" not in module.__dict__
        assert type(text).forward.__name__.startswith("pipeline_forward")
        assert type(stage).forward.__name__.startswith("pipeline_forward")
        for names_of in (nn.Module.named_parameters, nn.Module.named_buffers):  # tied heads counted by each name
            assert {n for n, _ in names_of(stage, remove_duplicate=False)} <= {
                n for n, _ in names_of(model, remove_duplicate=False)
            }
    assert type(stages[0]) is type(stages[1])  # one stage class per model class, made once
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert all(cls.forward is forward for cls, forward in forwards.items())
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_stage_building_copies_only_kept_modules(monkeypatch):
    """The deep copy sees only the kept parts: peak extra memory is one stage, not one model per stage."""
    model = M.llama(4)
    names, _ = _names(model, 4)
    copied_bytes = []
    real_deepcopy = copy.deepcopy

    def counting_deepcopy(obj, memo=None):
        if isinstance(obj, nn.Module):
            copied_bytes.append(_param_bytes(obj))
        return real_deepcopy(obj, memo)

    monkeypatch.setattr(copy, "deepcopy", counting_deepcopy)
    build_stage_modules(model, names, [1])
    layer_bytes = _param_bytes(model.model.layers[1])
    assert copied_bytes == [layer_bytes], f"copied {copied_bytes}, one layer is {layer_bytes}"


def test_meta_model_allocates_nothing():
    with torch.device("meta"):
        model = M.llama(4)
    names, _ = _names(model, 2)
    stages = build_stage_modules(model, names, [0, 1])
    assert all(p.is_meta for stage in stages for p in stage.parameters())
    assert all(b.is_meta for stage in stages for b in stage.buffers())


def test_tied_weights_stay_tied_on_one_stage_and_are_copied_across_stages():
    model = M.llama(2, tied=True)
    names, _ = _names(model, 1)
    (single,) = build_stage_modules(model, names, [0])
    assert single.lm_head.weight is single.model.embed_tokens.weight
    names, _ = _names(model, 2)
    first, last = build_stage_modules(model, names, [0, 1])
    assert last.model.embed_tokens is None
    assert first.lm_head is None
    assert torch.equal(last.lm_head.weight, model.model.embed_tokens.weight)
    assert last.lm_head.weight.data_ptr() != first.model.embed_tokens.weight.data_ptr()


def test_vlm_stage_lists_put_encoders_on_stage_zero():
    model = M.mistral3_vlm(4)
    names, layout = _names(model, 2)
    assert layout.layers_prefix == "model.language_model."
    assert "model.vision_tower" in names[0]
    assert "model.multi_modal_projector" in names[0]
    assert "model.language_model.embed_tokens" in names[0]
    assert "lm_head" in names[1]
    first, last = build_stage_modules(model, names, [0, 1])
    assert first.model.vision_tower is not None
    assert last.model.vision_tower is None
    assert last.model.language_model.norm is not None
    assert first.model.language_model.norm is None


def test_non_tensor_stage_output_is_a_clear_error():
    class DictOut(nn.Module):
        _pp_keep_self_forward = True

        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(8, 4)
            self.model.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x):
            h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
            return {"hidden": h, "mask": torch.ones(1)}

    model = DictOut()
    (stage,) = build_stage_modules(model, [["model.embed_tokens", "model.layers.0"], ["model.layers.1"]], [0])
    with pytest.raises(ValueError, match=r"only tensors .* can travel between stages"):
        stage(torch.zeros(1, 3, dtype=torch.long))


def test_named_tuple_stage_output_is_refused_with_the_declaration_fix():
    """torch treats only a plain tuple as several outputs (a NamedTuple would reach the last stage's backward as one
    non-tensor and fail there): the stage wrapper refuses it and names `pipeline_output_names`."""
    from am_pipelining import StageOutput

    class NamedOut(nn.Module):
        _pp_keep_self_forward = True

        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([nn.Linear(4, 4)])

        def forward(self, x):
            return StageOutput(self.model.layers["0"](x))

    (stage,) = build_stage_modules(NamedOut(), [["model.layers.0"]], [0])
    with pytest.raises(ValueError, match=r"StageOutput \(a tuple subclass\).*pipeline_output_names"):
        stage(torch.zeros(1, 2, 4))


def test_reentrant_checkpointing_is_rejected_with_the_fix():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model = M.llama(2)
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0], checkpoint_impl=CheckpointImpl.REENTRANT)
    names, _ = _names(model, 2)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        build_stage_modules(model, names, [0])
    hf = M.llama(2)
    hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="Reentrant activation checkpointing"):
        build_stage_modules(hf, names, [0])
    ok = M.llama(2)
    ok.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    build_stage_modules(ok, names, [0])


def test_stage_metas_shapes_and_model_hook():
    model = M.llama(2)
    names, _ = _names(model, 2)
    first, last = build_stage_modules(model, names, [0, 1])
    (inp,), (out,) = stage_metas(first, is_first=True, is_last=False, microbatch_size=2, seq_len=8)
    assert inp.shape == (2, 8)
    assert inp.dtype == torch.long
    assert out.shape == (2, 8, 16)
    assert out.is_meta
    (inp,), (out,) = stage_metas(last, is_first=False, is_last=True, microbatch_size=2, seq_len=8)
    assert inp.shape == (2, 8, 16)
    assert inp.requires_grad
    assert out.shape == (2, 8, M.VOCAB)
    hooked = M.HookedMTPModel(2)
    _inputs, outputs = stage_metas(hooked, is_first=True, is_last=True, microbatch_size=1, seq_len=4)
    assert len(outputs) == 2
    assert outputs[0].shape == (1, 4, M.VOCAB)


def test_schedule_errors_before_any_collective():
    """Missing stages and a missing CSV file are errors naming the fix, raised before a schedule exists (the batch
    rules are `plan_pipeline`'s, tested in test_planning.py and on real stages in the 2-rank cases)."""
    from am_pipelining import build_pipeline_schedule

    with pytest.raises(ValueError, match="No pipeline stages on this rank"):
        build_pipeline_schedule(None, "1F1B", 1, 8, [], None)
    with pytest.raises(FileNotFoundError, match="does not exist or is not a file"):
        build_pipeline_schedule("/no/such/schedule.csv", None, 1, 8, [], None)


def test_static_shape_options_without_seq_len_are_refused():
    """microbatch_size / tensor_dtype only describe static shapes: without seq_len they would be ignored."""
    from am_pipelining import split_model_into_stages

    for option in ({"microbatch_size": 2}, {"tensor_dtype": torch.bfloat16}):
        with pytest.raises(ValueError, match="need seq_len"):
            split_model_into_stages(M.llama(2), None, "pp", "1F1B", "cpu", **option)
