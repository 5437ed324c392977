"""Checkpoints of the reference trainer: exact resume, HF-format weights, atomic writes, verified reads.

A checkpoint is a folder `<out>/checkpoints/step_<N>/`:
    dcp/                 torch.distributed.checkpoint of every rank's model parts and optimizer state (sharded as
                         the run holds them: FSDP2 shards, pipeline stages), bit-exact
    model/               the full model in HF format (config.json + safetensors), loadable by transformers / our
                         `from_pretrained`; streamed by one writer per pipeline stage (trainer/export.py: no rank
                         holds the whole model), the files named and config.json written by rank 0
    rng/rank<r>.pt       each rank's torch RNG state
    trainer_state.json   step, data-stream position, run arguments, loss history, how the HF export was written
                         (`hf_export`: files, shard budget, each writer's bytes and peak bytes held)
    manifest.json        the sha256 of every other file of the folder, trainer_state.json included
`<out>/checkpoints/latest` names the newest complete checkpoint.

Writes are atomic: every rank writes under `step_<N>.tmp/`; after a barrier rank 0 writes the trainer state, then
the manifest, renames the folder and then replaces `latest`. A run killed mid-write leaves a `.tmp` folder that
resume ignores. `verify_checkpoint` runs before any process group exists, so a missing, corrupt or tampered
checkpoint (a changed step counter too) is refused up front; so is a file the manifest does not list.

Before writing, every rank checks (trainer/guards.py) that its weights are finite (a NaN or infinite weight stops
the run: `latest` never names such a checkpoint) and that the disk has room for the estimated bytes of the whole
checkpoint. A write that fails anyway because the disk filled up (OSError ENOSPC, or torch's `[enforce fail at
inline_container.cc] ... unexpected pos`) is reported as "no space left on device" with the sizes; either way the
partial `step_<N>.tmp/` is removed and `latest` keeps naming the previous checkpoint.
Test seam: AM_TRAIN_DISK_FREE_BYTES=<bytes> replaces the free bytes the disk reports (a tiny quota, without
filling the real disk).
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

from trainer.guards import (
    RunStopped,
    checkpoint_bytes_estimate,
    is_no_space_error,
    no_space_message,
    nonfinite_parameters,
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
    # dicts merge into one checkpoint namespace without prefixes; plain-tensor TP shards get per-tp-rank keys.
    from trainer.tensor_parallel import rename_tp_local

    states = []
    for part, optimizer in zip(model_parts, optimizers, strict=True):
        model_state = get_model_state_dict(part)
        optim_state = get_optimizer_state_dict(part, optimizer, options=_OPTIM_OPTIONS)
        rename_tp_local(part, model_state, optim_state, back=False)
        states.append((model_state, optim_state))
    return states


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
    export_hf: Callable[[Path], dict[str, Any] | None],
) -> Path:
    """Write the checkpoint of `step` atomically (collective: every rank calls it). Returns the final folder.

    `export_hf(folder)` is called on every rank (a collective: trainer/export.py streams the weights to one writer
    per stage); what it returns on rank 0 (its report, or None) is recorded as `hf_export` in the trainer state.
    """
    rank = dist.get_rank()
    root = checkpoint_root(out_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    needed = _check_before_writing(root, step=step, model_parts=model_parts, optimizers=optimizers)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    try:
        dcp.save(_merge(_part_states(model_parts, optimizers)), checkpoint_id=str(tmp / "dcp"))
        torch.save(torch.get_rng_state(), tmp / "rng" / f"rank{rank}.pt")
        export_report = export_hf(tmp / "model")
        dist.barrier()
        if rank == 0:
            state = {**trainer_state, "step": step, "hf_export": export_report}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            files = sorted(p for p in tmp.rglob("*") if p.is_file())
            manifest = {str(p.relative_to(tmp)): _sha256(p) for p in files}
            (tmp / MANIFEST_FILE).write_text(json.dumps({"files": manifest}, indent=1))
    except BaseException as exc:  # dcp's CheckpointException is a BaseException
        # No rank renames a .tmp folder before this point, so `latest` still names the previous checkpoint.
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space_error(exc):
            raise RunStopped(no_space_message(root, needed=needed, free=free_bytes(root), step=step)) from exc
        raise
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(final.name)
        os.replace(pointer_tmp, root / "latest")
    dist.barrier()
    return final


def free_bytes(folder: Path) -> int:
    """Free bytes of the disk holding `folder` (or its nearest existing parent); AM_TRAIN_DISK_FREE_BYTES replaces
    the disk's answer (tests: a tiny quota without filling the real disk)."""
    override = os.environ.get("AM_TRAIN_DISK_FREE_BYTES")
    if override is not None:
        return int(override)
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _check_before_writing(
    root: Path, *, step: int, model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> int:
    """Collective: refuse (RunStopped, on every rank alike) weights holding NaN / inf on any rank, and a disk
    without room for the whole checkpoint (estimated, summed over the ranks; rank 0's view of the disk decides).
    Returns the estimated bytes of the checkpoint."""
    bad = nonfinite_parameters(model_parts)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    estimate = checkpoint_bytes_estimate(model_parts, optimizers)
    facts = torch.tensor([float(len(bad)), float(estimate)], dtype=torch.float64, device=device)
    dist.all_reduce(facts)  # every rank learns the totals, so every rank takes the same decision
    nonfinite, needed = int(facts[0]), int(facts[1]) + _METADATA_BYTES * dist.get_world_size()
    if nonfinite:
        mine = f" (this rank: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''})" if bad else ""
        raise RunStopped(
            f"step {step}: {nonfinite} weight tensor(s) hold NaN or infinite values{mine}, so no checkpoint of this "
            "step is written and `latest` still names the last finite one: lower --lr and resume from it"
        )
    free = torch.tensor([float(free_bytes(root)) if dist.get_rank() == 0 else 0.0], dtype=torch.float64, device=device)
    dist.broadcast(free, src=0)
    if needed > int(free):
        raise RunStopped(no_space_message(root, needed=needed, free=int(free), step=step))
    return needed


_METADATA_BYTES = 64 * 1024  # per rank: RNG state, DCP metadata, config.json, trainer state, manifest (generous)


def load_checkpoint(
    folder: Path,
    *,
    model_parts: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
) -> dict[str, Any]:
    """Restore model parts, optimizers and this rank's RNG from `folder` (collective). Returns the trainer state."""
    from trainer.tensor_parallel import rename_tp_local

    parts = _part_states(model_parts, optimizers)
    merged = _merge(parts)
    dcp.load(merged, checkpoint_id=str(folder / "dcp"))
    for part, optimizer, (model_keys, optim_keys) in zip(model_parts, optimizers, parts, strict=True):
        model_state = {k: merged["model"][k] for k in model_keys}
        optim_state = {k: merged["optim"][k] for k in optim_keys}
        rename_tp_local(part, model_state, optim_state, back=True)
        set_model_state_dict(part, model_state)
        set_optimizer_state_dict(part, optimizer, optim_state, options=_OPTIM_OPTIONS)
    rng_file = folder / "rng" / f"rank{dist.get_rank()}.pt"
    if not rng_file.is_file():
        raise FileNotFoundError(f"{rng_file} is missing: resume with the same world size as the checkpointed run")
    torch.set_rng_state(torch.load(rng_file, weights_only=True))
    return read_trainer_state(folder)
