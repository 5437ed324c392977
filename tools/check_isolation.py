"""Fail when a test venv holds a workspace package that the package under test does not depend on.

Usage: python tools/check_isolation.py '<json allowed>' '<json all workspace packages>'
Run inside the session's venv, so it sees exactly what that venv has installed.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import sys


def main(allowed_json: str, workspace_json: str) -> None:
    allowed, workspace = set(json.loads(allowed_json)), set(json.loads(workspace_json))
    installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in md.distributions()}
    present = installed & workspace
    if missing := sorted(allowed - present):
        sys.exit(f"the venv lacks workspace packages it should have: {missing}")
    if extra := sorted(present - allowed):
        sys.exit(f"isolation broken: {sorted(allowed)} must be tested without {extra}")
    print(f"isolated: workspace packages installed = {sorted(present)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
