"""What the last pipeline stage returns, by name: `StageOutput` and the model's declared output names.

torch.distributed.pipelining hands the last stage's return value to the loss unchanged, but treats only a PLAIN
tuple as several outputs (`type(output) is tuple` in `stage._normalize_model_output_as_tuple`): a NamedTuple or
dataclass becomes ONE non-tensor output, and the last stage's backward then fails (`'...' object has no attribute
'_is_view'` when it detaches its outputs). So stages return a tensor or a plain tuple of tensors, and a stage module
whose last-stage tuple carries more than logits DECLARES what each position is, in its contract (am-model-contract;
model packages never import this one):

    def am_contract(self) -> ModelContract:
        return ModelContract(pp=PipelineContract(output_names=("logits", "mtp_per_depth_h", "seq_idx")))

Each name is a `StageOutput` field. The per-depth fields (`mtp_per_depth_h`, `mtp_per_depth_logits`) take every
tensor between the fixed names before and after them, so one declaration covers any number of MTP depths;
`logits` is required. `read_stage_output` turns a stage's return value into a `StageOutput` by these names; the
pipeline loss reads fields by name and never guesses from dtypes or shapes.

Without a declaration, a tuple keeps upstream's meaning: `(logits, *mtp_per_depth)`.

This module does no communication and imports neither transformers nor a model package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from am_model_contract import contract_of

__all__ = [
    "StageOutput",
    "STAGE_OUTPUT_FIELDS",
    "PER_DEPTH_FIELDS",
    "pipeline_output_names",
    "output_names_problems",
    "read_stage_output",
]


class StageOutput(NamedTuple):
    """The named parts of a last stage's output.

    Attributes:
        logits: [B, S, V] main logits.
        mtp_per_depth_h: D multi-token-prediction hidden states [B, S, H] (projected by the LM head in the loss).
        mtp_per_depth_logits: D multi-token-prediction logits [B, S, V] (give these or the hidden states).
        seq_idx: [B, S] packed-sequence ids of the microbatch (int), so MTP targets never cross sequences.
    """

    logits: torch.Tensor
    mtp_per_depth_h: tuple[torch.Tensor, ...] = ()
    mtp_per_depth_logits: tuple[torch.Tensor, ...] = ()
    seq_idx: torch.Tensor | None = None


STAGE_OUTPUT_FIELDS: tuple[str, ...] = StageOutput._fields
PER_DEPTH_FIELDS: tuple[str, ...] = ("mtp_per_depth_h", "mtp_per_depth_logits")


def pipeline_output_names(module: Any) -> tuple[str, ...] | None:
    """The last-stage output names a stage module (or model) declares in its contract (`pp.output_names`), None when
    it declares none."""
    return None if module is None else contract_of(module).pp.output_names


def output_names_problems(names: Sequence[str], *, owner: str = "pipeline_output_names") -> list[str]:
    """Why `names` is not a valid declaration (empty list when it is)."""
    problems = []
    unknown = [name for name in names if name not in STAGE_OUTPUT_FIELDS]
    if unknown:
        problems.append(f"{owner} {tuple(names)} has unknown names {unknown}: use {', '.join(STAGE_OUTPUT_FIELDS)}.")
    repeated = sorted({name for name in names if list(names).count(name) > 1})
    if repeated:
        problems.append(f"{owner} {tuple(names)} repeats {repeated}: name each field once.")
    groups = [name for name in names if name in PER_DEPTH_FIELDS]
    if len(groups) > 1:
        problems.append(f"{owner} {tuple(names)} has several per-depth fields {groups}: give at most one.")
    if "logits" not in names:
        problems.append(f"{owner} {tuple(names)} has no 'logits': the main loss needs them.")
    return problems


def _arity_problem(names: Sequence[str], count: int) -> str | None:
    fixed = [name for name in names if name not in PER_DEPTH_FIELDS]
    if len(fixed) == len(names) and count != len(names):
        return f"the stage returned {count} tensors but pipeline_output_names {tuple(names)} declares {len(names)}"
    if count < len(fixed):
        return (
            f"the stage returned {count} tensors but pipeline_output_names {tuple(names)} declares at least "
            f"{len(fixed)}"
        )
    return None


def read_stage_output(
    output: Any, *, names: Sequence[str] | None = None, mtp_outputs_are_logits: bool = False
) -> StageOutput:
    """The named parts of a last stage's `output`.

    Args:
        output: a tensor (logits), a `StageOutput`, a plain tuple of tensors, or an object with `logits` /
            `mtp_per_depth_h` / `mtp_per_depth_logits` / `seq_idx` attributes (e.g. a model's own output).
        names: the stage's `pipeline_output_names`; without them a tuple is `(logits, *mtp_per_depth)`.
        mtp_outputs_are_logits: for undeclared tuples, whether the MTP entries are logits (else hidden states).

    Raises:
        ValueError: an invalid declaration, or a tuple whose length does not fit it.
    """
    if isinstance(output, StageOutput):
        return output
    if isinstance(output, torch.Tensor):
        return StageOutput(logits=output)
    if isinstance(output, (tuple, list)):
        if names is None:
            rest = tuple(output[1:])
            if mtp_outputs_are_logits:
                return StageOutput(logits=output[0], mtp_per_depth_logits=rest)
            return StageOutput(logits=output[0], mtp_per_depth_h=rest)
        problems = output_names_problems(names)
        arity = _arity_problem(names, len(output))
        if arity is not None:
            problems.append(arity)
        if problems:
            raise ValueError("Cannot read the last pipeline stage's output: " + "; ".join(problems) + ".")
        return _by_name(list(output), list(names))
    fields = {name: getattr(output, name, None) for name in STAGE_OUTPUT_FIELDS}
    logits = fields["logits"] if fields["logits"] is not None else output
    return StageOutput(
        logits=logits,
        mtp_per_depth_h=tuple(fields["mtp_per_depth_h"] or ()),
        mtp_per_depth_logits=tuple(fields["mtp_per_depth_logits"] or ()),
        seq_idx=fields["seq_idx"],
    )


def _by_name(values: list[Any], names: list[str]) -> StageOutput:
    group = next((i for i, name in enumerate(names) if name in PER_DEPTH_FIELDS), None)
    if group is None:
        parts: dict[str, Any] = dict(zip(names, values, strict=True))
    else:
        after = len(names) - group - 1
        parts = dict(zip(names[:group], values[:group], strict=True))
        parts.update(zip(names[group + 1 :], values[len(values) - after :], strict=True))
        parts[names[group]] = tuple(values[group : len(values) - after])
    return StageOutput(**parts)
