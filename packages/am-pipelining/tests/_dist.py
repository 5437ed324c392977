"""Multi-rank test helper of am-pipelining: am_testing's gloo harness (one process group per test module, many cases
inside, a deadline for the group and for each case) running the cases a `module:function` reference returns.

The ranks stop at the first failed case (`stop_after_failure`): a schedule that failed can leave point-to-point
messages unmatched, which would poison the cases after it; those are reported as not run.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

from am_testing import case_result, run_cases, run_group

CASE_TIMEOUT_S = float(os.environ.get("AM_PP_CASE_TIMEOUT_S", "90"))
"""Watchdog per case: a rank stuck longer writes its stack and stops (point-to-point waits are not always covered by
the process group's timeout). Cases take well under 10 s each."""

PRELOAD = ("torch", "torch.distributed", "torch.distributed.pipelining", "transformers", "am_pipelining")


def _run(cases_ref: str, rank: int, world_size: int) -> dict[str, Any]:
    module_name, function_name = cases_ref.split(":")
    cases = getattr(importlib.import_module(module_name), function_name)()
    return run_cases(cases, timeout=CASE_TIMEOUT_S, stop_after_failure=True)


def run_ranks(world_size: int, cases_ref: str, *, deadline_s: float = 300.0) -> list[dict[str, Any]]:
    """Run `module:function` (returning {case name: callable}) on `world_size` gloo ranks; each rank's results."""
    return run_group(world_size, functools.partial(_run, cases_ref), preload=PRELOAD, timeout=deadline_s)


def assert_case(results: list[dict[str, Any]], name: str) -> None:
    """Fail with every failing rank's traceback unless the case passed on all ranks."""
    problems = []
    for rank in range(len(results)):
        try:
            case_result(results, name, rank)
        except AssertionError as error:
            problems.append(str(error))
    if problems:
        raise AssertionError("\n".join(problems))
