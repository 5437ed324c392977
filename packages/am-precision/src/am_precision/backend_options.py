"""Nested option groups of `BackendConfig`: CUDA-graph capture (`CudaGraphConfig`) and MoK (`MoKBackendConfig`).

What it is for: the two small dataclasses NeMo AutoModel nests in its `BackendConfig` (`cuda_graph=`, `mok=`), with
upstream's field names, defaults and validation, so configs written for upstream parse here. Each validates itself
and reports every problem at once.
What it must not do: decide whether any am-* package honours them (that is `BackendConfig`'s `_NOT_IMPLEMENTED`
table), or import the optional MoK package anywhere but in `MoKBackendConfig.build()`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CUDA_GRAPH_MODULES", "CudaGraphConfig", "MoKBackendConfig"]

CUDA_GRAPH_MODULES: tuple[str, ...] = ("attn", "te_dpa", "moe_router", "moe_preprocess")


def _raise_if_problems(owner: str, problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        plural = "s" if len(problems) > 1 else ""
        raise ValueError(f"Invalid {owner} ({len(problems)} problem{plural}):\n{lines}")


@dataclass(frozen=True, kw_only=True)
class CudaGraphConfig:
    """Which parts of a layer are captured in CUDA graphs.

    Args:
        modules: a list (or tuple) of names from `CUDA_GRAPH_MODULES`: "attn" (the whole attention block), "te_dpa"
            (Transformer Engine's dot-product attention only), "moe_router", "moe_preprocess" (needs "moe_router").
            Stored as a tuple so the config stays immutable and hashable. Empty (default) captures nothing.

    Raises:
        TypeError: `modules` is not a list/tuple of strings (upstream raises TypeError here too).
        ValueError: unknown or duplicate names, "attn" together with "te_dpa", or "moe_preprocess" without
            "moe_router"; every problem is listed.
    """

    modules: Sequence[str] = ()

    def __post_init__(self) -> None:
        modules: Any = self.modules
        if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
            raise TypeError(f"CudaGraphConfig.modules={modules!r} must be a list of strings from {CUDA_GRAPH_MODULES}")
        problems = [
            f"modules: unknown name {m!r} (allowed: {CUDA_GRAPH_MODULES})"
            for m in modules
            if m not in CUDA_GRAPH_MODULES
        ]
        duplicates = sorted({m for m in modules if modules.count(m) > 1})
        if duplicates:
            problems.append(f"modules: {duplicates} listed more than once")
        if "attn" in modules and "te_dpa" in modules:
            problems.append("modules: 'attn' already captures 'te_dpa'; list only one of them")
        if "moe_preprocess" in modules and "moe_router" not in modules:
            problems.append("modules: 'moe_preprocess' is captured together with the router; add 'moe_router'")
        _raise_if_problems("CudaGraphConfig", problems)
        object.__setattr__(self, "modules", tuple(modules))

    @property
    def enabled(self) -> bool:
        """True when any module is captured."""
        return bool(self.modules)


@dataclass(frozen=True, kw_only=True)
class MoKBackendConfig:
    """Tuning knobs of the Mixture-of-Kittens (MoK) fused MoE dispatcher, upstream's names and defaults.

    Args:
        fwd_num_comm_sms: streaming multiprocessors the forward kernel reserves for communication (positive, even).
        bwd_num_comm_sms: the same for the backward kernel (positive, even).
        minibatch_size: routed rows per minibatch (a positive multiple of 256).
        macrobatch_size: routed ring capacity (a positive multiple of `minibatch_size`).
        schedule_capacity_multiplier: capacity factor of the routed schedule (positive, finite).
        all_gather_top_experts_chunk_bytes: chunk of the routing all-gather (a positive multiple of 16).

    Raises:
        ValueError: any field outside its range; every problem is listed.
    """

    fwd_num_comm_sms: int = 40
    bwd_num_comm_sms: int = 28
    minibatch_size: int = 4096
    macrobatch_size: int = 131072
    schedule_capacity_multiplier: float = 0.5
    all_gather_top_experts_chunk_bytes: int = 2048

    def __post_init__(self) -> None:
        problems: list[str] = []

        def positive_int(name: str) -> int | None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive int")
                return None
            return value

        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            sms = positive_int(name)
            if sms is not None and sms % 2:
                problems.append(f"{name}={sms} must be even")
        minibatch = positive_int("minibatch_size")
        if minibatch is not None and minibatch % 256:
            problems.append(f"minibatch_size={minibatch} must be a multiple of 256")
        macrobatch = positive_int("macrobatch_size")
        if macrobatch is not None and minibatch is not None and macrobatch % minibatch:
            problems.append(f"macrobatch_size={macrobatch} must be a multiple of minibatch_size={minibatch}")
        chunk = positive_int("all_gather_top_experts_chunk_bytes")
        if chunk is not None and chunk % 16:
            problems.append(f"all_gather_top_experts_chunk_bytes={chunk} must be a multiple of 16")
        multiplier = self.schedule_capacity_multiplier
        if (
            isinstance(multiplier, bool)
            or not isinstance(multiplier, (int, float))
            or not math.isfinite(multiplier)
            or multiplier <= 0
        ):
            problems.append(f"schedule_capacity_multiplier={multiplier!r} must be a positive finite number")
        _raise_if_problems("MoKBackendConfig", problems)

    def build(self) -> Any:
        """MoK's own config object (`mok.functional.MoKConfig`) with these values.

        Raises:
            ImportError: the optional MoK package is not installed.
        """
        try:
            from mok import functional as mok_functional
        except ImportError as err:
            raise ImportError(
                "MoKBackendConfig.build() needs the optional Mixture-of-Kittens package (`mok.functional`), which is "
                "not installed; no am-* package runs the MoK dispatcher, so only build it for your own kernels."
            ) from err
        return mok_functional.MoKConfig(**dataclasses.asdict(self))
