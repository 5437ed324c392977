"""The root README's package table states each package's runtime dependencies exactly as its pyproject declares them:
the `dependencies` list, then each extra with its requirements (`optional-dependencies`), or "none" for a package
without any. Run by the `integration` nox session; reads files only (tomllib), so it takes a fraction of a second.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
_ROW = re.compile(r"^\| \[(?P<package>am-[a-z0-9-]+)\]\(packages/(?P=package)\) \|.*\| (?P<deps>[^|]*) \|$")


def _stated(cell: str) -> tuple[set[str], dict[str, set[str]]]:
    """(runtime requirements, extra -> requirements) written in one README cell: backquoted requirements, then
    `; extra(s)` with each backquoted extra name followed by a colon and its requirements."""
    runtime, _, extras_text = cell.partition(";")
    requirements = set(re.findall(r"`([^`]+)`", runtime))
    extras: dict[str, set[str]] = {}
    current: str | None = None
    for name, colon in re.findall(r"`([^`]+)`(:?)", extras_text):
        if colon:
            current = name
            extras[current] = set()
        else:
            assert current is not None, f"a requirement before any extra's name in {cell!r}"
            extras[current].add(name)
    return requirements, extras


def _declared(package: str) -> tuple[set[str], dict[str, set[str]]]:
    with open(_ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    extras = {name: set(reqs) for name, reqs in project.get("optional-dependencies", {}).items()}
    return set(project.get("dependencies", [])), extras


def readme_dependency_problems(readme: str) -> list[str]:
    """Every package whose README row differs from its pyproject (or that has no row), one line each."""
    packages = sorted(p.name for p in (_ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
    rows = {m["package"]: m["deps"] for line in readme.splitlines() if (m := _ROW.match(line))}
    problems = [f"{package}: no row in the README's package table" for package in packages if package not in rows]
    for package in packages:
        if package not in rows:
            continue
        stated, declared = _stated(rows[package]), _declared(package)
        if stated != declared:
            problems.append(
                f"{package}: the README says dependencies {sorted(stated[0])}, extras "
                f"{ {k: sorted(v) for k, v in stated[1].items()} }; pyproject.toml declares {sorted(declared[0])}, "
                f"extras { {k: sorted(v) for k, v in declared[1].items()} }"
            )
    problems += [f"{name}: a README row for a package not under packages/" for name in rows if name not in packages]
    return problems


def test_the_readme_dependency_column_matches_the_pyproject_files() -> None:
    problems = readme_dependency_problems((_ROOT / "README.md").read_text())
    assert not problems, "update the root README's table:\n" + "\n".join(problems)


def test_a_wrong_row_is_named() -> None:
    readme = (_ROOT / "README.md").read_text().replace("`am-model-contract>=0.1,<0.2`", "`am-model-contract>=9`", 1)
    problems = readme_dependency_problems(readme)
    assert len(problems) == 1, problems
    assert "am-model-contract>=9" in problems[0], problems
