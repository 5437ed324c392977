"""Transformer Engine modules with the two behaviours our training loop needs, as subclasses: no class is patched.

What it is for: `te_module_classes()` gives subclasses of TE's `RMSNorm`, `Linear` and `GroupedLinear` (built once,
lazily) whose forward adds
  1. the unallocated-input short-circuit: a forward on an input without storage (zero elements, meta or fake tensor)
     returns an empty output of the right shape instead of launching a kernel. It is off while
     `torch.compiler.is_compiling()`: fake tensors during tracing must flow through the real forward, or AOT
     autograd breaks.
  2. `is_first_microbatch` injection: when the caller passes None (or nothing), the forward receives the global
     flag from `am_precision.flags`, so TE's FP8 weight cache follows the training loop.
`with_te_behaviours(cls, ...)` builds such a subclass of any module class (tests use plain torch classes). A subclass
keeps its base's parameters, state-dict keys and `isinstance` checks, and leaves the base class (TE's own, used by
everyone else in the process) as it was. Upstream patches TE's classes in place instead: that lives in
`am_precision.upstream.patch_te_modules`, built on the forwards below.
What it must not do: import transformer_engine at import time (only `te_module_classes()` imports it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import flags

__all__ = [
    "TEModuleClasses",
    "empty_like_input",
    "empty_linear_output",
    "te_module_classes",
    "with_te_behaviours",
]

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


def _forward_parameters(cls: type[nn.Module]) -> list[inspect.Parameter]:
    params = list(inspect.signature(cls.forward).parameters.values())
    return params[1:]  # drop `self`


def short_circuit_forward(cls: type[nn.Module], original: Any, output_for: OutputFor) -> Any:
    """`original` (a forward of `cls`, first input the tensor) returning `output_for(module, inp)` instead when the
    input has no storage, except while torch.compile traces."""
    params = _forward_parameters(cls)
    input_name = params[0].name if params else None

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        inp = args[0] if args else kwargs.get(input_name) if input_name else None
        if isinstance(inp, torch.Tensor) and not torch.compiler.is_compiling() and flags.is_tensor_unallocated(inp):
            return output_for(self, inp)
        return original(self, *args, **kwargs)

    return functools.wraps(original)(forward)


def injecting_forward(cls: type[nn.Module], original: Any) -> Any:
    """`original` (a forward of `cls`) given the global `is_first_microbatch` flag when the caller passes None or
    nothing; an explicit value wins.

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

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if index is not None and len(args) > index:
            if args[index] is None:
                args = (*args[:index], flags.get_is_first_microbatch(), *args[index + 1 :])
        elif kwargs.get("is_first_microbatch") is None:
            kwargs["is_first_microbatch"] = flags.get_is_first_microbatch()
        return original(self, *args, **kwargs)

    return functools.wraps(original)(forward)


@functools.cache
def with_te_behaviours(
    cls: type[nn.Module], *, unallocated_output: OutputFor | None = None, inject_first_microbatch: bool = False
) -> type[nn.Module]:
    """A subclass of `cls` whose forward adds the behaviours asked for; `cls` itself is not modified.

    One class per arguments (cached), named after `cls`. Parameters, buffers, state-dict keys and `isinstance(m, cls)`
    are `cls`'s.

    Args:
        cls: module class whose forward takes the input tensor as its first argument.
        unallocated_output: builds the stand-in output for an input without storage (`empty_like_input`,
            `empty_linear_output`); None: no short-circuit.
        inject_first_microbatch: pass the global `is_first_microbatch` flag when the caller passes None.

    Raises:
        TypeError: `inject_first_microbatch` for a class whose forward has no `is_first_microbatch` parameter.
    """
    forward: Any = cls.forward
    if inject_first_microbatch:
        forward = injecting_forward(cls, forward)
    if unallocated_output is not None:
        forward = short_circuit_forward(cls, forward, unallocated_output)
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__})


@dataclass(frozen=True)
class TEModuleClasses:
    """Transformer Engine's module classes with our behaviours (`with_te_behaviours`): constructed like TE's own."""

    rms_norm: type[nn.Module]  # te.RMSNorm + the short-circuit (empty_like)
    linear: type[nn.Module]  # te.Linear + injection, then the short-circuit ([..., out_features])
    grouped_linear: type[nn.Module]  # te.GroupedLinear `(inp, m_splits, is_first_microbatch=None)` + injection


@functools.cache
def te_module_classes() -> TEModuleClasses:
    """Import Transformer Engine (first call only) and build its module classes with our behaviours.

    Raises:
        ImportError: transformer_engine.pytorch cannot be imported (not installed, or no CUDA).
    """
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise ImportError(
            "Transformer Engine modules need Transformer Engine, which needs CUDA: `pip install am-precision[te]` "
            f"on a machine with a GPU. Import of transformer_engine.pytorch failed: {err}"
        ) from err
    return TEModuleClasses(
        rms_norm=with_te_behaviours(te.RMSNorm, unallocated_output=empty_like_input),
        linear=with_te_behaviours(te.Linear, unallocated_output=empty_linear_output, inject_first_microbatch=True),
        grouped_linear=with_te_behaviours(te.GroupedLinear, inject_first_microbatch=True),
    )
