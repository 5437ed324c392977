"""Which `BackendConfig` choices Nemotron-H runs, and the one check every class calls before it builds anything.

What it is for: a `BackendConfig` value either runs as asked or is refused, with every problem listed in one
`ValueError` that names what is missing (CUDA, Transformer Engine, grouped_gemm, DeepEP, UCCL-EP, ...).
`resolve_backend(None)` is the plain-PyTorch `default_backend()`; any other config is returned unchanged once it
passed the check. `expert_parallel_options` (am-moe's, `am_moe.upstream`) turns the dispatcher fields into
`am_moe.apply_expert_parallel`'s keywords (the model's `apply_expert_parallel` passes them on).
What it must not do: rewrite a field the user set to another value (earlier releases mapped e.g. attn='te' to 'sdpa'
with a warning; that silently ran another kernel), import transformer_engine or a dispatcher library (am-precision
builds TE modules lazily, am-moe imports the libraries on first use), or mutate the config it is given. The routing
fields (`gate_precision`, `fake_balanced_gate`, `fake_gate_noise`) are read as they are by `NemotronMoE`
(am_moe.balanced_routing).
"""

from __future__ import annotations

from am_moe.upstream import EXPERTS_GROUPED_MM, LIBRARY_DISPATCHERS, expert_parallel_options
from am_precision import RUNNABLE_ATTN_BACKENDS, BackendConfig, backend_runtime_problems

__all__ = [
    "EXPERTS_GROUPED_MM",
    "LIBRARY_DISPATCHERS",
    "SUPPORTED_BACKENDS",
    "backend_problems",
    "default_backend",
    "expert_parallel_options",
    "moe_backend_problems",
    "resolve_backend",
]

# Values of the fields the model reads that it has code for (a value may still need CUDA / a library: the check
# says which). `linear` and `rms_norm` are built by am-precision for every value it accepts.
SUPPORTED_BACKENDS: dict[str, tuple[object, ...]] = {
    "attn": RUNNABLE_ATTN_BACKENDS,
    "experts": tuple(EXPERTS_GROUPED_MM),
    "dispatcher": ("torch", *LIBRARY_DISPATCHERS),
}

_WHY = {
    "mok": "dispatcher='mok' (Mixture-of-Kittens) is not run by am-moe, whose expert parallelism dispatches with "
    "'torch', 'deepep', 'hybridep' or 'uccl_ep'; choose one of those",
}


def default_backend() -> BackendConfig:
    """The plain-PyTorch backend: SDPA attention, torch linears, fp32 RMSNorm, per-expert loop, local dispatch."""
    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")


def moe_backend_problems(backend: BackendConfig) -> list[str]:
    """Every reason the MoE fields (`experts`, `dispatcher`) of `backend` cannot run here (empty: they run)."""
    problems = backend_runtime_problems(backend, fields=("experts", "dispatcher"))
    for name in ("experts", "dispatcher"):
        value = getattr(backend, name)
        if value not in SUPPORTED_BACKENDS[name]:
            problems.append(_WHY.get(value, f"{name}={value!r}: supported {SUPPORTED_BACKENDS[name]}"))
    return problems


def backend_problems(backend: BackendConfig) -> list[str]:
    """Every reason `backend` cannot run in this model on this machine (empty: it runs as asked)."""
    # What this machine lacks for the fields built as asked (TE / QuACK linears and norms, TE attention, FP8).
    problems = backend_runtime_problems(backend, fields=("attn", "linear", "rms_norm", "te_fp8"))
    problems += moe_backend_problems(backend)
    if backend.rope != "torch":
        problems.append(
            f"rope={backend.rope!r} picks a rotary-embedding kernel, but Nemotron-H's attention has no positional "
            "encoding (NoPE): there is no RoPE to run; leave rope='torch'"
        )
    if backend.rope_fusion:
        problems.append(
            "rope_fusion=True fuses the rotary embedding into Transformer Engine's kernel, but Nemotron-H's attention "
            "has no positional encoding (NoPE): there is no RoPE to fuse; leave rope_fusion False"
        )
    return problems


def resolve_backend(backend: BackendConfig | None, *, owner: str = "am-models-nemotron") -> BackendConfig:
    """`backend` checked to run exactly as asked (None -> `default_backend()`). Returned unchanged, never mutated.

    Raises:
        ValueError: one or more fields cannot run here — every problem listed, naming what is missing and the fix.
    """
    if backend is None:
        return default_backend()
    problems = backend_problems(backend)
    if problems:
        raise ValueError(f"{owner}: BackendConfig cannot run as asked:\n  - " + "\n  - ".join(problems))
    return backend
