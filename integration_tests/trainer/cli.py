"""The `am-train` console command: the reference trainer's command line (same options as train.py).

    am-train --model llama --steps 50                                      # one process
    am-train --config integration_tests/configs/example.toml --steps 20    # options from a TOML file
    torchrun --nproc-per-node 4 --no-python am-train --pp 2 --dp 2          # four ranks (torchrun runs the command)

What it must not do: differ from `python integration_tests/train.py` in any way (both call `trainer.loop.main`).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from trainer.loop import main as run_main

    return run_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
