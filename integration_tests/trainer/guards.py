"""What stops a training run that would otherwise go on silently wrong: non-finite numbers and a full disk.

What it is for:
  - `StepGuard`: after every step's loss and global gradient norm (the same numbers on every rank: the loss is
    all-reduced, the norm is global), a non-finite value stops the run with `RunStopped` naming the step and the
    value, on every rank at once (no rank waits on another in a collective), or, with `--skip-nonfinite-steps N`,
    skips the optimizer step (gradients dropped, weights unchanged) at most N times, counted.
  - `nonfinite_parameters`: the names of a rank's parameters holding NaN or infinity; a checkpoint of such weights is
    never written (so `latest` never points at one).
  - `model_path_nonfinite_problems`: a NaN or infinity in a `--model-path` folder's safetensors files, named with the
    tensor and the file, refused before the run builds; a rank of an N-rank job reads only its 1 / N share.
  - `checkpoint_bytes_estimate` / `no_space_message`: the bytes a checkpoint needs against the free bytes of its
    disk, said in plain words ("no space left on device") instead of torch's `unexpected pos`.
What it must not do: run a collective itself (the loop and checkpoint.py decide which ranks take part), or change a
number it checks.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

EXIT_RUN_STOPPED = 3  # a run that started and was stopped by a guard (2 is bad input, refused before the start)


class RunStopped(Exception):
    """The run cannot go on without producing wrong numbers or a broken checkpoint; the message says why and what
    to do. Raised on every rank at the same point (the values it is raised for are the same on every rank)."""


class StepGuard:
    """Checks one step's loss and gradient norm; counts the steps skipped under `--skip-nonfinite-steps`.

    `skipped`: the steps whose optimizer update was dropped, in order (kept in the checkpoint, so a resumed run
    counts on from where it stopped).
    """

    def __init__(self, *, max_skips: int, skipped: Sequence[int] = ()) -> None:
        self.max_skips = max_skips
        self.skipped = list(skipped)
        self.last_problem = ""  # the last non-finite step, in words: "step 2: non-finite gradient norm nan"

    def check(self, step: int, *, loss: float, grad_norm: float) -> bool:
        """True: the step is finite, apply it. False: skip its optimizer update (allowed and counted).

        Raises:
            RunStopped: a non-finite loss or gradient norm, with no skip left.
        """
        values = (("loss", loss), ("gradient norm", grad_norm))
        # repr: 'nan', 'inf', '-inf', or the number
        bad = [f"{name} {float(value)!r}" for name, value in values if not math.isfinite(value)]
        if not bad:
            return True
        self.last_problem = f"step {step}: non-finite {' and '.join(bad)}"
        if len(self.skipped) < self.max_skips:
            self.skipped.append(step)
            return False
        allowed = (
            f"--skip-nonfinite-steps {self.max_skips} allowed {self.max_skips} skipped step(s) and "
            f"{len(self.skipped)} were skipped already (steps {self.skipped})"
            if self.max_skips
            else "no step may be skipped (pass --skip-nonfinite-steps N to drop up to N such steps)"
        )
        raise RunStopped(
            f"{self.last_problem}; the weights were not updated and no checkpoint of this "
            f"step is written. {allowed}. `latest` (if any) names the last checkpoint, whose weights are finite: lower "
            "--lr (or raise --warmup-steps) and resume from it, or check the data and the model"
        )


def nonfinite_parameters(parts: Iterable[nn.Module]) -> list[str]:
    """Names of this rank's parameters and buffers (its own shards of DTensors) that hold NaN or +-inf."""
    from torch.distributed.tensor import DTensor

    bad = []
    for part in parts:
        for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if local.is_floating_point() and local.numel() and not bool(torch.isfinite(local.detach()).all()):
                bad.append(name)
    return bad


def _value_check_share(keys: list[tuple[str, str, int]], *, part: int, parts: int) -> set[tuple[str, str]]:
    """The (file, key) pairs part `part` of `parts` checks: every tensor of `keys` ((file, key, bytes), the same list on
    every rank) goes to exactly one part, the biggest first to the part with the fewest bytes so far (ties: the lower
    part), so each part reads about 1 / parts of the checkpoint."""
    load = [0] * parts
    mine: set[tuple[str, str]] = set()
    for file, key, nbytes in sorted(keys, key=lambda entry: (-entry[2], entry[0], entry[1])):
        owner = min(range(parts), key=lambda index: (load[index], index))
        load[owner] += nbytes
        if owner == part:
            mine.add((file, key))
    return mine


