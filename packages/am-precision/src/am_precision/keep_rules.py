"""fp32 keep rules: which parameters and buffers a model pins to fp32, read from HF's class attributes.

What it is for: turn `_keep_in_fp32_modules_strict` and `_keep_in_fp32_modules` into ordered `KeepRule`s and
match them against dotted tensor names (substring match, after stripping wrapper segments such as activation
checkpointing's `_checkpoint_wrapped_module.`). Shared by the casting functions and the fp32 report.
What it must not do: touch tensors, or silently ignore a malformed keep list (a bare string would match by
character; we raise instead).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

__all__ = ["WRAPPER_SEGMENTS", "KeepRule", "canonical_name", "fp32_keep_rules", "match_keep_rule"]

# Segments that wrappers insert into parameter names; the keep lists are written against the unwrapped names.
WRAPPER_SEGMENTS: tuple[str, ...] = (
    "_checkpoint_wrapped_module.",  # torch activation checkpointing (checkpoint_wrapper)
    "_orig_mod.",  # torch.compile's OptimizedModule
    "_fsdp_wrapped_module.",  # FSDP1
)


@dataclass(frozen=True)
class KeepRule:
    """One fp32 keep keyword. `strict` rules (from `_keep_in_fp32_modules_strict`) also pin FSDP2-sharded params."""

    keyword: str
    strict: bool

    def matches(self, name: str) -> bool:
        """Whether the dotted `name` (raw or with wrapper segments removed) contains the keyword."""
        return self.keyword in name or self.keyword in canonical_name(name)

    def __str__(self) -> str:
        return f"{self.keyword!r} ({'strict' if self.strict else 'non-strict'})"


def canonical_name(name: str) -> str:
    """`name` with wrapper segments (`WRAPPER_SEGMENTS`) removed, e.g. `layers.0._checkpoint_wrapped_module.norm`
    -> `layers.0.norm`."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _keywords(model: nn.Module | type[nn.Module], attribute: str) -> list[str]:
    value = getattr(model, attribute, None)
    if value is None:
        return []
    owner = model.__name__ if isinstance(model, type) else type(model).__name__
    if isinstance(value, (set, frozenset)):
        entries: Iterable[object] = sorted(value, key=repr)  # sets have no order; make the result deterministic
    elif isinstance(value, (list, tuple)):
        entries = value
    else:
        raise TypeError(
            f"{owner}.{attribute} must be a list, tuple or set of name substrings, got "
            f"{type(value).__name__} {value!r}" + (f"; write [{value!r}]" if isinstance(value, str) else "")
        )
    bad = [e for e in entries if not isinstance(e, str) or not e]
    if bad:
        raise TypeError(f"{owner}.{attribute} must hold non-empty strings (name substrings); invalid entries: {bad!r}")
    return [e for e in entries if isinstance(e, str)]


def fp32_keep_rules(model: nn.Module | type[nn.Module]) -> tuple[KeepRule, ...]:
    """The fp32 keep rules of a model (or model class): strict keywords first, then non-strict ones, deduplicated in
    order.

    A keyword listed in both attributes is strict. `None` attributes mean "no rules". Passing the class lets code
    without an instance (a checkpoint converter) apply the same rules as the casts.

    Raises:
        TypeError: an attribute is not a list/tuple/set of non-empty strings (e.g. a bare string).
    """
    rules: dict[str, KeepRule] = {}
    for keyword in _keywords(model, "_keep_in_fp32_modules_strict"):
        rules.setdefault(keyword, KeepRule(keyword, strict=True))
    for keyword in _keywords(model, "_keep_in_fp32_modules"):
        rules.setdefault(keyword, KeepRule(keyword, strict=False))
    return tuple(rules.values())


def match_keep_rule(name: str, rules: Iterable[KeepRule]) -> KeepRule | None:
    """The first rule (strict rules come first) whose keyword occurs in `name`, or None."""
    return next((rule for rule in rules if rule.matches(name)), None)
