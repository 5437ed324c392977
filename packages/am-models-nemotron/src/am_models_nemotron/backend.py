"""Which `BackendConfig` choices Nemotron-H implements, and the one rule that maps any config onto them.

What it is for: `BackendConfig()` picks its defaults from the machine (attn="te" where Transformer Engine and CUDA
are present, an all-to-all dispatcher where DeepEP / UCCL-EP are installed). The model must run with those
defaults, so `resolve_backend` maps every field the model reads to the nearest choice it implements and logs ONE
line listing what it changed. Kernel choices only change speed, never the math, so they are resolved; the routing
fields (`gate_precision`, `fake_balanced_gate`, `fake_gate_noise`) are read as they are by `NemotronMoE`.
What it must not do: import transformer_engine (linear / RMSNorm "te" are built by am-precision, lazily), mutate
the config it is given (a resolved copy is returned), or resolve anywhere else: every class calls this function.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from am_precision import BackendConfig

__all__ = ["SUPPORTED_BACKENDS", "default_backend", "resolve_backend"]

logger = logging.getLogger("am_models_nemotron")


@dataclass(frozen=True)
class _FieldRule:
    """Values the model implements for one field, and the nearest implemented value for each other one."""

    supported: tuple[object, ...]
    nearest: dict[object, object]
    why: str


# One row per BackendConfig field the model reads. `linear` and `rms_norm` are built by am-precision for every
# value it accepts (torch, te, quack), so they need no row; `gate_precision` accepts any dtype. Fields no am-*
# package implements (compile_attn=True, enable_fsdp_optimizations=True, enable_hf_state_dict_adapter=False,
# te_fp8) never reach the model: am-precision's BackendConfig refuses them when built. fake_balanced_gate and
# fake_gate_noise need no row either: NemotronMoE honours every value (am_moe.balanced_routing).
_RULES: dict[str, _FieldRule] = {
    "attn": _FieldRule(
        supported=("sdpa",),
        nearest={"te": "sdpa", "flex": "sdpa", "eager": "sdpa", "tilelang": "sdpa", "cudnn": "sdpa"},
        why="attention runs on torch SDPA (document masks, packed/THD rows and ring CP on every device)",
    ),
    "experts": _FieldRule(
        supported=("torch", "torch_mm"),
        nearest={"te": "torch_mm", "gmm": "torch_mm", "torch_mm_mxfp8": "torch_mm"},
        why="experts run as grouped torch matmuls",
    ),
    "dispatcher": _FieldRule(
        supported=("torch",),
        nearest={"deepep": "torch", "hybridep": "torch", "uccl_ep": "torch", "mok": "torch"},
        why="tokens are dispatched locally (no expert-parallel all-to-all kernels)",
    ),
}

SUPPORTED_BACKENDS: dict[str, tuple[object, ...]] = {name: rule.supported for name, rule in _RULES.items()}


def default_backend() -> BackendConfig:
    """The plain-PyTorch backend this package implements: SDPA attention, torch linears, fp32 RMSNorm, torch experts."""
    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")


def resolve_backend(backend: BackendConfig | None, *, owner: str = "am-models-nemotron") -> BackendConfig:
    """`backend` with every field the model reads mapped to a value it implements (None -> `default_backend()`).

    Changed fields are logged once, in one line (logger "am_models_nemotron", level WARNING); an unchanged config is
    returned as is. The given config is never mutated.

    Raises:
        ValueError: a value this table does not know, or a resolved combination BackendConfig refuses — every
            problem listed, with the fix.
    """
    if backend is None:
        return default_backend()
    problems = []
    changes: dict[str, object] = {}
    for name, rule in _RULES.items():
        value = getattr(backend, name)
        if value in rule.supported:
            continue
        if value not in rule.nearest:  # a value BackendConfig accepts that this table does not know yet
            problems.append(f"{name}={value!r} is not implemented; supported: {list(rule.supported)}")
            continue
        changes[name] = rule.nearest[value]
    if problems:
        raise ValueError(f"{owner}: unsupported BackendConfig:\n  - " + "\n  - ".join(problems))
    if not changes:
        return backend
    try:
        resolved = backend.replace(**changes)
    except ValueError as exc:
        raise ValueError(
            f"{owner}: BackendConfig resolved to the implemented choices {changes} is invalid; set these fields "
            f"yourself to a valid combination.\n{exc}"
        ) from exc
    details = "; ".join(
        f"{name} {getattr(backend, name)!r} -> {value!r} ({_RULES[name].why})" for name, value in changes.items()
    )
    logger.warning("%s: BackendConfig fields resolved to the nearest implemented choice: %s", owner, details)
    return resolved
