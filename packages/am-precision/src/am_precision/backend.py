"""Backend selection (`BackendConfig`) and Transformer Engine FP8 recipes (`TEFp8Config`).

What it is for: one validated, immutable description of which kernels a model uses (attention, linear, RMSNorm,
RoPE, MoE experts and token dispatcher, FP8). Every literal is checked at construction and all problems are
reported in one `ValueError`. It keeps every field NeMo AutoModel documents, so configs written for it parse; a
value that asks for something no am-* package implements (`_NOT_IMPLEMENTED`) is refused there, and the models
refuse the values of the fields they read but do not support.
What it must not do: import transformer_engine at import time or while validating (a config may be built on a
machine without CUDA), silently rewrite a field the user set, accept an option nothing honours, or be mutated after
construction: the dataclasses are frozen; derive a variant with `config.replace(field=value)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import flags
from .backend_options import CudaGraphConfig, MoKBackendConfig, _raise_if_problems

__all__ = [
    "ATTN_BACKENDS",
    "DISPATCHER_BACKENDS",
    "EXPERTS_BACKENDS",
    "FP8_RECIPES",
    "LINEAR_BACKENDS",
    "RMS_NORM_BACKENDS",
    "ROPE_BACKENDS",
    "BackendConfig",
    "TEFp8Config",
]

ATTN_BACKENDS: tuple[str, ...] = ("te", "sdpa", "flex", "eager", "tilelang", "cudnn")
LINEAR_BACKENDS: tuple[str, ...] = ("torch", "te", "quack")
RMS_NORM_BACKENDS: tuple[str, ...] = ("torch", "torch_fp32", "te", "quack")
ROPE_BACKENDS: tuple[str, ...] = ("torch", "quack")
EXPERTS_BACKENDS: tuple[str, ...] = ("torch", "te", "gmm", "torch_mm", "torch_mm_mxfp8")
DISPATCHER_BACKENDS: tuple[str, ...] = ("torch", "deepep", "hybridep", "uccl_ep", "mok")
FP8_RECIPES: tuple[str, ...] = ("current", "block", "mxfp8")

# Grouped-GEMM expert kernels consume tokens already permuted by an all-to-all dispatcher.
_EXPERTS_NEEDING_A2A = ("te", "gmm")
_A2A_DISPATCHERS = ("deepep", "hybridep", "uccl_ep", "mok")


def _format_allowed(allowed: tuple[str, ...]) -> str:
    return ", ".join(repr(a) for a in allowed)


@dataclass(frozen=True, kw_only=True)
class TEFp8Config:
    """Transformer Engine FP8 recipe selection.

    Args:
        recipe: "current" (per-tensor current scaling), "block" (block scaling), "mxfp8" (MX block scaling,
            Blackwell) or an already built TE recipe object, returned unchanged by `build_recipe()`.

    Raises:
        ValueError: `recipe` is a string outside `FP8_RECIPES`.
    """

    recipe: str | Any = "current"

    def __post_init__(self) -> None:
        if isinstance(self.recipe, str) and self.recipe not in FP8_RECIPES:
            _raise_if_problems("TEFp8Config", [f"recipe={self.recipe!r} is not one of {_format_allowed(FP8_RECIPES)}"])

    def build_recipe(self) -> Any | None:
        """The TE recipe object for `recipe`, or None when transformer_engine is not installed.

        Raises:
            ImportError: recipe="mxfp8" with a TE release that has no `MXFP8BlockScaling`.
        """
        if not flags.HAVE_TE:
            return None
        if not isinstance(self.recipe, str):
            return self.recipe
        from transformer_engine.common import recipe as te_recipe

        if self.recipe == "mxfp8":
            mxfp8 = getattr(te_recipe, "MXFP8BlockScaling", None)
            if mxfp8 is None:
                raise ImportError(
                    "TEFp8Config(recipe='mxfp8') needs transformer_engine.common.recipe.MXFP8BlockScaling, which "
                    "this Transformer Engine release lacks; upgrade with `pip install -U am-precision[te]` or "
                    "use recipe='current' or 'block'."
                )
            return mxfp8()
        if self.recipe == "block":
            return te_recipe.Float8BlockScaling()
        return te_recipe.Float8CurrentScaling()

    def maybe_te_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A TE FP8 autocast context for `build_recipe()`, or a null context when TE is not installed."""
        if not flags.HAVE_TE:
            return contextlib.nullcontext()
        import transformer_engine.pytorch as te

        built = self.build_recipe()
        autocast = getattr(te, "autocast", None)
        if autocast is not None:
            return autocast(enabled=True, recipe=built)
        # TE releases before `te.autocast` spell it fp8_autocast(fp8_recipe=...).
        return te.fp8_autocast(enabled=True, fp8_recipe=built)


