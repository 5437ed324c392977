"""The fp32 contract report: every parameter and buffer, its dtype, and the keep rule that pins it.

What it is for: `fp32_report(model)` lists each tensor with the rule (keyword, strict or not) that pins it to fp32
and whether it breaks the contract that `cast_model_to_dtype` establishes; `assert_fp32_contract(model)` raises
listing every violation. Users and integration tests call it after casting and after FSDP2 wrapping.
What it must not do: change the model, or trigger collectives (it reads local metadata; a DTensor's dtype is its
local shard's dtype).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .casting import _check_skip_modules, _skipped_tensor_ids, is_dtensor
from .keep_rules import KeepRule, fp32_keep_rules, match_keep_rule

__all__ = ["Fp32Report", "TensorPrecision", "assert_fp32_contract", "fp32_report"]


def _short(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorPrecision:
    """One parameter or buffer in an fp32 report.

    Attributes:
        name: dotted name (as `named_parameters` / `named_buffers` give it, wrappers included).
        kind: "param" or "buffer".
        dtype: its dtype.
        is_dtensor: whether it is a DTensor (e.g. FSDP2-sharded).
        rule: the keep rule matching the name, or None.
        expected_dtype: what the contract requires: fp32 for pinned floating tensors, the storage dtype for other
            floating tensors when one was given, else None (no requirement).
        note: why a matched tensor is not required to be fp32, or that it belongs to a skipped module.
    """

    name: str
    kind: Literal["param", "buffer"]
    dtype: torch.dtype
    is_dtensor: bool
    rule: KeepRule | None
    expected_dtype: torch.dtype | None
    note: str = ""

    @property
    def pinned(self) -> bool:
        """Whether the contract pins this tensor to fp32."""
        return self.rule is not None and self.expected_dtype == torch.float32

    @property
    def violation(self) -> str | None:
        """A sentence describing the breach, or None when the tensor satisfies the contract."""
        if self.expected_dtype is None or self.dtype == self.expected_dtype:
            return None
        why = f"pinned by {self.rule}" if self.pinned else "not pinned"
        return f"{self.kind} {self.name!r} is {_short(self.dtype)}, expected {_short(self.expected_dtype)} ({why})"


@dataclass(frozen=True)
class Fp32Report:
    """All tensors of a model with their precision status; `str()` renders a table."""

    entries: tuple[TensorPrecision, ...]

    @property
    def violations(self) -> tuple[TensorPrecision, ...]:
        return tuple(e for e in self.entries if e.violation is not None)

    @property
    def pinned(self) -> tuple[TensorPrecision, ...]:
        return tuple(e for e in self.entries if e.pinned)

    def __getitem__(self, name: str) -> TensorPrecision:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(f"no parameter or buffer named {name!r} in this report")

    def __str__(self) -> str:
        header = ("name", "kind", "dtype", "dtensor", "keep rule", "expected", "status")
        rows = [
            (
                e.name,
                e.kind,
                _short(e.dtype),
                "yes" if e.is_dtensor else "",
                "" if e.rule is None else str(e.rule),
                _short(e.expected_dtype) if e.expected_dtype is not None else "",
                ("VIOLATION" if e.violation else "ok") + (f" ({e.note})" if e.note else ""),
            )
            for e in self.entries
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        counts = f"{len(self.entries)} tensors, {len(self.pinned)} pinned to fp32, {len(self.violations)} violations"
        lines.append(counts)
        return "\n".join(lines)


def fp32_report(
    model: nn.Module,
    *,
    storage_dtype: torch.dtype | None = None,
    skip_modules: Iterable[str] = (),
) -> Fp32Report:
    """Report every parameter and buffer (shared ones under each name) against the fp32 contract.

    The contract (the one `cast_model_to_dtype` establishes): floating tensors matched by a keep rule are fp32,
    except DTensor parameters matched only by a non-strict rule (FSDP2 keeps one dtype per group; noted, not
    required). With `storage_dtype`, every other floating tensor must be in that dtype. Tensors under
    `skip_modules` carry no requirement.

    Args:
        model: the model (plain, activation-checkpointed or FSDP2-sharded).
        storage_dtype: the dtype unpinned floating tensors must have, or None to check pinned tensors only.
        skip_modules: as for `cast_model_to_dtype`.
    """
    rules = fp32_keep_rules(model)
    skipped = _skipped_tensor_ids(model, _check_skip_modules(skip_modules))
    named: list[tuple[str, Literal["param", "buffer"], torch.Tensor]] = [
        *((n, "param", p) for n, p in model.named_parameters(remove_duplicate=False)),
        *((n, "buffer", b) for n, b in model.named_buffers(remove_duplicate=False)),
    ]
    entries = []
    for name, kind, tensor in named:
        rule = match_keep_rule(name, rules)
        sharded = is_dtensor(tensor)
        expected: torch.dtype | None = None
        note = ""
        if id(tensor) in skipped:
            note = "skipped module"
        elif tensor.is_floating_point():
            if rule is not None and (kind == "buffer" or rule.strict or not sharded):
                expected = torch.float32
            else:
                expected = storage_dtype
                if rule is not None:
                    note = "non-strict rule on an FSDP2-sharded param: not pinned"
        entries.append(TensorPrecision(name, kind, tensor.dtype, sharded, rule, expected, note))
    return Fp32Report(tuple(entries))


def assert_fp32_contract(
    model: nn.Module,
    *,
    storage_dtype: torch.dtype | None = None,
    skip_modules: Iterable[str] = (),
) -> Fp32Report:
    """`fp32_report(...)`, raising when any tensor breaks the contract.

    Returns:
        The report, when there is no violation.

    Raises:
        AssertionError: listing every violation, followed by the full report table.
    """
    report = fp32_report(model, storage_dtype=storage_dtype, skip_modules=skip_modules)
    if report.violations:
        listed = "\n".join(f"  - {e.violation}" for e in report.violations)
        raise AssertionError(f"fp32 contract violated by {len(report.violations)} tensor(s):\n{listed}\n\n{report}")
    return report
