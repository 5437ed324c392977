"""Explicit stage lists (`module_names_per_stage`) are checked before anything is built: every name exists, every
decoder layer is in exactly one stage and in order, every parameter is kept by one stage, and the embeddings, norm,
head and rotary embedding sit where the forwards need them. All problems come in one error naming the fix."""

from __future__ import annotations

import _models as M
import pytest

from am_pipelining import PipelinePlanError, plan_for_model, split_model_into_stages

GOOD = [
    ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.rotary_emb"],
    ["model.layers.2", "model.layers.3", "model.norm", "lm_head", "model.rotary_emb"],
]


def _plan(names, model=None):
    model = model if model is not None else M.llama(4)
    return plan_for_model(model, 2, "1F1B", names)


def _problems(names, model=None):
    with pytest.raises(PipelinePlanError) as caught:
        _plan(names, model)
    return "\n".join(caught.value.problems)


def _edit(stage, remove=(), add=()):
    names = [list(s) for s in GOOD]
    names[stage] = [n for n in names[stage] if n not in remove] + list(add)
    return names


def test_a_correct_list_plans_its_own_split():
    plan = _plan(GOOD)
    assert plan.stage_layers == ((0, 1), (2, 3))
    uneven = [
        ["model.embed_tokens", "model.layers.0", "model.rotary_emb"],
        ["model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head", "model.rotary_emb"],
    ]
    assert _plan(uneven).layers_per_stage == (1, 3)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (_edit(1, remove=["model.layers.2"]), "leaves out layers [2]"),
        (_edit(1, add=["model.layers.1"]), "layer 1 in stages [0, 1]"),
        (_edit(1, remove=["lm_head"]), "leaves out 'lm_head'"),
        (_edit(1, remove=["model.norm"]), "leaves out 'model.norm'"),
        (_edit(0, remove=["model.embed_tokens"]), "leaves out 'model.embed_tokens'"),
        (_edit(1, remove=["model.rotary_emb"]), "stages [1] do not keep 'model.rotary_emb'"),
        (_edit(1, add=["model.lm_hed"]), "does not have: 'model.lm_hed' (stage 1)"),
        (_edit(1, add=["model.layers.3.mlp"]), "keeps part of a decoder layer: 'model.layers.3.mlp'"),
        (_edit(0, add=["lm_head"]), "keeps modules in more than one stage: lm_head (stages [0, 1])"),
        ([GOOD[1], GOOD[0]], "out of order"),
    ],
    ids=[
        "missing-layer",
        "repeated-layer",
        "no-head",
        "no-norm",
        "no-embeddings",
        "no-rotary",
        "typo",
        "partial",
        "head-twice",
        "order",
    ],
)
def test_each_wrong_list_is_named(names, expected):
    assert expected in _problems(names)


def test_every_problem_of_a_list_in_one_message():
    names = [
        ["model.layers.0", "model.layers.1", "model.rotary_emb", "model.lm_hed"],  # no embeddings, a typo
        ["model.layers.3", "model.norm", "model.rotary_emb"],  # layer 2 and the head left out
    ]
    message = _problems(names)
    for expected in ("leaves out layers [2]", "'model.embed_tokens'", "'lm_head'", "'model.lm_hed'"):
        assert expected in message, message


def test_misplaced_head_is_named():
    names = [
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.rotary_emb", "lm_head"],
        ["model.layers.2", "model.layers.3", "model.norm", "model.rotary_emb"],
    ]
    assert "'lm_head' is in stage [0] but the pipeline forwards run it on the last stage (1)" in _problems(names)


class _FakeMesh:
    """Enough of a 2-rank pipeline mesh for a split that is refused before any stage is built."""

    mesh_dim_names = ("pp",)

    def get_local_rank(self):
        return 0

    def size(self):
        return 2

    def get_group(self):
        return None


def test_split_refuses_a_wrong_list_and_a_hook_that_drops_a_module():
    with pytest.raises(PipelinePlanError, match="leaves out 'lm_head'"):
        split_model_into_stages(M.llama(4), _FakeMesh(), "pp", "1F1B", "cpu", _edit(1, remove=["lm_head"]))

    class DropsMTP(M.HookedMTPModel):
        def customize_pipeline_stage_modules(self, names, *, layers_prefix, text_model):
            return names  # forgets `mtp` on the last stage

    with pytest.raises(ValueError, match=r"customize_pipeline_stage_modules .* leaves out 'mtp'"):
        split_model_into_stages(DropsMTP(4), _FakeMesh(), "pp", "1F1B", "cpu")
