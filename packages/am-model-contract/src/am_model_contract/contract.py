"""`ModelContract`: what a model offers the infrastructure, declared in one typed place per model.

What it is for: a model class declares ONE method, `am_contract(self) -> ModelContract`, saying per parallel axis
what it provides (its context-parallel layout and attention, its pipeline outputs and forward, its expert-parallel
hook, its TP/PP plans). Every infrastructure package reads it through `contract_of(model)` (see `reader`), which
gives a model that declares nothing the contract its transformers / NeMo AutoModel class attributes describe
(see `conventions`).
What it must not do: import anything but the standard library (models and infrastructure both import it, so it
sits below both), or decide whether a mesh is supported (am-capabilities does, from this data).

Hooks are callables bound to the model instance (`apply=self.apply_expert_parallel`), so a deep copy (a pipeline
stage) or FSDP2's class swap answers for itself: call `contract_of(stage)`, never keep a contract across copies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, cast

__all__ = [
    "CONTRACT_HOOK",
    "CP_LAYOUTS",
    "ContextParallelContract",
    "ExpertParallelContract",
    "ModelContract",
    "PipelineContract",
    "TensorParallelContract",
]

# The one method a model declares its contract with (see `reader.contract_of`).
CONTRACT_HOOK = "am_contract"
# Context-parallel layouts: "load_balanced" (head-tail chunks, the ring routes the model's SDPA attention) or
# "contiguous" (rank r holds block r; the model runs its own CP attention through am-context-parallel's context).
CP_LAYOUTS = ("load_balanced", "contiguous")


def _as_names(value: Any, name: str, problems: list[str]) -> tuple[str, ...] | None:
    """`value` as a tuple of strings (None stays None); a problem is recorded for anything else."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        problems.append(f"{name} must be a sequence of strings or None; got {value!r}")
        return None
    return tuple(value)


def _check_bools(obj: Any, names: Sequence[str], problems: list[str]) -> None:
    problems.extend(f"{n} must be a bool; got {v!r}" for n in names if type(v := getattr(obj, n)) is not bool)


