"""Pipeline parity on 2 real gloo ranks: every model × every schedule, CSV schedules, the mask cache, tied
embeddings through training, model hooks with MTP, AutoPipeline, splitting and early errors.

One process group runs all cases (see `_cases.cases_2ranks`); each test asserts on its own case.
"""

from __future__ import annotations

import _cases
import pytest
from _dist import assert_case, run_ranks

CASES = list(_cases.cases_2ranks())


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, "_cases:cases_2ranks", deadline_s=300)


@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    assert_case(results, case)
