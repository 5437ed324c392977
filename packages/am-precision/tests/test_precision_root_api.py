"""The package root is the core API: every name in `am_precision.__all__` exists, none is private, and no two names
are bound to one object (an alias for a seed or upstream spelling belongs in an `upstream` module, not here)."""

from __future__ import annotations

import subprocess
import sys

import am_precision
from am_testing import root_api_problems


def test_the_root_follows_the_one_name_per_thing_rule() -> None:
    assert root_api_problems(am_precision) == []


def test_the_core_never_imports_upstream() -> None:
    """`am_precision.upstream` (upstream's class patching) is built on the core; no core module imports it."""
    code = (
        "import sys, am_precision, am_precision.modules, am_precision.te_modules; "
        "print('am_precision.upstream' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert done.stdout.strip() == "False"
