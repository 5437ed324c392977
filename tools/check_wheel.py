"""Check that a built wheel declares exactly the expected Requires-Dist lines and ships py.typed.

Usage: python tools/check_wheel.py WHEEL '<json list of expected requirements>'
Requirements are compared as parsed by `packaging` (whitespace, quotes and specifier order do not matter).
"""

from __future__ import annotations

import json
import sys
import zipfile

from packaging.requirements import Requirement


def _normalize(requirement: str) -> str:
    return str(Requirement(requirement.strip()))


def main(wheel: str, expected_json: str) -> None:
    expected = {_normalize(r) for r in json.loads(expected_json)}
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        lines = zf.read(metadata).decode().splitlines()
    requires = {_normalize(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")}
    problems = []
    if requires != expected:
        problems.append(
            f"Requires-Dist differs from the pyproject: only in wheel {sorted(requires - expected)}, "
            f"only in pyproject {sorted(expected - requires)}"
        )
    if not any(n.endswith("/py.typed") for n in names):
        problems.append("py.typed is missing (add it under src/<import_name>/)")
    if problems:
        sys.exit(f"{wheel}:\n  - " + "\n  - ".join(problems))
    print(f"{wheel.rsplit('/', 1)[-1]}: Requires-Dist = {sorted(requires)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
