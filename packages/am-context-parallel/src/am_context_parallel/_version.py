"""This copy's version. The source is `pyproject.toml`: the installed copy reports its distribution's metadata.
Any other copy — the `src/am_context_parallel` folder vendored into another project, or a source tree that was never
installed — reports `RELEASE`, which `tests/test_version.py` keeps equal to the pyproject, so a vendored copy never
reports the version of an installed copy of the same distribution. Imports only the standard library.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

__all__ = ["DISTRIBUTION", "RELEASE", "__version__"]

DISTRIBUTION = "am-context-parallel"
RELEASE = "0.2.0"


def _installed_version() -> str | None:
    """The distribution's version if this very folder is the installed one (a wheel's, or an editable source)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    here = Path(__file__).resolve().parent
    homes = [Path(str(dist.locate_file(here.name))).resolve()]  # site-packages/<name> for a wheel install
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")  # PEP 610
    if direct_url.get("dir_info", {}).get("editable"):
        homes.append(Path(url2pathname(urlparse(direct_url["url"]).path)).resolve() / "src" / here.name)
    return dist.version if here in homes else None


__version__: str = _installed_version() or RELEASE
