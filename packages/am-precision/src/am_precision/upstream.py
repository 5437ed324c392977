"""NeMo AutoModel's spellings of am-precision that the core does not use, built on the core; the core never imports
this module.

Upstream's lazy TE patcher (`_make_lazy_te_patcher()` → `_patch_te_modules`, the seed documents' 7.9) replaces the
`forward` of Transformer Engine's `RMSNorm`, `Linear` and `GroupedLinear` classes for the whole process. The core
builds subclasses instead (`am_precision.te_modules`, used by `initialize_linear_module("te")` and
`initialize_rms_norm_module("te")`), which leaves TE's classes untouched; the functions below are for code that
builds TE modules itself and relies on upstream's process-wide behaviour. The forwards they install are the core's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from .te_modules import OutputFor, empty_like_input, empty_linear_output, injecting_forward, short_circuit_forward

__all__ = [
    "apply_te_patches",
    "patch_first_microbatch_injection",
    "patch_te_modules",
    "patch_unallocated_short_circuit",
]

_MARK = "_am_precision_patches"
_SHORT_CIRCUIT = "unallocated_short_circuit"
_INJECT = "first_microbatch_injection"


def _install(cls: type[nn.Module], behaviour: str, make_forward: Callable[[Any], Any]) -> bool:
    # A marker on the installed forward keeps every patch idempotent, also through subclasses.
    original = cls.forward
    done: frozenset[str] = getattr(original, _MARK, frozenset())
    if behaviour in done:
        return False
    patched = make_forward(original)
    setattr(patched, _MARK, done | {behaviour})
    cls.forward = patched
    return True


def patch_unallocated_short_circuit(cls: type[nn.Module], *, output_for: OutputFor) -> bool:
    """Replace `cls.forward` (in place, process-wide) by one returning `output_for(module, inp)` when its first input
    has no storage (skipped while torch.compile traces).

    Returns:
        True if the class was patched now, False if it already carried this patch.
    """
    return _install(cls, _SHORT_CIRCUIT, lambda original: short_circuit_forward(cls, original, output_for))


def patch_first_microbatch_injection(cls: type[nn.Module]) -> bool:
    """Replace `cls.forward` (in place, process-wide) by one receiving the global `is_first_microbatch` flag when the
    caller passes None or nothing.

    Returns:
        True if the class was patched now, False if it already carried this patch.

    Raises:
        TypeError: `cls.forward` has no `is_first_microbatch` parameter.
    """
    injecting_forward(cls, cls.forward)  # raises the TypeError before anything is installed
    return _install(cls, _INJECT, lambda original: injecting_forward(cls, original))


def apply_te_patches(
    *,
    norm_classes: Iterable[type[nn.Module]] = (),
    linear_classes: Iterable[type[nn.Module]] = (),
    grouped_linear_classes: Iterable[type[nn.Module]] = (),
) -> None:
    """Patch the given classes in place with upstream's TE behaviours (idempotent).

    - norm classes: unallocated short-circuit returning `empty_like(inp)`;
    - linear classes: `is_first_microbatch` injection, then the short-circuit returning [..., out_features];
    - grouped linear classes (`forward(inp, m_splits, is_first_microbatch=None)`): injection only.
    """
    for cls in norm_classes:
        patch_unallocated_short_circuit(cls, output_for=empty_like_input)
    for cls in linear_classes:
        patch_first_microbatch_injection(cls)
        patch_unallocated_short_circuit(cls, output_for=empty_linear_output)
    for cls in grouped_linear_classes:
        patch_first_microbatch_injection(cls)


_te_patched = False


def patch_te_modules() -> None:
    """Upstream's `_patch_te_modules`: import Transformer Engine and patch its `RMSNorm`, `Linear` and `GroupedLinear`
    classes in place, once per process.

    Raises:
        ImportError: transformer_engine.pytorch cannot be imported (not installed, or no CUDA).
    """
    global _te_patched
    if _te_patched:
        return
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise ImportError(
            "patch_te_modules needs Transformer Engine, which needs CUDA: `pip install am-precision[te]` on a "
            f"machine with a GPU. Import of transformer_engine.pytorch failed: {err}"
        ) from err
    apply_te_patches(
        norm_classes=(te.RMSNorm,), linear_classes=(te.Linear,), grouped_linear_classes=(te.GroupedLinear,)
    )
    _te_patched = True
