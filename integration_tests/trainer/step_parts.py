"""The pieces of a training step the loop composes: the loss over label tokens, gradient clipping by the global
norm, and the HF-format export.

What it is for: `TokenSumLoss` (fp32 cross-entropy sum over the global batch's label tokens), `clip_grad_norm`
(one norm over every pipeline stage, FSDP2 shard and expert mesh; a tied embedding's output copy counted once),
`make_hf_exporter` (gathers the full weights, rank 0 writes them with the model's `save_pretrained`).
What it must not do: decide the layout (parallel.py) or run the loop (loop.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from am_moe import quiet_expert_gathers
from trainer.models import ModelSpec
from trainer.parallel import apply_precision


class TokenSumLoss:
    """`(logits [B, S, V], labels [B, S]) -> scalar`: fp32 cross-entropy SUM over non-ignored labels divided by
    `denominator` (the label-token count of the whole global batch, set before each step)."""

    def __init__(self) -> None:
        self.denominator = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return total / self.denominator


# ------------------------------------------------------------------------------------------------------------------
# Gradient clipping over pipeline stages and FSDP2 shards
# ------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def clip_grad_norm(parts: list[nn.Module], *, max_norm: float, pp_group: Any) -> torch.Tensor:
    """Clip all gradients of this rank's parts by the GLOBAL norm (all stages, all shards); returns that norm.

    The output copy of a tied embedding (a pipeline duplicate holding the same summed gradient) is left out of the
    norm, so the norm equals the unsplit model's; it is still scaled like every other gradient.
    """
    from torch.distributed.tensor import DTensor

    from am_pipelining.tied import tied_embedding_copies

    duplicates = {
        id(dict(model.named_parameters())[copy.param_name])
        for model, copy in tied_embedding_copies(parts)
        if copy.role == "output"
    }
    # Under EP the experts' gradients are DTensors on (expert_dp, ep) and the others on dp_cp; DTensor ops do not mix
    # meshes, so norms and scaling run per mesh, in parameter order (shared by every rank of a stage, so the
    # full_tensor collectives line up).
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for part in parts:
        for p in part.parameters():
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in by_mesh.values():
        grads = [p.grad for p in params if id(p) not in duplicates and p.grad is not None]
        if grads:
            mesh_norm = torch.nn.utils.get_total_norm(grads, 2.0)
            norms.append((mesh_norm.full_tensor() if isinstance(mesh_norm, DTensor) else mesh_norm).float())
    norm = norms[0] if norms else torch.zeros(())  # one mesh: exactly the norm computed without EP
    if len(norms) > 1:
        norm = torch.stack(norms).square().sum().sqrt()
    if dist.get_world_size(pp_group) > 1:
        squared = norm**2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


# ------------------------------------------------------------------------------------------------------------------
# HF-format export (gathers the full weights on rank 0)
# ------------------------------------------------------------------------------------------------------------------


def _full_state_dict(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full: dict[str, torch.Tensor] = {}
    for part in parts:
        with quiet_expert_gathers():  # EP: experts on (expert_dp, ep) gather back to full [E, ...] tensors
            state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        full.update({k: v.detach().cpu() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return full


def make_hf_exporter(spec: ModelSpec, parts: list[nn.Module], *, dtype: str, shard_rank: int) -> Any:
    """`export(folder)`: collective; rank 0 writes the whole model as an HF-format folder.

    Every rank gathers its parts' full weights (FSDP2 all-gather); one rank per pipeline stage (dp_cp rank 0) sends
    them to rank 0, which loads them strictly into a fresh model of the same spec and calls its `save_pretrained`.
    NOTE: this gathers the full model in CPU memory on rank 0 — right for the tiny models here; a large model would
    write per-stage safetensors shards instead.
    """

    def export(folder: Path) -> None:
        state = _full_state_dict(parts)
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(state if shard_rank == 0 else {}, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return
        merged: dict[str, torch.Tensor] = {}
        for piece in gathered:
            merged.update(piece)
        fresh = spec.build()
        apply_precision(fresh, dtype=dtype)
        fresh.load_state_dict(merged, strict=True)
        spec.save(fresh, folder)

    return export


__all__ = ["TokenSumLoss", "clip_grad_norm", "make_hf_exporter"]
