"""`__version__` is this copy's version: the pyproject's, read from the installed metadata, and never an installed
copy's when the package folder is vendored elsewhere (the `RELEASE` fallback, kept equal to the pyproject here)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
from pathlib import Path

import am_models_gemma4
from am_models_gemma4 import _version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
FIX = "set RELEASE in _version.py to the pyproject's version, then re-run `uv sync` (editable installs' metadata)"


def _pyproject_version() -> str:
    match = re.search(r'^version = "([^"]+)"$', PYPROJECT.read_text(), re.MULTILINE)
    assert match is not None, f"no version line in {PYPROJECT}"
    return match[1]


def test_version_is_the_pyprojects() -> None:
    assert _pyproject_version() == _version.RELEASE, FIX
    assert am_models_gemma4.__version__ == _pyproject_version(), FIX
    # This copy is the installed one, so the version came from its metadata.
    assert _version._installed_version() == importlib.metadata.version(_version.DISTRIBUTION)


def test_a_vendored_copy_reports_its_own_version(tmp_path: Path) -> None:
    vendored = tmp_path / "_vendor" / "am_models_gemma4"
    shutil.copytree(Path(am_models_gemma4.__file__).parent, vendored)
    source = (vendored / "_version.py").read_text()
    (vendored / "_version.py").write_text(source.replace(f'RELEASE = "{_version.RELEASE}"', 'RELEASE = "99.0.0"'))
    spec = importlib.util.spec_from_file_location("vendored_version", vendored / "_version.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__version__ == "99.0.0"  # not the installed copy's metadata
