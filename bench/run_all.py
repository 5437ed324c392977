"""Run every package benchmark and collect their ratios into bench/results.json and bench/results.md.

    python bench/run_all.py                 # every bench/bench_*.py, one after the other
    python bench/run_all.py pipelining      # only bench_pipelining.py
    python bench/run_all.py --collect-only  # rebuild results.json / results.md from bench/results/*.json

Each `bench_<name>.py` measures its own code against a reference IN THE SAME RUN and writes
`bench/results/<name>.json`; this script runs them, then keeps every ratio they report (numeric entries whose key
contains "ratio", "_over_" or "speedup": ours vs the reference, or one configuration over another) with the date,
the machine, the load average and the exit status of each benchmark. What it must not do: invent a reference or
compare numbers from different runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS_DIR = BENCH / "results"
RATIO_MARKERS = ("ratio", "_over_", "speedup")


def _machine() -> dict[str, Any]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _ratios(data: Any, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf whose key names a ratio, keyed by its dotted path."""
    found: dict[str, float] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if any(marker in str(key) for marker in RATIO_MARKERS):
                    found[path] = float(value)
            else:
                found.update(_ratios(value, path))
    return found


def run_benchmarks(names: list[str]) -> dict[str, dict[str, Any]]:
    status: dict[str, dict[str, Any]] = {}
    for name in names:
        script = BENCH / f"bench_{name}.py"
        print(f"--- {script.name}", flush=True)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, str(script)], cwd=BENCH.parent, check=False)
        status[name] = {"exit_code": done.returncode, "wall_s": round(time.perf_counter() - started, 1)}
    return status


def write_summary(status: dict[str, dict[str, Any]]) -> dict[str, Any]:
    today = datetime.date.today().isoformat()
    benchmarks: dict[str, Any] = {}
    for path in sorted(RESULTS_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        benchmarks[path.stem] = {"ratios": _ratios(data), **status.get(path.stem, {})}
    summary = {
        "date": today,
        "machine": _machine(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "benchmarks": benchmarks,
    }
    (BENCH / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    machine = summary["machine"]
    where = machine["gpu"] or f"{machine['cpu_count']} CPU cores"
    lines = [
        f"Measured {today} on {where} ({machine['platform']}, torch {machine['torch']}), load average "
        f"{summary['load_average_1min']:.1f}; each ratio compares two things timed in the same run.",
        "",
        "| benchmark | ratio | value |",
        "|---|---|---:|",
    ]
    for name, entry in benchmarks.items():
        for key, value in entry["ratios"].items():
            lines.append(f"| {name} | `{key}` | {value:.3g} |")
    (BENCH / "results.md").write_text("\n".join(lines) + "\n")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: every bench_*.py)")
    parser.add_argument("--collect-only", action="store_true", help="only rebuild results.json / results.md")
    args = parser.parse_args()
    available = sorted(p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py"))
    unknown = sorted(set(args.names) - set(available))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {available}")
    status = {} if args.collect_only else run_benchmarks(args.names or available)
    summary = write_summary(status)
    print((BENCH / "results.md").read_text())
    failed = [name for name, entry in status.items() if entry["exit_code"] != 0]
    if failed:
        print(f"benchmarks that failed: {failed}", file=sys.stderr)
    return 1 if failed or not summary["benchmarks"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
