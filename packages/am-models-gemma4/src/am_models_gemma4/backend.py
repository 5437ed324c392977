"""Which `BackendConfig` choices Gemma 4 runs, and the one check every class calls before it builds anything.

What it is for: Gemma 4 takes upstream's `backend=` like Nemotron-H. It honours `attn` (am-precision's
`AttentionKernel`: sdpa, eager, flex, cudnn, te), `compile_attn`, `linear` (torch, te, quack: the attention, MLP
and per-layer-input projections), `rms_norm` (torch_fp32, torch, te, quack: every scaled norm), `rope` (torch,
quack: QuACK's rotary kernel), `rope_fusion` (Transformer Engine's fused RoPE), `te_fp8` (TE autocast around each
decoder layer), `enable_fsdp_optimizations` (the model's `prepare_for_grad_accumulation` /
`prepare_for_final_backward`), `experts` ("torch": one matmul per expert, "torch_mm": am-moe's grouped GEMM, "te":
Transformer Engine's GroupedLinear, "gmm": the grouped_gemm package, "torch_mm_mxfp8": am-moe's MXFP8 grouped GEMM on
Blackwell) and `dispatcher` ("torch", or the libraries
"deepep" / "hybridep" / "uccl_ep" with their `dispatcher_*` knobs, passed to `am_moe.apply_expert_parallel` by
`expert_parallel_options`).
Every other value either is the one Gemma 4 runs or is refused, all problems in one `ValueError` naming what is
missing (`backend_runtime_problems`: CUDA, Transformer Engine, QuACK, grouped_gemm, DeepEP, UCCL-EP). `backend=None`
keeps the model's own
defaults (SDPA; the experts' grouped GEMM chosen by am-moe).
What it must not do: rewrite a field to another value, import transformer_engine, or mutate the config it is given.
"""

from __future__ import annotations

from am_moe.upstream import EXPERTS_GROUPED_MM, LIBRARY_DISPATCHERS, expert_parallel_options
from am_precision import (
    LINEAR_BACKENDS,
    RMS_NORM_BACKENDS,
    RUNNABLE_ATTN_BACKENDS,
    BackendConfig,
    backend_runtime_problems,
)

__all__ = [
    "LIBRARY_DISPATCHERS",
    "SUPPORTED_BACKENDS",
    "backend_problems",
    "expert_parallel_options",
    "experts_grouped_mm",
    "resolve_backend",
]

# Values Gemma 4 has code for (a value may still need CUDA / a library: `backend_problems` says which).
SUPPORTED_BACKENDS: dict[str, tuple[object, ...]] = {
    "attn": RUNNABLE_ATTN_BACKENDS,
    "linear": LINEAR_BACKENDS,
    "rms_norm": RMS_NORM_BACKENDS,
    "experts": tuple(EXPERTS_GROUPED_MM),
    "dispatcher": ("torch", *LIBRARY_DISPATCHERS),
}

_WHY = {
    "experts": "Gemma 4's experts run am-moe's per-expert loop ('torch'), grouped GEMM ('torch_mm'), Transformer "
    "Engine's GroupedLinear ('te'), grouped_gemm ('gmm') or MXFP8 grouped GEMM ('torch_mm_mxfp8', Blackwell)",
    "dispatcher": "Gemma 4 dispatches tokens with am-moe ('torch', 'deepep', 'hybridep', 'uccl_ep'); the "
    "Mixture-of-Kittens dispatcher is not run by am-moe: choose one of those",
}


def backend_problems(backend: BackendConfig) -> list[str]:
    """Every reason `backend` cannot run in Gemma 4 on this machine (empty: it runs as asked)."""
    # What this machine lacks for the fields built as asked (TE / QuACK linears and norms, TE attention, fused RoPE,
    # FP8).
    problems = backend_runtime_problems(
        backend, fields=("attn", "linear", "rms_norm", "rope", "rope_fusion", "experts", "dispatcher", "te_fp8")
    )
    for name in ("experts", "dispatcher"):
        value = getattr(backend, name)
        if value not in SUPPORTED_BACKENDS[name]:
            problems.append(f"{name}={value!r}: {_WHY[name]}")
    return problems


def resolve_backend(backend: BackendConfig | None, *, owner: str = "am-models-gemma4") -> BackendConfig | None:
    """`backend` checked to run exactly as asked; None stays None (the model's defaults). Never mutated.

    Raises:
        TypeError: `backend` is not an `am_precision.BackendConfig` (or None).
        ValueError: one or more fields cannot run here — every problem listed, naming what is missing and the fix.
    """
    if backend is None:
        return None
    if not isinstance(backend, BackendConfig):
        raise TypeError(f"{owner}: backend={backend!r} must be an am_precision.BackendConfig or None")
    problems = backend_problems(backend)
    if problems:
        raise ValueError(f"{owner}: BackendConfig cannot run as asked:\n  - " + "\n  - ".join(problems))
    return backend


def experts_grouped_mm(backend: BackendConfig | None) -> str:
    """am-moe's `grouped_mm=` for `backend.experts` ("auto" without a backend)."""
    return "auto" if backend is None else EXPERTS_GROUPED_MM[backend.experts]
