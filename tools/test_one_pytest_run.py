"""`pytest packages/` works from the repository root: every package's tests collect in one run (they share file
names such as test_upstream_api.py; packages/pytest.ini imports them by path), and a multi-rank test module runs
there too (am-testing's ranks load the path-named test module from its file).

Run by the `integration` nox session (every package installed there).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = sorted(p.name for p in (_ROOT / "packages").iterdir() if (p / "tests").is_dir())


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args], cwd=_ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def test_every_package_collects_in_one_run() -> None:
    done = _pytest("packages", "--collect-only", "-q")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    for package in _PACKAGES:
        assert any(line.startswith(f"{package}/tests/") for line in collected), f"nothing collected from {package}"
    ini_paths = re.findall(r"^\s+(\S+/tests)$", (_ROOT / "packages" / "pytest.ini").read_text(), re.MULTILINE)
    assert sorted(ini_paths) == [f"{p}/tests" for p in _PACKAGES], "packages/pytest.ini must list every tests folder"


def test_multi_rank_module_runs_under_the_root_run() -> None:
    done = _pytest("packages/am-context-parallel/tests/test_layouts.py", "-q")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", done.stdout), done.stdout[-2000:]
