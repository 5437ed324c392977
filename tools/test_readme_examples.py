"""Every ```python block of a README runs as written and exits 0 (see `readme_examples.py`).

Which README: the `AM_README` environment variable (a path relative to the repository root), set by the nox
session that has exactly that package's dependencies installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_examples import ExampleBlock, extract_blocks, run_block

_ROOT = Path(__file__).resolve().parents[1]
_README = os.environ.get("AM_README")
_BLOCKS = extract_blocks(_ROOT / _README) if _README else []


@pytest.mark.skipif(not _README, reason="AM_README is not set (the nox tests/integration sessions set it)")
@pytest.mark.parametrize("block", _BLOCKS or [None], ids=[b.name for b in _BLOCKS] or ["none"])
def test_readme_example_runs(block: ExampleBlock | None) -> None:
    """The block runs in a fresh process (torchrun when it says so) in an empty folder and exits 0."""
    assert block is not None, f"{_README} has no ```python block"
    result = run_block(block)
    assert result.returncode == 0, (
        f"{block.name} exited {result.returncode}\n--- code ---\n{block.code}\n--- stdout ---\n{result.stdout[-4000:]}"
        f"\n--- stderr ---\n{result.stderr[-6000:]}"
    )
