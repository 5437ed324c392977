"""Checkpoints of the reference trainer: exact resume, HF-format weights, atomic writes, verified reads.

A checkpoint is a folder `<out>/checkpoints/step_<N>/`:
    dcp/                 torch.distributed.checkpoint of every rank's model parts and optimizer state (sharded as
                         the run holds them: FSDP2 shards, pipeline stages), bit-exact
    model/               the full model in HF format (config.json + safetensors), loadable by transformers / our
                         `from_pretrained`; written by rank 0
    rng/rank<r>.pt       each rank's torch RNG state
    trainer_state.json   step, data-stream position, run arguments, loss history
    manifest.json        the sha256 of every other file of the folder, trainer_state.json included
`<out>/checkpoints/latest` names the newest complete checkpoint.

Writes are atomic: every rank writes under `step_<N>.tmp/`; after a barrier rank 0 writes the trainer state, then
the manifest, renames the folder and then replaces `latest`. A run killed mid-write leaves a `.tmp` folder that
resume ignores. `verify_checkpoint` runs before any process group exists, so a missing, corrupt or tampered
checkpoint (a changed step counter too) is refused up front; so is a file the manifest does not list.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_root(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def resolve_resume_dir(resume: str, out_dir: Path) -> Path:
    """`--resume latest` -> the folder named by `<out>/checkpoints/latest`; otherwise the given folder."""
    if resume != "latest":
        return Path(resume)
    pointer = checkpoint_root(out_dir) / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(
            f"--resume latest: {pointer} does not exist (no complete checkpoint under {checkpoint_root(out_dir)}); "
            "pass a checkpoint folder or start without --resume"
        )
    return checkpoint_root(out_dir) / pointer.read_text().strip()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(folder: Path) -> list[str]:
    """Problems that make `folder` unusable for resume (empty list = fine). Reads files only; no collectives.

    Every file of the folder must be listed in `manifest.json` with its sha256, and every listed file must exist
    and match.
    """
    if not folder.is_dir():
        return [f"checkpoint {folder} does not exist"]
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())["files"]
        if not isinstance(manifest, dict):
            raise TypeError(f"'files' is a {type(manifest).__name__}, not an object")
    except FileNotFoundError:
        return [f"checkpoint {folder} has no {MANIFEST_FILE}: it is incomplete (was the run killed while writing it?)"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return [f"checkpoint {folder}: {MANIFEST_FILE} is corrupt ({type(exc).__name__}: {exc})"]
    problems = []
    for relative, expected in sorted(manifest.items()):
        path = folder / relative
        if not path.is_file():
            problems.append(f"checkpoint {folder}: {relative} is missing")
        elif _sha256(path) != expected:
            problems.append(f"checkpoint {folder}: {relative} is corrupt (its sha256 differs from the manifest)")
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    problems += [
        f"checkpoint {folder}: {relative} is not in the manifest (added after the checkpoint was written?)"
        for relative in sorted(present - set(manifest))
    ]
    if STATE_FILE not in manifest and not problems:
        problems.append(f"checkpoint {folder}: the manifest does not cover {STATE_FILE}")
    return problems


def existing_checkpoints(out_dir: Path) -> list[str]:
    """Names of the complete checkpoints (and the `latest` pointer) under `<out>/checkpoints`, oldest first."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = sorted(p.name for p in root.iterdir() if p.name.startswith("step_") and not p.name.endswith(".tmp"))
    return found + (["latest"] if (root / "latest").exists() else [])


def out_dir_problems(out_dir: Path) -> list[str]:
    """Why the run could not write into `out_dir` (empty list = it can). Creates nothing that stays: the folder is
    probed with a temporary file (or, when it does not exist yet, its nearest existing parent with a temporary
    folder)."""
    import tempfile

    if out_dir.exists() and not out_dir.is_dir():
        return [f"--out {out_dir} is a file, not a folder; choose another --out"]
    probe_in = out_dir
    while not probe_in.exists():
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        return [f"--out {out_dir}: {probe_in} is a file, so the folder cannot be created; choose another --out"]
    try:
        if probe_in == out_dir:
            with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-probe-"):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=probe_in, prefix=".write-probe-"))
    except OSError as exc:
        return [f"--out {out_dir} is not writable ({exc.strerror or exc}); choose another --out"]
    return []


def read_trainer_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / STATE_FILE).read_text())


def _part_states(
    model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    # Keys are fully qualified names, unique across a rank's parts (layers keep their global index), so the parts'
    # dicts merge into one checkpoint namespace without prefixes.
    return [
        (get_model_state_dict(part), get_optimizer_state_dict(part, optimizer, options=_OPTIM_OPTIONS))
        for part, optimizer in zip(model_parts, optimizers, strict=True)
    ]


def _merge(parts: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"model": {}, "optim": {}}
    for model_state, optim_state in parts:
        merged["model"].update(model_state)
        merged["optim"].update(optim_state)
    return merged


def save_checkpoint(
    out_dir: Path,
    *,
    step: int,
    model_parts: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    trainer_state: dict[str, Any],
    export_hf: Callable[[Path], None],
) -> Path:
    """Write the checkpoint of `step` atomically (collective: every rank calls it). Returns the final folder.

    `export_hf(folder)` is called on every rank (it gathers the full weights, a collective) and must write the HF
    folder on rank 0 only.
    """
    rank = dist.get_rank()
    root = checkpoint_root(out_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    dcp.save(_merge(_part_states(model_parts, optimizers)), checkpoint_id=str(tmp / "dcp"))
    torch.save(torch.get_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    export_hf(tmp / "model")
    dist.barrier()
    if rank == 0:
        (tmp / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=1))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {str(p.relative_to(tmp)): _sha256(p) for p in files}
        (tmp / MANIFEST_FILE).write_text(json.dumps({"files": manifest}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(final.name)
        os.replace(pointer_tmp, root / "latest")
    dist.barrier()
    return final


def load_checkpoint(
    folder: Path,
    *,
    model_parts: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
) -> dict[str, Any]:
    """Restore model parts, optimizers and this rank's RNG from `folder` (collective). Returns the trainer state."""
    parts = _part_states(model_parts, optimizers)
    merged = _merge(parts)
    dcp.load(merged, checkpoint_id=str(folder / "dcp"))
    for part, optimizer, (model_keys, optim_keys) in zip(model_parts, optimizers, parts, strict=True):
        set_model_state_dict(part, {k: merged["model"][k] for k in model_keys})
        set_optimizer_state_dict(part, optimizer, {k: merged["optim"][k] for k in optim_keys}, options=_OPTIM_OPTIONS)
    rng_file = folder / "rng" / f"rank{dist.get_rank()}.pt"
    if not rng_file.is_file():
        raise FileNotFoundError(f"{rng_file} is missing: resume with the same world size as the checkpointed run")
    torch.set_rng_state(torch.load(rng_file, weights_only=True))
    return read_trainer_state(folder)
