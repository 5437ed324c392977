"""TensorBoard logging of the reference trainer (rank 0 only): `--tensorboard DIR`, on by default when installed.

What it is for: scalars per step (`train/loss`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`; MoE
models `train/expert_imbalance`, transformers MoE models `train/aux_loss`) and per
validation (`val/loss`) into `<out>/tb` (or `--tensorboard DIR`), through `torch.utils.tensorboard.SummaryWriter`.
`--tensorboard off` (or `--no-tensorboard`) turns it off. When the `tensorboard` package is missing, the default is
off and the log says so; an explicit `--tensorboard DIR` is then refused before the run starts (`tensorboard_problems`).
What it must not do: write from ranks other than 0, or fail a run that did not ask for TensorBoard.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import RunConfig

OFF = "off"
INSTALL = "pip install tensorboard"


def tensorboard_available() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


def tensorboard_dir(cfg: RunConfig) -> Path | None:
    """Where this run logs (None: off): `--tensorboard DIR`, else `<out>/tb` when tensorboard is installed."""
    if cfg.tensorboard == OFF:
        return None
    if cfg.tensorboard is not None:
        return Path(cfg.tensorboard)
    return cfg.out / "tb" if tensorboard_available() else None


def tensorboard_problems(cfg: RunConfig) -> list[str]:
    """An explicit `--tensorboard DIR` that cannot be honoured (the package is missing)."""
    if cfg.tensorboard not in (None, OFF) and not tensorboard_available():
        return [
            f"--tensorboard {cfg.tensorboard}: the tensorboard package is not installed ({INSTALL}); install it or "
            "drop the option"
        ]
    return []


class TensorBoardLog:
    """Scalars to TensorBoard on rank 0 (`enabled`); a no-op elsewhere or when off."""

    def __init__(self, cfg: RunConfig, *, enabled: bool) -> None:
        self.writer: Any = None
        self.folder = tensorboard_dir(cfg) if enabled else None
        if not enabled:
            return
        if self.folder is None:
            why = "--tensorboard off" if cfg.tensorboard == OFF else f"tensorboard is not installed ({INSTALL})"
            print(f"TensorBoard logging off: {why}", file=sys.stderr, flush=True)
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.folder))
        print(f"TensorBoard logs: {self.folder} (tensorboard --logdir {self.folder})", file=sys.stderr, flush=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


__all__ = ["OFF", "TensorBoardLog", "tensorboard_available", "tensorboard_dir", "tensorboard_problems"]
