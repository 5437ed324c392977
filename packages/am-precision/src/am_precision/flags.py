"""Process-wide precision flags and cheap capability probes.

What it is for: whether Transformer Engine (TE) is installed, whether it can run here (TE needs CUDA), the two
training-loop flags that drive TE's FP8 weight cache, and `is_tensor_unallocated`.
What it must not do: import transformer_engine (presence is probed with `importlib.util.find_spec`), or decide
CUDA availability at import time (a process may import us before it picks a device; we ask at call time).
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = [
    "HAVE_DEEP_EP",
    "HAVE_GMM",
    "HAVE_TE",
    "HAVE_UCCL_EP",
    "IS_FIRST_MICROBATCH",
    "IS_OPTIM_STEP",
    "get_is_first_microbatch",
    "get_is_optim_step",
    "is_tensor_unallocated",
    "set_is_first_microbatch",
    "set_is_optim_step",
    "te_usable",
]


def _installed(module_name: str) -> bool:
    # find_spec on a top-level name never executes the package, so a broken CUDA setup cannot fail our import.
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


HAVE_TE: bool = _installed("transformer_engine")
HAVE_DEEP_EP: bool = _installed("deep_ep")
HAVE_UCCL_EP: bool = _installed("uccl_ep")
HAVE_GMM: bool = _installed("grouped_gemm")


def te_usable() -> bool:
    """True when Transformer Engine is installed and CUDA is available right now (TE cannot run without CUDA)."""
    return HAVE_TE and torch.cuda.is_available()


# FP8 weight caching under gradient accumulation (TE's `is_first_microbatch` argument):
#   True  -> first micro-batch after an optimizer step: quantize the weights and cache them,
#   False -> later micro-batches: reuse the cached FP8 weights,
#   None  -> caching disabled (TE quantizes on every call).
# Module attributes under upstream's names; read them through the getters (a `from ... import` copies the value).
IS_FIRST_MICROBATCH: bool | None = None
IS_OPTIM_STEP: bool = False


def set_is_first_microbatch(value: bool | None) -> None:
    """Set the global `is_first_microbatch` flag that patched TE modules inject when the caller passes None.

    Raises:
        TypeError: `value` is not True, False or None.
    """
    global IS_FIRST_MICROBATCH
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"is_first_microbatch must be True, False or None, got {value!r} ({type(value).__name__})")
    IS_FIRST_MICROBATCH = value


def get_is_first_microbatch() -> bool | None:
    """The global `is_first_microbatch` flag (None = FP8 weight caching disabled)."""
    return IS_FIRST_MICROBATCH


def set_is_optim_step(value: bool) -> None:
    """Mark whether the current micro-batch is the one followed by an optimizer step.

    Raises:
        TypeError: `value` is not a bool.
    """
    global IS_OPTIM_STEP
    if not isinstance(value, bool):
        raise TypeError(f"is_optim_step must be a bool, got {value!r} ({type(value).__name__})")
    IS_OPTIM_STEP = value


def get_is_optim_step() -> bool:
    """Whether the current micro-batch is followed by an optimizer step (default False)."""
    return IS_OPTIM_STEP


def _is_fake(tensor: torch.Tensor) -> bool:
    # Asking a FakeTensor for its data pointer warns (and will raise in a future torch); recognise it first. Imported
    # here, not at module level: the module is heavy and only this check needs it.
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def is_tensor_unallocated(tensor: torch.Tensor) -> bool:
    """True when `tensor` has no real storage: zero elements, a null data pointer, or no data pointer at all.

    Meta tensors and fake tensors (used while tracing for torch.compile) count as unallocated, and so does a tensor
    without a storage (sparse layouts), whose `data_ptr()` raises.
    """
    if tensor.device.type == "meta" or _is_fake(tensor):
        return True
    try:
        return tensor.numel() == 0 or tensor.data_ptr() == 0
    except RuntimeError:
        # What torch raises for a tensor without storage ("Cannot access data pointer of Tensor that doesn't have
        # storage"); any other exception is a bug and propagates.
        return True
