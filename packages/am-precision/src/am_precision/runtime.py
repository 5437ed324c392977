"""Can this machine run a `BackendConfig`? Every value that needs hardware or a library it lacks, named.

What it is for: `BackendConfig` validates values (a config may be written on a laptop for a GPU cluster); a model
built from it must run each value as asked. `backend_runtime_problems` lists, for the fields a caller names, every
value that cannot run HERE and what is missing (CUDA, Transformer Engine, QuACK, grouped_gemm, DeepEP, UCCL-EP,
MoK, a Blackwell GPU), so a model raises them all in one `ValueError` before it builds anything.
What it must not do: import any of those libraries (presence is `importlib.util.find_spec`, via `flags` for the
ones upstream names), or decide what a model implements (a model adds its own refusals to this list).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import flags
from .attention import attention_backend_problem
from .backend import BackendConfig
from .flags import _installed

__all__ = ["backend_runtime_problems"]

_TE_FIX = "`pip install am-precision[te]` on a CUDA machine"


def _blackwell() -> bool:
    # Blackwell data-centre GPUs report compute capability 10.x (B200 / GB200); MXFP8 grouped GEMMs need them.
    # Exactly 10.x: torch's MXFP8 grouped kernel (am_moe.mxfp8) is built for sm100 only, so sm12x is refused here too.
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


_AND_NO_CUDA = "; it also needs a CUDA GPU, and torch.cuda.is_available() is False"


def _needs_te(what: str, *, cuda: bool) -> str | None:
    if not flags.HAVE_TE:
        missing = f"{what} needs Transformer Engine (transformer_engine.pytorch), which is not installed: {_TE_FIX}"
        return missing + ("" if cuda else _AND_NO_CUDA)  # everything that is missing, named at once
    if not cuda:
        return f"{what} needs a CUDA GPU (Transformer Engine runs only on CUDA; torch.cuda.is_available() is False)"
    return None


def _needs_package(what: str, module: str, install: str, *, cuda: bool) -> str | None:
    if not _installed(module):
        missing = f"{what} needs the `{module}` package, which is not installed ({install})"
        return missing + ("" if cuda else _AND_NO_CUDA)
    if not cuda:
        return f"{what} needs a CUDA GPU (torch.cuda.is_available() is False)"
    return None


def backend_runtime_problems(
    backend: BackendConfig,
    *,
    fields: Iterable[str] = ("attn", "linear", "rms_norm", "rope", "rope_fusion", "experts", "dispatcher", "te_fp8"),
) -> list[str]:
    """Every value among `fields` of `backend` that this machine cannot run, with what is missing (empty: all run).

    Raises:
        ValueError: `fields` names something this check does not know.
    """
    cuda = torch.cuda.is_available()
    problems: list[str | None] = []
    for name in fields:
        value = getattr(backend, name, None)
        if name == "attn":
            problems.append(attention_backend_problem(str(value), cuda=cuda))
        elif name in ("linear", "rms_norm"):
            if value == "te":
                problems.append(_needs_te(f"{name}='te'", cuda=cuda))
            elif value == "quack":
                problems.append(_needs_package(f"{name}='quack'", "quack", "`pip install quack-kernels`", cuda=cuda))
        elif name == "rope":
            if value == "quack":
                problems.append(_needs_package("rope='quack'", "quack", "`pip install quack-kernels`", cuda=cuda))
        elif name == "rope_fusion":
            if value:
                problems.append(_needs_te("rope_fusion=True (TE's fused RoPE)", cuda=cuda))
        elif name == "experts":
            if value == "te":
                problems.append(_needs_te("experts='te' (TE GroupedLinear)", cuda=cuda))
            elif value == "gmm":
                problems.append(
                    _needs_package("experts='gmm'", "grouped_gemm", "`pip install grouped_gemm`", cuda=cuda)
                )
            elif value == "torch_mm_mxfp8" and not _blackwell():
                problems.append(
                    "experts='torch_mm_mxfp8' needs an NVIDIA Blackwell GPU (compute capability 10.x) for MXFP8 "
                    "grouped GEMMs; this machine has none. Use experts='torch_mm'"
                )
        elif name == "dispatcher":
            if value in ("deepep", "hybridep"):  # HybridEP ships in DeepEP's package (`deep_ep`)
                problems.append(
                    _needs_package(f"dispatcher={value!r}", "deep_ep", "build DeepEP from source", cuda=cuda)
                )
            elif value == "uccl_ep":
                problems.append(_needs_package("dispatcher='uccl_ep'", "uccl_ep", "`pip install uccl`", cuda=cuda))
            elif value == "mok":
                problems.append(_needs_package("dispatcher='mok'", "mok", "the Mixture-of-Kittens package", cuda=cuda))
        elif name == "te_fp8":
            if value is not None:
                problems.append(_needs_te("te_fp8 (TE FP8 autocast)", cuda=cuda))
        else:
            raise ValueError(f"backend_runtime_problems: unknown field {name!r}")
    return [p for p in problems if p is not None]
