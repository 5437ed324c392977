"""The run plan (trainer/plan.py): made once by `validate()`, recorded in summary.json, and the only layout the
build and step functions read.

A pp 2 x cp 2 x ep 2 run of Nemotron-H (ep carved out of the cp ranks) is launched through an entry that, right after
`validate()` returned, replaces every planner the trainer could ask again (am-pipelining's `plan_pipeline`, am-moe's
`plan_expert_parallel`, am-capabilities' mesh validation, am-context-parallel's CP options and local length, the
trainer's own plan functions and its precision table) with one that fails the run: it must still train, and its
summary.json must hold the whole plan.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import PARITY, ROOT, Run, launch

# The entry: trainer.loop.main with validate() wrapped. Everything named in FORBIDDEN fails once validate() returned.
GUARDED_ENTRY = """
import sys
sys.path.insert(0, {root!r})
import trainer.loop as loop

FORBIDDEN = [
    ("am_pipelining", "plan_pipeline"), ("am_moe", "plan_expert_parallel"),
    ("am_capabilities", "validate_for_mesh"), ("am_capabilities", "attach_capabilities_and_validate"),
    ("am_context_parallel", "model_cp_options"), ("am_context_parallel", "cp_local_seq_len"),
    ("trainer.config", "pipeline_plan"), ("trainer.config", "expert_parallel_plan"),
    ("trainer.config", "mesh_context"), ("trainer.plan", "make_plan"), ("trainer.plan", "uses_fsdp"),
    ("trainer.parallel", "model_cp_layout"),
    ("trainer.parallel", "fsdp_grouping"), ("trainer.models", "attn_implementation"),
    ("trainer.expert_parallel", "has_experts"), ("trainer.step_parts", "router_aux_spec"),
    ("trainer.moe_balance", "balancing_plan"), ("trainer.moe_balance", "recipe_of"),
]


class NoLookups(dict):
    def __getitem__(self, key):
        raise AssertionError(f"PRECISIONS[{{key!r}}] looked up after validate(): the run re-derived its precision")


def forbid():
    # Each forbidden function is replaced at its home and in every trainer module that imported it by name (the
    # packages' own internal use, e.g. am-context-parallel reading the model's options while sharding, stays).
    import importlib

    replaced = 0
    for module, name in [*FORBIDDEN, ("trainer.plan", "PRECISIONS")]:
        original = getattr(importlib.import_module(module), name)
        if name == "PRECISIONS":
            stand_in = NoLookups()
        else:
            def stand_in(*args, _name=f"{{module}}.{{name}}", **kwargs):
                raise AssertionError(f"{{_name}} called after validate(): the run re-planned, not reading the plan")
        holders = [importlib.import_module(module)]
        holders += [m for key, m in list(sys.modules.items()) if key.startswith("trainer.") and m is not None]
        for holder in holders:
            if getattr(holder, name, None) is original:
                setattr(holder, name, stand_in)
                replaced += 1
    print(f"forbid: replaced {{replaced}} planner bindings", file=sys.stderr, flush=True)


real_validate = loop.validate


def validate_then_forbid(cfg, *, world_size):
    validated = real_validate(cfg, world_size=world_size)
    forbid()
    return validated


