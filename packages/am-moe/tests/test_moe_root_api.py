"""The package root is the core API: every name in `am_moe.__all__` exists, none is private, and no two names
are bound to one object (an alias for a seed or upstream spelling belongs in an `upstream` module, not here)."""

from __future__ import annotations

import am_moe
from am_testing import root_api_problems


def test_the_root_follows_the_one_name_per_thing_rule() -> None:
    assert root_api_problems(am_moe) == []
