"""Every package works when vendored: `src/<module>` copied into another project's `_vendor/` folder imports only
itself (internal imports are relative), needs no installed metadata, and never reaches an installed copy of the
same package, which the integration venv has (so the test would see the leak).

Run by the `integration` nox session (every package installed there).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_SOURCES = {
    src.name: src for src in sorted(_ROOT.glob("packages/*/src/*")) if src.is_dir() and (src / "__init__.py").is_file()
}


def _absolute_self_imports(module: str, source: Path) -> list[str]:
    """`file:line: statement` for every import of `module` by absolute name inside its own sources."""
    found = []
    for path in sorted(source.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(name == module or name.startswith(module + ".") for name in names):
                found.append(f"{path.relative_to(_ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_internal_imports_are_relative() -> None:
    """Absolute self-imports (also lazy ones inside functions, which an import test would not reach) are listed."""
    offenders = [line for module, source in _SOURCES.items() for line in _absolute_self_imports(module, source)]
    assert not offenders, "use relative imports inside a package (vendoring):\n" + "\n".join(offenders)


_PROBE = """
import importlib, pkgutil, sys
from pathlib import Path
module, folder = sys.argv[1], Path(sys.argv[2]).resolve()
vendored = importlib.import_module(f"_vendor.{module}")
for info in pkgutil.walk_packages(vendored.__path__, vendored.__name__ + "."):
    importlib.import_module(info.name)
leaked = sorted(name for name in sys.modules if name == module or name.startswith(module + "."))
outside = sorted(
    name for name, mod in sys.modules.items()
    if name.startswith("_vendor.") and getattr(mod, "__file__", None)
    and not Path(mod.__file__).resolve().is_relative_to(folder)
)
assert not leaked, f"the vendored copy imported the installed package: {leaked}"
assert not outside, f"vendored modules loaded from outside the _vendor folder: {outside}"
print(vendored.__version__)
"""


@pytest.mark.parametrize("module", sorted(_SOURCES))
def test_vendored_copy_never_imports_the_installed_one(module: str, tmp_path: Path) -> None:
    assert importlib.util.find_spec(module) is not None, f"{module} must be installed for this test to mean anything"
    vendor = tmp_path / "_vendor"
    shutil.copytree(_SOURCES[module], vendor / module, ignore=shutil.ignore_patterns("__pycache__"))
    (vendor / "__init__.py").write_text("")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, module, str(vendor)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    version_file = (_SOURCES[module] / "_version.py").read_text()
    assert f'"{result.stdout.strip()}"' in version_file, (result.stdout, version_file)
