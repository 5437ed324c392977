"""Pipeline parity on 4 real gloo ranks: every model under the single-stage schedules (4 stages) and three models
under every multi-stage schedule (8 stages, 2 per rank, loop or V placement).

One process group runs all cases (see `_cases.cases_4ranks`); each test asserts on its own case.
"""

from __future__ import annotations

import _cases
import pytest
from _dist import assert_case, run_ranks

CASES = list(_cases.cases_4ranks())


@pytest.fixture(scope="module")
def results():
    return run_ranks(4, "_cases:cases_4ranks", deadline_s=400)


@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    assert_case(results, case)
