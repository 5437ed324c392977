"""Nox sessions for the am-* monorepo.

`nox` with no arguments runs what CI runs: lint, types, wheels, the per-package `tests` matrix and `integration`
(the reference trainer run as real processes). `train` runs the reference training job, `bench` every benchmark.

Every package under `packages/` is found by itself (a folder with a `pyproject.toml`), so a new package joins the
matrix without touching this file. Each `tests` session gets a fresh virtualenv that holds ONLY that package, its
runtime dependencies and its `test` dependency group, at the versions in `uv.lock`: a test that passes there
proves the package needs nothing it does not declare.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = False
nox.options.sessions = ["lint", "types", "wheels", "tests", "integration"]

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"


def _read_pyproject(package: str) -> dict:
    with open(PACKAGES_DIR / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _package_version(package: str) -> str:
    """The version written in the package's `_version.py` (the file `[tool.hatch.version]` points at)."""
    path = PACKAGES_DIR / package / _read_pyproject(package)["tool"]["hatch"]["version"]["path"]
    match = re.search(r'^__version__ = "([^"]+)"$', path.read_text(), re.MULTILINE)
    assert match is not None, f"no __version__ line in {path}"
    return match[1]


def _discover_packages() -> list[str]:
    return sorted(p.name for p in PACKAGES_DIR.iterdir() if (p / "pyproject.toml").is_file())


PACKAGES = _discover_packages()


