"""Reference training job composing the am-* packages (see trainer/loop.py for the order of things).

uv run nox -s train                                               # the default: Nemotron-H + MTP, pp=2 x dp=2
torchrun --nproc-per-node 4 integration_tests/train.py --pp 2 --dp 2 --steps 200
torchrun --nproc-per-node 4 integration_tests/train.py --model gemma4-moe --cp 2 --dp 2
python integration_tests/train.py --help
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer.loop import main

if __name__ == "__main__":
    raise SystemExit(main())