loop.validate = validate_then_forbid
raise SystemExit(loop.main())
"""

LAYOUT = ["--model", "nemotron", "--pp", "2", "--cp", "2", "--ep", "2", *PARITY]


@pytest.fixture(scope="module")
def guarded_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("run_plan")
    entry = root / "guarded_train.py"
    entry.write_text(GUARDED_ENTRY.format(root=str(ROOT)))
    return launch(LAYOUT, nproc=4, out=root / "out", script=entry)


def test_the_run_reads_the_plan_and_never_plans_again(guarded_run: Run) -> None:
    """Every planner fails after validate(), and the pp x cp x ep run still trains (the guard is live: a planner
    called in the run would end it with the AssertionError's message)."""
    run = guarded_run.check()
    assert "re-planned" not in run.output
    assert "re-derived" not in run.output
    assert "forbid: replaced" in run.output, "the guard ran"
    assert all(math.isfinite(loss) for loss in run.summary["losses"])
    assert len(run.summary["losses"]) == 3


def test_summary_records_the_whole_plan(guarded_run: Run) -> None:
    """summary.json's "plan": the mesh and its axis order, the pipeline plan, the EP plan, the CP layout, pad
    multiple and local length, the precision, FSDP2, the microbatches, the attention and the router handling."""
    plan = guarded_run.check().summary["plan"]
    assert plan["mesh"] == {"axes": ["pp", "dp", "cp"], "shape": [2, 1, 2], "ep": 2, "tp": 1}
    assert plan["is_pipeline"] is True
    pipeline = plan["pipeline"]
    assert (pipeline["schedule"], pipeline["stages"], pipeline["layers_per_stage"]) == ("1F1B", 2, [2, 2])
    assert (pipeline["microbatch_size"], pipeline["microbatches"]) == (1, 4)
    assert plan["expert_parallel"] == {"data_parallel_size": 2, "ep": 2, "expert_dp": 1}
    # Nemotron-H declares the contiguous layout; 16 tokens over cp 2: 8 per rank, no padding.
    assert plan["context_parallel"]["layout"] == "contiguous"
    assert (plan["context_parallel"]["seq_len"], plan["context_parallel"]["local_seq_len"]) == (16, 8)
    assert plan["precision"] == {"dtype": "fp32", "storage": "float32", "compute": "float32", "reduce": "float32"}
    assert (plan["fsdp"], plan["fsdp_grouping"]) == (True, "decoder layers")  # sharded over dp x cp = 2
    assert plan["batch"] == {"global_batch": 4, "local_batch": 4, "microbatch_size": 1, "microbatches": 4}
    assert (plan["num_layers"], plan["moe"], plan["router_aux"]) == (4, True, None)
    assert plan["moe_balancing"] == {  # Nemotron-H's recipe, read from the plan by the run (not re-derived)
        "bias_update_rate": 1e-3, "aux_loss_coeff": 0.0, "seq_aux_loss_coeff": 1e-4, "z_loss_coeff": 0.0
    }  # fmt: skip
    # The summary's older keys are views of the same plan.
    summary = guarded_run.summary
    assert summary["layout"]["cp_layout"] == "contiguous"
    assert summary["layout"]["layers_per_stage"] == pipeline["layers_per_stage"]
    assert summary["schedule"] == "1F1B"


def test_a_resumed_or_fresh_plan_is_plain_json(tmp_path: Path) -> None:
    """In process: `validate()` returns one `ValidatedRun` whose plan is frozen and whose JSON round-trips."""
    import dataclasses
    import json

    from conftest import TINY_ARGS
    from trainer.config import parse_args
    from trainer.validation import validate

    validated = validate(parse_args([*TINY_ARGS, "--model", "llama", "--out", str(tmp_path)]), world_size=1)
    plan = validated.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dp = 2  # type: ignore[misc]
    assert json.loads(json.dumps(plan.to_json())) == plan.to_json()
    assert (plan.is_pipeline, plan.pipeline, plan.expert_parallel, plan.cp_layout) == (False, None, None, None)
    assert (plan.local_seq_len, plan.microbatches, plan.fsdp) == (16, 4, True)  # bf16 default: FSDP2 casts


def test_validate_checks_a_preset_on_the_meta_device_and_the_run_builds_it_once(tmp_path: Path) -> None:
    """Issue 23 §1 (the trainer's side): validation needs no weights. A preset is checked on the meta device, and a
    check that reads the model's own declarations still refuses (Nemotron-H's `cp_problems` hook: a CP shard of 2
    tokens is shorter than its Mamba conv halo); the run's `build` then builds the seeded fp32 model (equal to the
    one validation used to build)."""
    from conftest import TINY_ARGS
    from trainer.config import parse_args
    from trainer.models import build_model, is_meta_model
    from trainer.validation import BadInput, validate

    args = [*TINY_ARGS, "--model", "nemotron", "--layers", "4"]  # Mamba2, attention, MLP, MoE
    validated = validate(parse_args([*args, "--out", str(tmp_path)]), world_size=1)
    assert is_meta_model(validated.model)
    assert all(t.is_meta for t in [*validated.model.parameters(), *validated.model.buffers()])
    assert validated.plan.moe  # read from the meta model's experts
    real = build_model(validated.spec, seed=0)
    assert not is_meta_model(real)
    shapes = {name: tuple(p.shape) for name, p in real.named_parameters()}
    assert shapes == {name: tuple(p.shape) for name, p in validated.model.named_parameters()}
    with pytest.raises(BadInput, match=r"--cp 8 with --seq-len 16: NemotronHForCausalLM: "):
        validate(parse_args([*args, "--cp", "8", "--out", str(tmp_path)]), world_size=8)