def _check_callables(obj: Any, names: Sequence[str], problems: list[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not callable(value):
            problems.append(f"{name} must be a callable or None; got {value!r}")


def _raise(owner: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"invalid {owner}:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class ContextParallelContract:
    """What a model offers context parallelism (read by am-context-parallel and am-capabilities).

    Attributes:
        layout: "load_balanced" (default: head-tail chunks, ring attention stands in for the model's SDPA) or
            "contiguous" (each rank one block; the model calls the ring context itself). NeMo: none.
        owns_attention: the model runs its own CP attention, whatever its `backend.attn`. NeMo: `_owns_cp_attention`.
        attention_backends: the `backend.attn` values CP runs with (None: am-capabilities' default rule).
            NeMo: `_supports_cp_sdpa = True` means `("te", "sdpa")`.
        sdpa_attention: the attention runs through torch SDPA, so ring attention can stand in for it and packed
            rows work. transformers: `_supports_sdpa`.
        te_attention: Transformer Engine attention was injected into the model. NeMo: `_te_attention_injected`.
        owns_packed_attention: the model handles packed sequences (`seq_lens`) itself. NeMo: `_owns_packed_attention`.
        packed_attention_backends: the `backend.attn` values packed rows run with under CP (None: TE or magi).
            NeMo: `_packed_cp_attn_backends`.
        options: `() -> am_context_parallel.ContiguousCPOptions` for the contiguous layout (None: the defaults).
        problems: `(*, seq_len, local_seq_len, cp_size) -> list[str]`: what the model cannot honour under CP, asked
            before any collective (None: nothing).
        prepare: `(batch, *, labels_shifted) -> batch`: what the model computes on the WHOLE sequences before they
            are sharded (values that look across a block edge: document ids, multi-token-prediction inputs and
            targets); the caller shards what it returns. None: the batch is sharded as it is.

    Raises:
        ValueError: listing every invalid field.
    """

    layout: str = "load_balanced"
    owns_attention: bool = False
    attention_backends: tuple[str, ...] | None = None
    sdpa_attention: bool = False
    te_attention: bool = False
    owns_packed_attention: bool = False
    packed_attention_backends: tuple[str, ...] | None = None
    options: Callable[[], Any] | None = None
    problems: Callable[..., list[str]] | None = None
    prepare: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.layout not in CP_LAYOUTS:
            problems.append(f"layout must be one of {list(CP_LAYOUTS)}; got {self.layout!r}")
        _check_bools(self, ("owns_attention", "sdpa_attention", "te_attention", "owns_packed_attention"), problems)
        for name in ("attention_backends", "packed_attention_backends"):
            object.__setattr__(self, name, _as_names(getattr(self, name), name, problems))
        _check_callables(self, ("options", "problems", "prepare"), problems)
        if self.options is not None and self.layout != "contiguous":
            problems.append('options are read only for layout="contiguous" (the load-balanced path takes none)')
        _raise("ContextParallelContract", problems)


@dataclass(frozen=True)
class PipelineContract:
    """What a model offers pipeline parallelism (read by am-pipelining and am-capabilities).

    Attributes:
        plan: transformers' `_pp_plan` (`{module: (input names, output names)}`), None when the model has none.
        keeps_own_forward: the model's own forward is pipeline-aware: stages keep it and am-pipelining does not
            rebind a pipeline forward. NeMo: `_pp_keep_self_forward`.
        output_names: what each position of the last stage's tuple is, e.g. `("logits", "mtp_per_depth_h",
            "seq_idx")` (the MTP hidden states take every position between logits and seq_idx); None: a tuple is
            `(logits, *mtp_per_depth)`.
        loss: the model's own training-loss rule for its output (e.g. next-token + MTP):
            `(output, labels, *, loss_fn, labels_shifted, seq_idx, scaling_factor, ignore_index[,
            mtp_per_depth_targets]) -> scalar`, called by am-pipelining's `PipelineCausalLMLoss` at every pipeline
            size (None: its generic next-token + MTP rule).

    Raises:
        ValueError: listing every invalid field.
    """

    plan: Mapping[str, Any] | None = None
    keeps_own_forward: bool = False
    output_names: tuple[str, ...] | None = None
    loss: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.plan is not None and not isinstance(self.plan, Mapping):
            problems.append(f"plan must be a mapping or None; got {self.plan!r}")
        _check_bools(self, ("keeps_own_forward",), problems)
        _check_callables(self, ("loss",), problems)
        object.__setattr__(self, "output_names", _as_names(self.output_names, "output_names", problems))
        _raise("PipelineContract", problems)


@dataclass(frozen=True)
class ExpertParallelContract:
    """What a model offers expert parallelism (read by am-capabilities and trainers).

    Attributes:
        is_moe: the model routes tokens to experts (am-capabilities lets such a model pipeline itself).
        apply: `(ep_mesh) -> sharded experts`: shards the experts over the 1-D `ep_mesh` (collective; after
            pipeline splitting, before FSDP2). None: the model cannot run with ep_size > 1.

    Raises:
        ValueError: listing every invalid field.
    """

    is_moe: bool = False
    apply: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        _check_bools(self, ("is_moe",), problems)
        _check_callables(self, ("apply",), problems)
        _raise("ExpertParallelContract", problems)


@dataclass(frozen=True)
class TensorParallelContract:
    """What a model offers tensor parallelism (read by am-tensor-parallel and am-capabilities).

    Attributes:
        plan: `{module-name pattern: style}` of the whole model, every module's declared `_tp_plan` merged as
            transformers merges them (`declared_tp_plan(model)`); None when the model has none.

    Raises:
        ValueError: the plan is not a mapping.
    """

    plan: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, Mapping):
            _raise("TensorParallelContract", [f"plan must be a mapping or None; got {self.plan!r}"])


@dataclass(frozen=True)
class ModelContract:
    """Everything a model offers the infrastructure, one sub-contract per parallel axis.

    Capability declarations (`get_capabilities(cls, config)` / a nested `ModelCapabilities`) stay class-level, as
    the seed documents them: am-capabilities answers them for a class or a config, without an instance.

    Attributes:
        cp: `ContextParallelContract`.
        pp: `PipelineContract`.
        ep: `ExpertParallelContract`.
        tp: `TensorParallelContract`.

    Raises:
        TypeError: a field holds something else than its sub-contract.
    """

    cp: ContextParallelContract = field(default_factory=ContextParallelContract)
    pp: PipelineContract = field(default_factory=PipelineContract)
    ep: ExpertParallelContract = field(default_factory=ExpertParallelContract)
    tp: TensorParallelContract = field(default_factory=TensorParallelContract)

    def __post_init__(self) -> None:
        # each field's default factory is its sub-contract class
        kinds = {f.name: cast(type, f.default_factory) for f in fields(self)}
        wrong = [
            f"{f.name} must be a {kinds[f.name].__name__}; got {type(getattr(self, f.name)).__name__}"
            for f in fields(self)
            if not isinstance(getattr(self, f.name), kinds[f.name])
        ]
        if wrong:
            raise TypeError("invalid ModelContract: " + "; ".join(wrong))
