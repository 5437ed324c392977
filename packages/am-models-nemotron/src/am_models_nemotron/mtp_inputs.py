"""The per-depth fusion inputs of multi-token prediction, from whatever the caller provides.

What it is for: depth d (0-based) fuses the embedding of the token d + 1 places ahead with the hidden state. The
embeddings come, in this order of preference, from precomputed per-depth embeddings (a pipeline stage's extra
positional tensors, or a caller's), from per-depth token ids (context parallelism: shifted on the whole sequence
BEFORE sharding, so every block edge is right), or from shifting `input_ids` / `inputs_embeds` within each
document (id 0 / zeros past a document's end, so a packed row gives every document its own inputs).
What it must not do: shift across a document boundary, or accept per-depth inputs it does not use (conflicting or
malformed inputs are refused in one ValueError).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .mtp import shift_within_documents

__all__ = ["mtp_fusion_inputs", "per_depth"]


def per_depth(value: Sequence[torch.Tensor] | torch.Tensor | None) -> list[torch.Tensor] | None:
    """D tensors from a sequence or a [B, D, S(, H)] tensor."""
    if value is None:
        return None
    return list(value.unbind(1)) if isinstance(value, torch.Tensor) else list(value)


def mtp_fusion_inputs(
    *,
    depths: int,
    embed_tokens: nn.Module | None,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    embeds: Sequence[torch.Tensor] = (),
    per_depth_input_ids: Sequence[torch.Tensor] | torch.Tensor | None = None,
    per_depth_position_ids: Sequence[torch.Tensor] | torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The D fusion inputs [B, S, H] of MTP.

    input_ids: [B, S] ids (or None); inputs_embeds: [B, S, H] (used when there are no ids); seq_idx: [B, S]
    document ids; embeds: D precomputed [B, S, H]; per_depth_input_ids: D [B, S] ids (a sequence or [B, D, S]);
    per_depth_position_ids: their positions — the attention has no positional encoding, so they are only
    checked for shape (upstream passes them on its context-parallel path).

    Raises:
        ValueError: both embeddings and ids given, wrong counts or shapes, positions without ids, no embedding
            table for ids, nothing to build the inputs from (every problem listed).
    """
    reference = input_ids if input_ids is not None else inputs_embeds
    shape = tuple(reference.shape[:2]) if reference is not None else None
    ids = per_depth(per_depth_input_ids)
    positions = per_depth(per_depth_position_ids)
    problems = []
    if embeds and ids is not None:
        problems.append("pass either per-depth MTP embeddings (positional) or mtp_per_depth_input_ids, not both")
    for name, given in (
        ("MTP embeddings", list(embeds) or None),
        ("mtp_per_depth_input_ids", ids),
        (
            "mtp_per_depth_position_ids",
            positions,
        ),
    ):
        if given is not None and (
            len(given) != depths or (shape is not None and any(tuple(t.shape[:2]) != shape for t in given))
        ):
            problems.append(
                f"{name}: expected {depths} tensors of leading shape {shape}, got {[tuple(t.shape) for t in given]}"
            )
    if positions is not None and ids is None and not embeds:
        problems.append("mtp_per_depth_position_ids need mtp_per_depth_input_ids or per-depth embeddings")
    use_ids = ids is not None or (not embeds and input_ids is not None and not input_ids.is_floating_point())
    if use_ids and not embeds and embed_tokens is None:
        problems.append("MTP embeddings need embed_tokens, which this pipeline stage does not hold")
    if not embeds and not use_ids and inputs_embeds is None:
        problems.append("MTP needs token ids, inputs_embeds or per-depth embeddings to build its inputs")
    if problems:
        raise ValueError("Invalid MTP inputs:\n  - " + "\n  - ".join(problems))
    if embeds:
        return list(embeds)
    if ids is not None:
        assert embed_tokens is not None
        return [embed_tokens(t) for t in ids]
    if use_ids:
        assert embed_tokens is not None
        assert input_ids is not None
        return [embed_tokens(shift_within_documents(input_ids, d + 1, seq_idx=seq_idx)) for d in range(depths)]
    assert inputs_embeds is not None
    return [shift_within_documents(inputs_embeds, d + 1, seq_idx=seq_idx) for d in range(depths)]
