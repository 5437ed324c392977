"""`am_pipelining.functional` is the upstream import path: it re-exports the splitting and scheduling API from the
modules that define it (planning, stage_modules, stages, schedules)."""

from __future__ import annotations

import am_pipelining
from am_pipelining import functional


def test_upstream_import_path_re_exports_the_same_objects():
    assert set(functional.__all__) >= {
        "stage_ids_this_rank",
        "generate_hf_model_fqn_per_model_part",
        "calculate_virtual_stages",
        "split_model_into_stages",
        "build_pipeline_schedule",
        "pipeline_model",
    }
    for name in functional.__all__:
        exported = getattr(functional, name)
        assert getattr(am_pipelining, name, exported) is exported, name
        assert exported.__module__ != "am_pipelining.functional", f"{name} is defined in functional.py"
