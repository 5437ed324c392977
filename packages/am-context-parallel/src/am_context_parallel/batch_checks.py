"""Every check of a CP batch, made before anything in it changes; each raises one ValueError listing every problem.

What it must not do: modify the batch or communicate (so a refusal leaves the caller's batch as it was, on every rank
alike).
"""

from __future__ import annotations

from typing import Any

import torch

from .batch_keys import _PRIMARY_KEYS, _SeqKey


def _validate(
    batch: dict[str, Any],
    keys: dict[str, _SeqKey],
    *,
    required: list[str],
    primary_keys: tuple[str, ...] = _PRIMARY_KEYS,
) -> None:
    """Raise one ValueError listing every problem with the batch (nothing has been modified yet): its sequence `keys`
    (and a 2-D attention_mask; a 4-D one is only read for its diagonal) and the `required` keys it must hold."""
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None and attention_mask.dim() == 2:
        keys = {**keys, "attention_mask": _SeqKey(1, 0, False)}
    problems = []
    present = [k for k in _PRIMARY_KEYS if batch.get(k) is not None]
    if len(present) != 1:
        what = "both" if present else "neither"
        problems.append(
            f"context parallelism requires exactly one of 'input_ids' or 'inputs_embeds' in the batch; got {what}"
        )
    elif present[0] not in primary_keys:
        problems.append(
            f"the model accepts only {list(primary_keys)} under context parallelism (its "
            f"ContiguousCPOptions.primary_keys), got '{present[0]}': a model that embeds its own shard needs the "
            "token ids"
        )
    if batch.get("labels") is None:
        problems.append(
            "context parallelism requires 'labels' in the batch (or labels passed as `loss_mask`): the loss is "
            "computed on the sharded sequence, so labels must be sharded with it"
        )
    problems += [f"sequence buffer '{key}' is missing from the batch" for key in required if key not in batch]
    if len(present) == 1:
        reference_key = present[0]
        reference = batch[reference_key]
        b, s = reference.shape[0], reference.shape[1] if reference.dim() >= 2 else None
        if reference.dim() < 2:
            problems.append(f"'{reference_key}' must be [B, S, ...]; got shape {tuple(reference.shape)}")
        for key, spec in keys.items():
            value = batch.get(key)
            if value is None or s is None:
                continue
            if not isinstance(value, torch.Tensor):
                problems.append(f"'{key}' must be a tensor; got {type(value).__name__}")
            elif value.dim() <= max(spec.seq_dim, spec.batch_dim):
                problems.append(
                    f"'{key}' has shape {tuple(value.shape)} but its sequence dim is {spec.seq_dim}; it needs at "
                    f"least {max(spec.seq_dim, spec.batch_dim) + 1} dims (fix the declared sequence dim or the tensor)"
                )
            else:
                if value.shape[spec.seq_dim] != s:
                    problems.append(
                        f"'{key}' has {value.shape[spec.seq_dim]} tokens on its sequence dim {spec.seq_dim} "
                        f"(shape {tuple(value.shape)}) but '{reference_key}' has S={s}; every sequence tensor of "
                        "the batch must have the same length"
                    )
                if value.shape[spec.batch_dim] not in (1, b):
                    problems.append(
                        f"'{key}' has batch size {value.shape[spec.batch_dim]} on dim {spec.batch_dim} "
                        f"(shape {tuple(value.shape)}) but '{reference_key}' has B={b}"
                    )
    if problems:
        raise ValueError("cannot shard the batch for context parallelism:\n  - " + "\n  - ".join(problems))


_REMOVED_BATCH_HOOK = "_cp_make_batch_fn"


def _check_token_tensors(batch: dict[str, Any]) -> None:
    """Token ids and labels must be integer tensors and labels must have the batch size of the inputs: checked on
    every path (identity included), since a float id or a label row that belongs to no input row trains wrongly
    without an error further down (labels are not broadcast)."""
    problems = []
    for key in ("input_ids", "labels"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
        ):
            problems.append(
                f"'{key}' must be an integer tensor of token ids{' (-100 = ignore)' * (key == 'labels')}; got "
                f"{value.dtype}: cast with .long()"
                + (", or pass embeddings as 'inputs_embeds'" if key == "input_ids" else "")
            )
    labels = batch.get("labels")
    primary_key = next((k for k in _PRIMARY_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
    if isinstance(labels, torch.Tensor) and primary_key is not None:
        primary = batch[primary_key]
        if labels.dim() >= 1 and primary.dim() >= 1 and labels.shape[0] != primary.shape[0]:
            problems.append(
                f"'labels' has batch size {labels.shape[0]} (shape {tuple(labels.shape)}) but '{primary_key}' has "
                f"B={primary.shape[0]} (shape {tuple(primary.shape)}); labels are not broadcast: give one label row "
                "per input row"
            )
    if problems:
        raise ValueError("cannot shard the batch for context parallelism:\n  - " + "\n  - ".join(problems))


def _refuse_function_in_batch(batch: dict[str, Any]) -> None:
    if _REMOVED_BATCH_HOOK in batch:
        raise ValueError(
            f"batch[{_REMOVED_BATCH_HOOK!r}] is no longer read (am-context-parallel 0.2: no function travels inside a "
            "batch). A model that shards contiguously declares it in its contract instead — `am_contract()` with "
            '`ContextParallelContract(layout="contiguous", options=...)`, options returning a ContiguousCPOptions — '
            "and the caller "
            "passes the model: `make_cp_batch_and_ctx(mesh, batch, model=model)`. Remove the key from the batch "
            "(Gemma 4 >= 0.2 no longer adds it)."
        )
