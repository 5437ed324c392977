"""Checkpoints of the reference trainer: exact resume, HF-format weights, atomic writes, verified reads.

A checkpoint is a folder `<out>/checkpoints/step_<N>/`:
    dcp/                 torch.distributed.checkpoint of every rank's model parts and optimizer state (sharded as
                         the run holds them: FSDP2 shards, pipeline stages), bit-exact
    model/               the full model in HF format (config.json + safetensors), loadable by transformers / our
                         `from_pretrained`; written by rank 0
    rng/rank<r>.pt       each rank's torch RNG state
    trainer_state.json   step, data-stream position, run arguments, loss history and a sha256 manifest of every file
`<out>/checkpoints/latest` names the newest complete checkpoint.

Writes are atomic: every rank writes under `step_<N>.tmp/`; after a barrier rank 0 writes the manifest, renames
the folder and then replaces `latest`. A run killed mid-write leaves a `.tmp` folder that resume ignores.
`verify_checkpoint` runs before any process group exists, so a missing or corrupt checkpoint is refused up front.
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
    """Problems that make `folder` unusable for resume (empty list = fine). Reads files only; no collectives."""
    if not folder.is_dir():
        return [f"checkpoint {folder} does not exist"]
    state_path = folder / STATE_FILE
    try:
        state = json.loads(state_path.read_text())
        manifest: dict[str, str] = state["manifest"]
    except FileNotFoundError:
        return [f"checkpoint {folder} has no {STATE_FILE}: it is incomplete (was the run killed while writing it?)"]
    except (json.JSONDecodeError, KeyError) as exc:
        return [f"checkpoint {folder}: {STATE_FILE} is corrupt ({exc})"]
    problems = []
    for relative, expected in sorted(manifest.items()):
        path = folder / relative
        if not path.is_file():
            problems.append(f"checkpoint {folder}: {relative} is missing")
        elif _sha256(path) != expected:
            problems.append(f"checkpoint {folder}: {relative} is corrupt (its sha256 differs from the manifest)")
    return problems


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
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {str(p.relative_to(tmp)): _sha256(p) for p in files}
        state = {**trainer_state, "step": step, "manifest": manifest}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
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