def model_path_nonfinite_problems(folder: str | Path, *, part: int = 0, parts: int = 1) -> list[str]:
    """A NaN or infinity in a `--model-path` folder's weights, one line per tensor (tensor and file named), in file
    and key order.

    Reads the safetensors files tensor by tensor (no process group, no model). `part` of `parts`: only this part's
    share of the tensors is read (`_value_check_share`: split by bytes, the same split for every caller), so `parts`
    ranks together read the checkpoint once and their lines together are the lines of `parts=1`. Other weight
    formats are not read here.
    """
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    sizes = []
    for path in files:  # the headers only: names, shapes, dtypes
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                piece = f.get_slice(key)
                sizes.append((path.name, key, math.prod(piece.get_shape()) * _dtype_bytes(piece.get_dtype())))
    mine = _value_check_share(sizes, part=part, parts=parts)
    problems = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                if (path.name, key) not in mine:
                    continue
                tensor = f.get_tensor(key)
                if not tensor.is_floating_point():
                    continue
                nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
                if nan or inf:
                    what = " and ".join(f"{n} {k}" for n, k in ((nan, "NaN"), (inf, "infinite")) if n)
                    problems.append(
                        f"--model-path {folder}: tensor {key!r} in {path.name} holds {what} value(s) of "
                        f"{tensor.numel()}; training from it gives NaN losses: repair or re-export the weights"
                    )
    return problems


def _dtype_bytes(name: str) -> int:
    """Bytes per element of a safetensors dtype name ("F32", "BF16", "F8_E4M3", "I64", "BOOL", ...)."""
    digits = "".join(ch for ch in name.split("_")[0] if ch.isdigit())
    return max(1, int(digits) // 8) if digits else 1


# DCP writes every tensor as its own serialized record and lists it in its metadata: about 6 KiB each beyond the
# data (measured on torch 2.x; it dominates for the tiny test models and vanishes for real ones).
_BYTES_PER_TENSOR = 6 * 1024


def checkpoint_bytes_estimate(parts: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes this rank writes into a checkpoint, estimated: its parameters, buffers and optimizer state (local
    shards, plus a per-tensor overhead), and its parameters once more for the HF export (streamed by one writer per
    stage, trainer/export.py; the sum over ranks covers it)."""
    from trainer.step_memory import local_numel

    def nbytes(tensor: torch.Tensor) -> int:
        return local_numel(tensor) * tensor.element_size() + _BYTES_PER_TENSOR

    total = 0
    for part in parts:
        total += sum(2 * nbytes(p) for p in part.parameters()) + sum(nbytes(b) for b in part.buffers())
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def no_space_message(folder: Path, *, needed: int, free: int, step: int) -> str:
    return (
        f"no space left on device: the checkpoint of step {step} needs about {needed:,} bytes "
        f"({needed / 2**20:,.1f} MiB) under {folder}, and the disk has {free:,} bytes ({free / 2**20:,.1f} MiB) "
        "free; the partial folder was removed and `latest` still names the previous checkpoint. Free some space "
        "(or choose another --out, or a larger --ckpt-every) and resume with --resume latest"
    )


def is_no_space_error(exc: BaseException) -> bool:
    """True for a write that failed because the disk is full: OSError(ENOSPC), or torch's serializer's
    `[enforce fail at inline_container.cc] ... unexpected pos` RuntimeError (its report of a short write)."""
    seen: BaseException | None = exc
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:  # dcp wraps a rank's failure; look through the chain
        visited.add(id(seen))
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if "No space left on device" in text or ("inline_container" in text and "unexpected pos" in text):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


__all__ = [
    "EXIT_RUN_STOPPED",
    "RunStopped",
    "StepGuard",
    "checkpoint_bytes_estimate",
    "is_no_space_error",
    "model_path_nonfinite_problems",
    "no_space_message",
    "nonfinite_parameters",
]