def _requirement_name(requirement: str) -> str:
    """`'torch>=2.6; python_version>"3"'` -> `'torch'` (normalized as in PEP 503)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert name is not None, f"cannot parse requirement {requirement!r}"
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def _workspace_closure(package: str) -> set[str]:
    """The workspace packages that `package` needs at run time, itself included."""
    seen: set[str] = set()
    todo = [package]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        deps = _read_pyproject(name)["project"].get("dependencies", [])
        todo.extend(dep for dep in map(_requirement_name, deps) if dep in PACKAGES)
    return seen


def _uv_sync(session: nox.Session, *args: str) -> None:
    """Install the locked versions into the session venv (`uv sync` reads uv.lock; `session.install` does not)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests in a venv with only that package and its declared (locked) dependencies."""
    _uv_sync(session, "--package", package, "--group", "test")
    allowed = _workspace_closure(package)
    session.run("python", "tools/check_isolation.py", json.dumps(sorted(allowed)), json.dumps(PACKAGES))
    junit = ROOT / ".nox" / f"junit-{package}.xml"
    # tools/test_readme_examples.py runs every ```python block of the package README in this same venv, so an
    # example that needs anything the package does not declare fails here.
    session.run(
        "python",
        "-m",
        "pytest",
        f"packages/{package}/tests",
        "tools/test_readme_examples.py",
        f"--junitxml={junit}",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={"AM_README": f"packages/{package}/README.md"},
    )


@nox.session
@nox.parametrize("package", PACKAGES)
def lowest(session: nox.Session, package: str) -> None:
    """Run one package's tests with the LOWEST versions its pyproject declares, so its lower bounds are true.

    Not part of CI (it downloads another torch build); run it before raising or lowering a bound:
    `uv run nox -s "lowest(package='am-precision')"`.
    """
    pyproject = _read_pyproject(package)
    test_deps = pyproject.get("dependency-groups", {}).get("test", [])
    siblings = [f"-e{PACKAGES_DIR / name}" for name in sorted(_workspace_closure(package))]
    # the shared test harness is a workspace member outside packages/ (not on PyPI): installed from its folder
    harness = [f"-e{ROOT / 'tools' / 'am-testing'}"] if "am-testing" in test_deps else []
    test_deps = [dep for dep in test_deps if dep != "am-testing"]
    session.install("--resolution", "lowest-direct", *siblings, *harness, *test_deps)
    session.run("python", "-m", "pytest", f"packages/{package}/tests", "-p", "no:cacheprovider", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository."""
    _uv_sync(session, "--only-group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def types(session: nox.Session) -> None:
    """Type-check every package's sources and the reference trainer with mypy, against the installed dependencies."""
    _uv_sync(session, "--all-packages", "--group", "dev")
    for package in PACKAGES:
        session.run("mypy", f"packages/{package}/src")
    session.run("mypy", "integration_tests/trainer")  # the reference trainer (am-reference-trainer)
    session.run("mypy", "tools/am-testing/src")  # the packages' shared test harness


def _expected_requires_dist(pyproject: dict) -> list[str]:
    project = pyproject["project"]
    expected = list(project.get("dependencies", []))
    for extra, deps in project.get("optional-dependencies", {}).items():
        expected += [f'{dep}; extra == "{extra}"' for dep in deps]
    return expected


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every package's wheel and sdist into `dist/`, check their metadata, then install each package from
    `dist/` alone into a fresh venv, the way the README shows (`pip install --find-links dist <package>`).

    Checks: each wheel declares exactly its pyproject's runtime dependencies and extras and ships `py.typed` and
    LICENSE (so does each sdist); each package installs from `dist/` with its workspace siblings resolved from there
    too (real installs, never editable; third-party versions pinned to uv.lock), imports from the venv's
    site-packages and reports its pyproject version.
    """
    _uv_sync(session, "--only-group", "dev")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run("uv", "build", "--package", package, "--out-dir", str(dist), "--quiet", external=True)
        normalized = package.replace("-", "_")
        version = _package_version(package)
        (wheel,) = dist.glob(f"{normalized}-{version}-*.whl")
        (sdist,) = dist.glob(f"{normalized}-{version}.tar.gz")
        expected = _expected_requires_dist(_read_pyproject(package))
        session.run("python", "tools/check_wheel.py", str(wheel), str(sdist), json.dumps(expected))
    # Third-party versions come from uv.lock; the workspace packages only from dist/.
    tmp = Path(session.create_tmp())
    constraints = tmp / "constraints.txt"
    session.run(
        "uv", "export", "--locked", "--all-packages", "--no-default-groups", "--no-emit-workspace", "--no-hashes",
        "--format", "requirements-txt", "--output-file", str(constraints), "--quiet", external=True,
    )  # fmt: skip
    for package in PACKAGES:
        venv = tmp / f"install-{package}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run("uv", "venv", "--quiet", str(venv), external=True)
        python = str(venv / "bin" / "python")
        session.run(
            "uv", "pip", "install", "--quiet", "--python", python, "--find-links", str(dist),
            "--constraints", str(constraints), package, external=True,
        )  # fmt: skip
        versions = {name: _package_version(name) for name in _workspace_closure(package)}
        session.run(python, "tools/check_install.py", package, json.dumps(versions), external=True)


@nox.session
def integration(session: nox.Session) -> None:
    """The integration tests: the reference trainer (integration_tests/) launched as real gloo processes with every
    workspace package and the `integration` group installed at the locked versions (parity, resume, faults, bad
    input, fp32 contract, training features). `--all-packages` includes the trainer's own workspace distribution
    (integration_tests/pyproject.toml), which provides the `am-train` command. About 22 minutes on 2 CPU cores."""
    _uv_sync(session, "--all-packages", "--group", "integration")
    junit = ROOT / ".nox" / "junit-integration.xml"
    session.run(
        "python",
        "-m",
        "pytest",
        "integration_tests/tests",
        "tools/test_readme_examples.py",
        "tools/test_vendoring.py",
        "tools/test_one_pytest_run.py",
        "tools/test_readme_dependencies.py",
        "tools/am-testing/tests",  # the shared harness itself (deadlines, stopped process trees)
        f"--junitxml={junit}",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={"AM_README": "README.md"},  # the repository README's examples need every package
    )


# The default training job: tiny Nemotron-H with multi-token prediction, pipeline 2 x data parallel 2 (4 processes).
DEFAULT_TRAIN_ARGS = ["--model", "nemotron", "--pp", "2", "--dp", "2"]


def _world_size(args: list[str]) -> int:
    """pp x dp x cp x tp from trainer arguments (`--pp 2` or `--pp=2`; absent = 1)."""
    sizes = {"--pp": 1, "--dp": 1, "--cp": 1, "--tp": 1}
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in sizes:
            sizes[name] = int(value or args[i + 1])
    return sizes["--pp"] * sizes["--dp"] * sizes["--cp"] * sizes["--tp"]


@nox.session
def train(session: nox.Session) -> None:
    """Run the reference training job with torchrun (gloo on the CPU, NCCL on GPUs), one process per mesh rank.

    `uv run nox -s train` runs the default (tiny Nemotron-H with MTP, pp=2 x dp=2); arguments after `--` replace it,
    e.g. `uv run nox -s train -- --model gemma4-moe --cp 2 --dp 2`. Outputs go to integration_tests/runs/default
    unless `--out` says otherwise.
    """
    _uv_sync(session, "--all-packages", "--group", "integration")
    args = list(session.posargs) or DEFAULT_TRAIN_ARGS
    nproc = _world_size(args)
    session.log(f"torchrun --nproc-per-node {nproc} integration_tests/train.py {shlex.join(args)}")
    session.run(
        "python", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "integration_tests/train.py", *args,
    )  # fmt: skip


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """GPU smoke kit (bench/gpu_smoke.py): bf16 training steps of both models per BackendConfig choice this CUDA
    machine supports, against the torch backend, plus NCCL on one rank; writes bench/results-gpu.json. Without CUDA
    it prints one line and succeeds. Runs in the invoking environment (no venv, no download), so it works on an
    offline GPU image with torch + transformers and the am-* wheels installed with `pip install --no-deps`."""
    session.run("python", "bench/gpu_smoke.py", *session.posargs, external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """Run every bench/bench_*.py and write bench/results.json and bench/results.md (ratios against references
    measured in the same run, with the date and the machine). Not part of CI: timings need a quiet machine."""
    _uv_sync(session, "--all-packages", "--group", "integration")
    session.run("python", "bench/run_all.py", *session.posargs)
