"""The multi-rank harness (am_testing, `tools/am-testing`) never hangs: a case past its deadline stops its rank, and
the group fails within seconds with an error naming, for every rank, the case it was in and its stack.

am-testing has no test suite of its own (it is a test dependency, not a package nox tests); it lives here because
am-moe's multi-rank tests run through it.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from am_testing import case_result, run_cases, run_group

CASE_TIMEOUT_S = 3.0  # the stuck case's own deadline
GROUP_TIMEOUT_S = 200.0  # far above start-up + CASE_TIMEOUT_S: the group must fail through the case's deadline
# The whole group's deadline when cases have none: start-up (forkserver, torch imports, rendezvous) takes ~5 s on a
# busy 2-core machine, so the ranks are inside their cases long before it.
SHORT_GROUP_TIMEOUT_S = 30.0


def _stuck_on_rank_0(rank: int) -> int:
    if rank == 0:
        time.sleep(10 * GROUP_TIMEOUT_S)  # a hang, e.g. a collective the other rank never joins
    return rank


def _worker(rank: int, world: int) -> dict[str, Any]:
    return run_cases({"quick": lambda: rank, "stuck": lambda: _stuck_on_rank_0(rank)}, timeout=CASE_TIMEOUT_S)


def _worker_without_case_deadline(rank: int, world: int) -> dict[str, Any]:
    def stuck() -> int:
        import torch.distributed as dist

        _stuck_on_rank_0(rank)
        dist.barrier()  # rank 1 waits here for rank 0 (gloo's own timeout is far longer than the group's)
        return rank

    return run_cases({"quick": lambda: rank, "stuck": stuck})


def test_a_case_past_its_deadline_fails_the_group_naming_the_case() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="process group of 2 ranks failed") as info:
        run_group(2, _worker, timeout=GROUP_TIMEOUT_S)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < GROUP_TIMEOUT_S / 2, f"the group ended through its own deadline ({elapsed:.0f} s), not the case's"
    # Rank 0 was stopped by the case's deadline: named with the case, and its stack shows where it hung.
    assert "--- rank 0 (exit code 1) in case 'stuck' ---" in message
    assert "Timeout (0:00:03)" in message
    assert "_stuck_on_rank_0" in message
    # Rank 1 had finished its cases: its final barrier failed when rank 0 went away (or the harness stopped it).
    assert re.search(r"--- rank 1 \((exit code 1|stopped)\) after its last case ---", message), message
    assert "_entry" in message


def test_the_group_deadline_names_the_case_each_rank_was_in() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"timed out after {SHORT_GROUP_TIMEOUT_S} s") as info:
        run_group(2, _worker_without_case_deadline, timeout=SHORT_GROUP_TIMEOUT_S)
    assert time.monotonic() - start < SHORT_GROUP_TIMEOUT_S + 15  # stacks are collected, then the ranks killed
    message = str(info.value)
    for rank, where in ((0, "_stuck_on_rank_0"), (1, "barrier")):
        assert f"--- rank {rank} (stopped) in case 'stuck' ---" in message
        assert where in message  # the stack each rank was stopped in, written by faulthandler on SIGUSR1


def _fails_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 broke")
    return rank


def _worker_stopping_after_failure(rank: int, world: int) -> dict[str, Any]:
    return run_cases(
        {"first": lambda: rank, "broken": lambda: _fails_on_rank_1(rank), "after": lambda: rank},
        stop_after_failure=True,
    )


def test_stop_after_failure_skips_the_later_cases_on_every_rank() -> None:
    """A failure on ONE rank stops every rank (the ranks agree after each case), so a schedule that failed cannot
    leave point-to-point messages for the next case; the later cases report that they did not run."""
    results = run_group(2, _worker_stopping_after_failure, timeout=GROUP_TIMEOUT_S)
    assert [case_result(results, "first", rank) for rank in (0, 1)] == [0, 1]
    assert case_result(results, "broken", 0) == 0
    with pytest.raises(AssertionError, match="rank 1 broke"):
        case_result(results, "broken", 1)
    for rank in (0, 1):
        with pytest.raises(AssertionError, match="not run: case 'broken' failed before it"):
            case_result(results, "after", rank)
