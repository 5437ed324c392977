"""Private test helpers of the am-* monorepo (not published; listed in each package's `test` dependency group)."""

from .api import root_api_problems
from .gloo import PG_TIMEOUT_S, CaseError, case_result, run_cases, run_group
from .processes import DeadlineExceeded, Finished, run_process, run_processes

__all__ = [
    "root_api_problems",
    "PG_TIMEOUT_S",
    "CaseError",
    "case_result",
    "run_cases",
    "run_group",
    "DeadlineExceeded",
    "Finished",
    "run_process",
    "run_processes",
]
