"""Run the ```python blocks of a README as written, each in a fresh process.

What it is for: every example a package README shows must run, top to bottom, on a CPU. A block whose first line is
`# torchrun --nproc-per-node N` runs under torchrun with N processes (gloo); any other block runs with the current
interpreter. Each block runs alone in an empty temporary folder (so it cannot lean on files of the repository) and
must exit 0. `tools/test_readme_examples.py` turns each block into one pytest case.
What it must not do: edit the README, or share state between blocks (a block that needs a name defines it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ExampleBlock", "extract_blocks", "run_block"]

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_TORCHRUN = re.compile(r"^#\s*torchrun\s+--nproc[-_]per[-_]node[ =](\d+)\s*$")


@dataclass(frozen=True)
class ExampleBlock:
    """One ```python block: where it starts (1-based line of its fence) and how to run it."""

    readme: Path
    line: int
    code: str
    nproc: int | None  # None: plain python; N: torchrun with N processes

    @property
    def name(self) -> str:
        return f"{self.readme.name}:{self.line}"


def extract_blocks(readme: Path) -> list[ExampleBlock]:
    """Every ```python block of `readme`, in order."""
    text = readme.read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(text):
        code = match.group(1)
        first = code.splitlines()[0] if code.strip() else ""
        launcher = _TORCHRUN.match(first.strip())
        blocks.append(
            ExampleBlock(
                readme=readme,
                line=text.count("\n", 0, match.start()) + 1,
                code=code,
                nproc=int(launcher.group(1)) if launcher else None,
            )
        )
    return blocks


def run_block(block: ExampleBlock, *, timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
    """Run `block` in a fresh temporary folder; returns the finished process (stdout and stderr captured)."""
    with tempfile.TemporaryDirectory(prefix="readme-example-") as folder:
        script = Path(folder) / "example.py"
        script.write_text(block.code, encoding="utf-8")
        if block.nproc is None:
            command = [sys.executable, str(script)]
        else:
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={block.nproc}", str(script),
            ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop("PYTHONPATH", None)  # examples import the installed packages, nothing from the repository
        result = subprocess.run(
            command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if block.nproc is not None and _only_gloo_exit_abort(result):
            # gloo sometimes aborts a rank at interpreter exit, after barrier + destroy_process_group (environment.md:
            # "Gloo aborts at exit now and then"): the example's work is done; run it once more, and judge that run.
            result = subprocess.run(
                command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        return result


def _only_gloo_exit_abort(result: subprocess.CompletedProcess[str]) -> bool:
    """The run failed only by gloo's abort at exit: no Python traceback from the example's own ranks, and the abort."""
    if result.returncode == 0 or "terminate called without an active exception" not in result.stderr:
        return False
    before_torchrun = result.stderr.split("torch/distributed/elastic", 1)[0]
    return "Traceback (most recent call last)" not in before_torchrun
