"""Forward patches for Transformer Engine modules, written so they apply to any module class.

What it is for: two behaviours TE modules need in our training loop, installed once per class:
  1. unallocated-input short-circuit: a forward on an input without storage (zero elements, meta or fake tensor)
     returns an empty output of the right shape instead of launching a kernel. It is disabled while
     `torch.compiler.is_compiling()`: fake tensors during tracing must flow through the real forward, or AOT
     autograd breaks.
  2. `is_first_microbatch` injection: when the caller passes None (or nothing), the forward receives the global
     flag from `am_precision.flags`, so TE's FP8 weight cache follows the training loop.
`apply_te_patches` takes the classes to patch (tests use plain torch classes); `patch_te_modules` applies it to TE.
What it must not do: import transformer_engine at import time (only `patch_te_modules()` imports it), or wrap a
class twice (a marker on the wrapped forward makes every patch idempotent, also through subclasses).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from . import flags

__all__ = [
    "apply_te_patches",
    "empty_like_input",
    "empty_linear_output",
    "patch_first_microbatch_injection",
    "patch_te_modules",
    "patch_unallocated_short_circuit",
]

_MARK = "_am_precision_patches"
_SHORT_CIRCUIT = "unallocated_short_circuit"
_INJECT = "first_microbatch_injection"

OutputFor = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def empty_like_input(module: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    """Output stand-in for shape-preserving modules (norms): `empty_like(inp)`."""
    return torch.empty_like(inp)


def empty_linear_output(module: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    """Output stand-in for linear layers. inp: [..., in] -> empty [..., out] with inp's dtype and device."""
    out_features = getattr(module, "out_features", None)
    if out_features is None:
        weight = module.weight
        assert isinstance(weight, torch.Tensor), f"{type(module).__name__} has neither out_features nor a weight"
        out_features = weight.shape[0]
    return inp.new_empty((*inp.shape[:-1], int(out_features)))


def _install(cls: type[nn.Module], behaviour: str, make_forward: Callable[[Any], Any]) -> bool:
    original = cls.forward
    done: frozenset[str] = getattr(original, _MARK, frozenset())
    if behaviour in done:
        return False
    patched = functools.wraps(original)(make_forward(original))
    setattr(patched, _MARK, done | {behaviour})
    cls.forward = patched
    return True


def _forward_parameters(cls: type[nn.Module]) -> list[inspect.Parameter]:
    params = list(inspect.signature(cls.forward).parameters.values())
    return params[1:]  # drop `self`


def patch_unallocated_short_circuit(cls: type[nn.Module], *, output_for: OutputFor) -> bool:
    """Make `cls.forward` return `output_for(module, inp)` when its first input has no storage.

    The short-circuit is skipped under `torch.compiler.is_compiling()` (fake tensors must reach the real forward).

    Args:
        cls: module class whose forward takes the input tensor as its first argument.
        output_for: builds the stand-in output, e.g. `empty_like_input` or `empty_linear_output`.

    Returns:
        True if the class was patched now, False if it already carried this patch.
    """
    params = _forward_parameters(cls)
    input_name = params[0].name if params else None

    def make_forward(original: Any) -> Any:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            inp = args[0] if args else kwargs.get(input_name) if input_name else None
            if isinstance(inp, torch.Tensor) and not torch.compiler.is_compiling() and flags.is_tensor_unallocated(inp):
                return output_for(self, inp)
            return original(self, *args, **kwargs)

        return forward

    return _install(cls, _SHORT_CIRCUIT, make_forward)


def patch_first_microbatch_injection(cls: type[nn.Module]) -> bool:
    """Make `cls.forward` receive the global `is_first_microbatch` flag when the caller passes None or nothing.

    Returns:
        True if the class was patched now, False if it already carried this patch.

    Raises:
        TypeError: `cls.forward` has no `is_first_microbatch` parameter.
    """
    params = _forward_parameters(cls)
    names = [p.name for p in params]
    if "is_first_microbatch" not in names:
        raise TypeError(
            f"{cls.__qualname__}.forward{inspect.signature(cls.forward)} has no 'is_first_microbatch' parameter; "
            "only modules that accept it (TE Linear, GroupedLinear, ...) can receive the global flag"
        )
    param = params[names.index("is_first_microbatch")]
    positional = param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    index = names.index("is_first_microbatch") if positional else None

    def make_forward(original: Any) -> Any:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if index is not None and len(args) > index:
                if args[index] is None:
                    args = (*args[:index], flags.get_is_first_microbatch(), *args[index + 1 :])
            elif kwargs.get("is_first_microbatch") is None:
                kwargs["is_first_microbatch"] = flags.get_is_first_microbatch()
            return original(self, *args, **kwargs)

        return forward

    return _install(cls, _INJECT, make_forward)


def apply_te_patches(
    *,
    norm_classes: Iterable[type[nn.Module]] = (),
    linear_classes: Iterable[type[nn.Module]] = (),
    grouped_linear_classes: Iterable[type[nn.Module]] = (),
) -> None:
    """Install the TE behaviours on the given classes (idempotent).

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
    """Import Transformer Engine and patch its `RMSNorm`, `Linear` and `GroupedLinear` once per process.

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
