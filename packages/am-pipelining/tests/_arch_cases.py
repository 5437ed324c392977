"""Cases for the broad-architecture pipeline test, run inside the gloo ranks started once by `_dist.run_ranks`.

Each architecture of `_arch_models.ARCHS` is split into 2 stages (pp=2, 1F1B, one layer per stage) and either
matches the unsplit transformers model (its own forward, per microbatch: loss and every gradient within `REL_TOL`)
or is refused before any stage is built with an error naming the feature.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import _arch_models as A
import pytest
import torch
from _cases import _compare, _mesh

from am_pipelining import build_pipeline_schedule, split_model_into_stages, validate_hf_model_for_pipeline_support

BATCH = 2
MICROBATCH = 1


def _reference(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    losses = []
    for i in range(0, BATCH, MICROBATCH):
        logits = model(input_ids=data["input_ids"][i : i + MICROBATCH]).logits
        loss = A.mean_ce(logits, data["labels"][i : i + MICROBATCH])
        loss.backward()
        losses.append(loss.detach())
    return losses


def arch_case(name: str) -> None:
    """The pipelined model reproduces the unsplit one, or the split is refused naming the feature."""
    _, _, refusal = A.ARCHS[name]
    ref_model = A.build(name)
    model = copy.deepcopy(ref_model)
    if refusal is not None:
        with pytest.raises(ValueError, match="not compatible with pipeline parallelism") as validated:
            validate_hf_model_for_pipeline_support(model)
        assert refusal in str(validated.value), str(validated.value)
        with pytest.raises(ValueError, match="cannot reproduce") as split:
            split_model_into_stages(model, _mesh(), "pp", "1F1B", "cpu", microbatch_size=MICROBATCH, seq_len=A.SEQ)
        assert refusal in str(split.value), str(split.value)
        return
    validate_hf_model_for_pipeline_support(model)
    data = A.batch(BATCH)
    ref_losses = _reference(ref_model, data)
    stages, parts = split_model_into_stages(
        model, _mesh(), "pp", "1F1B", "cpu", microbatch_size=MICROBATCH, seq_len=A.SEQ
    )
    schedule = build_pipeline_schedule(None, "1F1B", MICROBATCH, BATCH, stages, A.mean_ce)
    has_first = any(stage.is_first for stage in stages)
    losses: list[torch.Tensor] = []
    schedule.step(*((data["input_ids"],) if has_first else ()), target=data["labels"], losses=losses)
    _compare(ref_model, parts, losses, ref_losses, any(stage.is_last for stage in stages))


def cases_archs() -> dict[str, Callable[[], None]]:
    return {f"arch-{name}": functools.partial(arch_case, name) for name in A.ARCHS}
