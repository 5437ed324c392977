"""Check a package's built wheel and sdist: exact Requires-Dist, py.typed and the LICENSE file.

Usage: python tools/check_wheel.py WHEEL SDIST '<json list of expected requirements>'
Requirements are compared as parsed by `packaging` (whitespace, quotes and specifier order do not matter).
"""

from __future__ import annotations

import json
import sys
import tarfile
import zipfile

from packaging.requirements import Requirement


def _normalize(requirement: str) -> str:
    return str(Requirement(requirement.strip()))


def wheel_problems(wheel: str, expected: set[str]) -> tuple[list[str], set[str]]:
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
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        problems.append('the wheel does not ship LICENSE (add `license-files = ["LICENSE"]` to the pyproject)')
    if "License-Expression: Apache-2.0" not in lines:
        problems.append("the wheel's METADATA has no `License-Expression: Apache-2.0`")
    return problems, requires


def sdist_problems(sdist: str) -> list[str]:
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
    if not any(n.count("/") == 1 and n.endswith("/LICENSE") for n in names):
        return [f"the sdist does not ship LICENSE at its top level (found {len(names)} files)"]
    return []


def main(wheel: str, sdist: str, expected_json: str) -> None:
    expected = {_normalize(r) for r in json.loads(expected_json)}
    problems, requires = wheel_problems(wheel, expected)
    problems += sdist_problems(sdist)
    if problems:
        sys.exit(f"{wheel} / {sdist}:\n  - " + "\n  - ".join(problems))
    print(f"{wheel.rsplit('/', 1)[-1]} (+ sdist): LICENSE, py.typed, Requires-Dist = {sorted(requires)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
