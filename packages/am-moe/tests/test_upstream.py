"""`am_moe.upstream` speaks am-moe's names: every upstream `experts` value maps to a `GroupedExperts(grouped_mm=...)`
backend, every library dispatcher is an `apply_expert_parallel` dispatcher, and the dispatcher keywords are read
from upstream's `BackendConfig` field names (any object with them)."""

from __future__ import annotations

import types

from am_moe import DISPATCHERS, GROUPED_MM_BACKENDS
from am_moe.upstream import EXPERTS_GROUPED_MM, LIBRARY_DISPATCHERS, expert_parallel_options


def test_the_upstream_names_map_onto_am_moe_backends_and_dispatchers() -> None:
    assert set(EXPERTS_GROUPED_MM) == {"torch", "torch_mm", "te", "gmm", "torch_mm_mxfp8"}  # upstream's values
    assert set(EXPERTS_GROUPED_MM.values()) <= set(GROUPED_MM_BACKENDS) - {"auto"}
    assert set(LIBRARY_DISPATCHERS) == set(DISPATCHERS) - {"torch", "torch_token"}


def test_expert_parallel_options_read_the_backend_fields_and_the_override() -> None:
    backend = types.SimpleNamespace(
        dispatcher="deepep",
        dispatcher_num_sms=24,
        dispatcher_async_dispatch=True,
        dispatcher_share_token_dispatcher=False,
        experts="te",  # not a dispatcher keyword: left out
    )
    expected = {
        "dispatcher": "deepep",
        "dispatcher_num_sms": 24,
        "dispatcher_async_dispatch": True,
        "dispatcher_share_token_dispatcher": False,
    }
    assert expert_parallel_options(backend) == expected
    assert expert_parallel_options(backend, dispatcher="torch_token") == expected | {"dispatcher": "torch_token"}
    assert expert_parallel_options(None) == {"dispatcher": "torch"}
    assert expert_parallel_options(None, dispatcher="torch_token") == {"dispatcher": "torch_token"}