def _default_dispatcher() -> str:
    if torch.cuda.is_available():
        if flags.HAVE_DEEP_EP:
            return "deepep"
        if flags.HAVE_UCCL_EP:
            return "uccl_ep"
    return "torch"


def _parse_dtype(value: str) -> torch.dtype | None:
    name = value.strip().removeprefix("torch.")
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


_LITERAL_FIELDS: dict[str, tuple[str, ...]] = {
    "attn": ATTN_BACKENDS,
    "linear": LINEAR_BACKENDS,
    "rms_norm": RMS_NORM_BACKENDS,
    "rope": ROPE_BACKENDS,
    "experts": EXPERTS_BACKENDS,
    "dispatcher": DISPATCHER_BACKENDS,
}
_BOOL_FIELDS = (
    "dispatcher_share_token_dispatcher",
    "dispatcher_async_dispatch",
    "fake_balanced_gate",
    "enable_hf_state_dict_adapter",
    "enable_fsdp_optimizations",
    "compile_attn",
)

# am_moe.apply_expert_parallel honours these for its library dispatchers (deepep, hybridep, uccl_ep); the torch
# dispatcher has no communication kernels to tune.
_LIBRARY_DISPATCHERS = ("deepep", "hybridep", "uccl_ep")

# Values of upstream fields that no am-* package honours: field -> (does this value ask for it?, why and the fix).
# Refused at construction instead of being accepted and ignored. A package that implements one deletes its entry
# here and updates the README table "Who honours each field".
_NOT_IMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "cuda_graph": (
        lambda v: isinstance(v, CudaGraphConfig) and v.enabled,
        "no am-* model captures CUDA graphs; leave cuda_graph=CudaGraphConfig() (modules=[])",
    ),
    "mok": (
        lambda v: isinstance(v, MoKBackendConfig) and v != MoKBackendConfig(),
        "it tunes the MoK dispatcher, which no am-* package runs; leave mok=MoKBackendConfig() (the defaults)",
    ),
    "enable_deepep": (
        lambda v: v is not None,
        "it is a removed upstream field (upstream warns and ignores it); choose the dispatcher with "
        "dispatcher='deepep' and leave enable_deepep=None",
    ),
}


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Which kernel implementation each part of a model uses. Immutable; derive variants with `replace()`.

    Defaults depend on the machine at construction time: with Transformer Engine installed and CUDA available,
    attention and linear default to "te"; otherwise "sdpa" and "torch". Experts default to "torch_mm" on CUDA
    ("torch" elsewhere); the dispatcher to "deepep" / "uccl_ep" when installed and CUDA is available, else "torch".

    Args:
        attn: attention kernel, one of `ATTN_BACKENDS`.
        linear: linear layers, one of `LINEAR_BACKENDS`.
        rms_norm: RMSNorm, one of `RMS_NORM_BACKENDS` ("torch_fp32" computes in fp32 whatever the storage dtype).
        rope: rotary embedding kernel, one of `ROPE_BACKENDS` ("quack": QuACK's rotary kernel, `quack_rope`).
        rope_fusion: rotate queries and keys with Transformer Engine's fused RoPE kernel (`fused_rope`). None
            (default) resolves to False (upstream forces the fusion off altogether; here True is honoured by models
            with RoPE, Gemma 4, and refused where TE / CUDA is missing); after construction it is always a bool.
        experts: MoE expert computation, one of `EXPERTS_BACKENDS`; "te" and "gmm" need an all-to-all dispatcher.
        dispatcher: MoE token dispatcher, one of `DISPATCHER_BACKENDS`.
        dispatcher_num_sms: streaming multiprocessors reserved for the dispatcher's communication kernels.
        dispatcher_share_token_dispatcher: share one dispatcher between MoE layers.
        dispatcher_async_dispatch: overlap dispatch with computation.
        fake_balanced_gate: replace the router with a perfectly balanced fake (benchmarking only; am_moe's
            `balanced_routing`: every expert gets the same number of (token, k) pairs, or one more).
        fake_gate_noise: noise added to the fake gate's scores (finite, >= 0).
        enable_hf_state_dict_adapter: convert checkpoints from/to the HF layout on load/save.
        enable_fsdp_optimizations: defer FSDP2's gradient reduce-scatter and resharding to the last backward of an
            optimizer step (upstream's MoE FSDP sync): the models' `prepare_for_grad_accumulation` /
            `prepare_for_final_backward` then call `am_precision.fsdp_sync`'s functions; without it they do nothing.
        te_fp8: FP8 recipe (`TEFp8Config` or a dict of its fields); requires linear="te" or experts="te".
            am-models-nemotron enters `te_fp8.maybe_te_autocast()` around each block (its TE modules).
        gate_precision: dtype of MoE router math (a dtype or a name such as "float32" / "torch.float32").
        compile_attn: wrap the attention kernel (`AttentionKernel`) in torch.compile; honoured by both am-* models.
        cuda_graph: CUDA-graph capture (`CudaGraphConfig` or a dict of its fields).
        mok: knobs of the MoK dispatcher (`MoKBackendConfig` or a dict of its fields).
        enable_deepep: removed upstream field, accepted only as None so upstream configs that spell it load.

    Fields no am-* package implements (README, "Who honours each field") keep their upstream defaults and accept
    only them: a
    non-empty `cuda_graph`, a non-default `mok` and `enable_deepep` are refused with the reason and the fix. Models
    refuse what they do not support of the fields they read (`attn`, `experts`, `dispatcher`, ...) and what this
    machine cannot run (`backend_runtime_problems`).

    Raises:
        ValueError: one or more fields are invalid or ask for something no am-* package implements; the message
            lists every problem with the allowed values or the fix.
    """

    attn: str = field(default_factory=lambda: "te" if flags.te_usable() else "sdpa")
    linear: str = field(default_factory=lambda: "te" if flags.te_usable() else "torch")
    rms_norm: str = "torch_fp32"
    rope: str = "torch"
    rope_fusion: bool | None = None
    experts: str = field(default_factory=lambda: "torch_mm" if torch.cuda.is_available() else "torch")
    dispatcher: str = field(default_factory=_default_dispatcher)
    dispatcher_num_sms: int = 20
    dispatcher_share_token_dispatcher: bool = True
    dispatcher_async_dispatch: bool = False
    fake_balanced_gate: bool = False
    fake_gate_noise: float = 0.0
    enable_hf_state_dict_adapter: bool = True
    enable_fsdp_optimizations: bool = False
    te_fp8: TEFp8Config | None = None
    gate_precision: torch.dtype | None = None
    compile_attn: bool = False
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    mok: MoKBackendConfig = field(default_factory=MoKBackendConfig)
    enable_deepep: bool | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name, allowed in _LITERAL_FIELDS.items():
            value = getattr(self, name)
            if value not in allowed:
                problems.append(f"{name}={value!r} is not one of {_format_allowed(allowed)}")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                problems.append(f"{name}={value!r} must be a bool")
        if self.rope_fusion is not None and not isinstance(self.rope_fusion, bool):
            problems.append(f"rope_fusion={self.rope_fusion!r} must be a bool or None (auto)")
        if (
            isinstance(self.dispatcher_num_sms, bool)
            or not isinstance(self.dispatcher_num_sms, int)
            or self.dispatcher_num_sms <= 0
        ):
            problems.append(f"dispatcher_num_sms={self.dispatcher_num_sms!r} must be a positive int")
        if isinstance(self.fake_gate_noise, bool) or not isinstance(self.fake_gate_noise, (int, float)):
            problems.append(f"fake_gate_noise={self.fake_gate_noise!r} must be a number >= 0")
        elif not math.isfinite(self.fake_gate_noise) or self.fake_gate_noise < 0:
            problems.append(f"fake_gate_noise={self.fake_gate_noise!r} must be finite and >= 0")

        self._normalize_nested("te_fp8", TEFp8Config, problems, none_ok=True)
        self._normalize_nested("cuda_graph", CudaGraphConfig, problems, none_ok=False)
        self._normalize_nested("mok", MoKBackendConfig, problems, none_ok=False)
        self._normalize_gate_precision(problems)
        if self.rope_fusion is None:
            object.__setattr__(self, "rope_fusion", False)
        refused = self._check_implemented(problems)
        self._check_combinations(problems, refused=refused)
        _raise_if_problems("BackendConfig", problems)

    def _normalize_nested(self, name: str, cls: type, problems: list[str], *, none_ok: bool) -> None:
        """Turn a dict of `cls`'s fields into a `cls` (as upstream does); report any other type."""
        value: Any = getattr(self, name)
        if isinstance(value, cls) or (none_ok and value is None):
            return
        if isinstance(value, Mapping):
            try:
                object.__setattr__(self, name, cls(**value))
            except (TypeError, ValueError) as err:
                allowed = ", ".join(f.name for f in dataclasses.fields(cls))
                problems.append(f"{name}={dict(value)!r} is not a valid {cls.__name__} (fields: {allowed}): {err}")
            return
        none = ", or None" if none_ok else ""
        problems.append(f"{name}={value!r} must be a {cls.__name__}, a dict of its fields{none}")

    def _normalize_gate_precision(self, problems: list[str]) -> None:
        value: Any = self.gate_precision
        if value is None:
            return
        if isinstance(value, torch.dtype):
            if not value.is_floating_point:
                problems.append(f"gate_precision={value!r} must be a floating-point dtype")
            return
        if isinstance(value, str):
            dtype = _parse_dtype(value)
            if dtype is None:
                problems.append(
                    f"gate_precision={value!r} does not name a floating-point torch dtype "
                    "(use e.g. 'float32', 'torch.float32' or 'bfloat16')"
                )
            else:
                object.__setattr__(self, "gate_precision", dtype)
            return
        problems.append(f"gate_precision={value!r} must be a torch.dtype, a dtype name, or None")

    def _check_combinations(self, problems: list[str], *, refused: set[str]) -> None:
        # Each rule runs only when the fields it reads are individually valid and not refused as unimplemented, so
        # messages never compound.
        if (
            self.experts in _EXPERTS_NEEDING_A2A
            and self.dispatcher in DISPATCHER_BACKENDS
            and (self.dispatcher not in _A2A_DISPATCHERS)
        ):
            problems.append(
                f"experts={self.experts!r} consumes tokens permuted by an all-to-all dispatcher "
                f"({_format_allowed(_A2A_DISPATCHERS)}), but dispatcher={self.dispatcher!r}; choose one of those "
                "dispatchers or experts='torch_mm' / 'torch'"
            )
        sms = self.dispatcher_num_sms
        knobs = [f"dispatcher_num_sms={sms!r}"] if isinstance(sms, int) and sms > 0 and sms != 20 else []
        knobs += ["dispatcher_async_dispatch=True"] if self.dispatcher_async_dispatch is True else []
        if knobs and self.dispatcher in DISPATCHER_BACKENDS and self.dispatcher not in _LIBRARY_DISPATCHERS:
            problems.append(
                f"{', '.join(knobs)} tune(s) the communication kernels of {_format_allowed(_LIBRARY_DISPATCHERS)} "
                f"(am_moe.apply_expert_parallel), but dispatcher={self.dispatcher!r}; leave the defaults "
                "(20, False) or choose one of those dispatchers"
            )
        if self.rope == "quack" and self.rope_fusion is True:
            problems.append(
                "rope='quack' and rope_fusion=True choose two RoPE kernels (QuACK's and Transformer Engine's fused "
                "one); keep rope='torch' with rope_fusion=True, or drop rope_fusion"
            )
        backends_known = self.linear in LINEAR_BACKENDS and self.experts in EXPERTS_BACKENDS
        te_fp8_usable = isinstance(self.te_fp8, TEFp8Config) and "te_fp8" not in refused
        if te_fp8_usable and backends_known and "te" not in (self.linear, self.experts):
            problems.append(
                "te_fp8 requires at least one TE backend (linear='te' or experts='te'), "
                f"but got linear={self.linear!r}, experts={self.experts!r}"
            )

    def _check_implemented(self, problems: list[str]) -> set[str]:
        """Report each valid field whose value asks for something no am-* package implements; return their names."""
        invalid = {problem.split("=", 1)[0] for problem in problems}  # reported once, as invalid
        refused = set()
        for name, (asks_for_it, why) in _NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if name not in invalid and asks_for_it(value):
                problems.append(f"{name}={value!r} is not implemented by any am-* package: {why}")
                refused.add(name)
        return refused

    def replace(self, **changes: Any) -> BackendConfig:
        """A validated copy with `changes` applied; the original is left untouched.

        Note: `rope_fusion` was resolved to a bool at construction; pass `rope_fusion=None` to re-resolve it.
        """
        return dataclasses.replace(self, **changes)
