"""Check a package installed from `dist/` into a fresh venv (run with that venv's python).

Usage: python tools/check_install.py PACKAGE '<json {dist name: expected version}>'
The JSON lists the package and the workspace siblings it needs. Checks: each is installed at exactly that version,
from a wheel (not editable, not a source-tree path), importable from this venv's site-packages, and `__version__`
agrees with the installed metadata; no other workspace package is installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import json
import sys
import sysconfig
from pathlib import Path

_WORKSPACE_PREFIX = "am-"


def _problems(package: str, expected: dict[str, str]) -> list[str]:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    problems = []
    installed = {dist.metadata["Name"].lower(): dist for dist in metadata.distributions() if dist.metadata["Name"]}
    extra = sorted(name for name in installed if name.startswith(_WORKSPACE_PREFIX) and name not in expected)
    if extra:
        problems.append(f"{package} pulled in workspace packages it does not declare: {extra}")
    for name, version in expected.items():
        dist = installed.get(name)
        if dist is None:
            problems.append(f"{name} is not installed (expected {version} from dist/)")
            continue
        if dist.version != version:
            problems.append(f"{name} {dist.version} is installed, expected {version} (the pyproject version)")
        direct_url = dist.read_text("direct_url.json")
        if direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"):
            problems.append(f"{name} is an editable install; it must come from a wheel in dist/")
        module_name = name.replace("-", "_")
        module = importlib.import_module(module_name)
        location = Path(module.__file__ or "").resolve()
        if site not in location.parents:
            problems.append(f"{module_name} was imported from {location}, not from this venv's {site}")
        reported = getattr(module, "__version__", None)
        if reported != dist.version:
            problems.append(f"{module_name}.__version__ is {reported!r}, its installed metadata says {dist.version}")
    return problems


def main(package: str, expected_json: str) -> None:
    expected = {name.lower(): version for name, version in json.loads(expected_json).items()}
    problems = _problems(package, expected)
    if problems:
        sys.exit(f"installing {package} from dist/:\n  - " + "\n  - ".join(problems))
    shown = ", ".join(f"{name} {version}" for name, version in sorted(expected.items()))
    print(f"{package}: installed from dist/ into a fresh venv ({shown}), imports from site-packages")


if __name__ == "__main__":
    main(*sys.argv[1:])
