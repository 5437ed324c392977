"""Broad-architecture pipeline parity on 2 real gloo ranks (pp=2): every transformers causal LM of
`_arch_models.ARCHS` trains exactly as the unsplit model (loss and gradients, fp32) or is refused naming the
feature the pipeline forward cannot reproduce. One process group runs all cases (`_arch_cases.cases_archs`)."""

from __future__ import annotations

import _arch_cases
import pytest
from _dist import assert_case, run_ranks

CASES = list(_arch_cases.cases_archs())


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, "_arch_cases:cases_archs", deadline_s=240)


@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    assert_case(results, case)
