"""Build the module of each pipeline stage from a full model, and describe a stage's input/output shapes.

Stages are built by construction, never by tracing: for each stage the modules it does not keep are detached from
the model for the duration of one `copy.deepcopy`, so only the kept parts are copied (nothing is allocated for a
meta-device model) and the original is restored untouched. Layer containers become `nn.ModuleDict`s keyed by the
ORIGINAL layer index, so parameter names stay those of the unsplit model. Unless the model keeps its own forward,
the copy's text decoder and top-level model become instances of stage classes (`_stage_class`): subclasses of their
own classes whose `forward` is the pipeline forward of `hf_utils`'s table, made once per class, as FSDP2 makes
`FSDP<Class>`. So names, state-dict keys, class attributes and `isinstance` stay the model's, and no forward is bound
onto an instance (upstream's `patch_hf_model_for_pp` does that; it stays for callers, the core does not use it).
Every stage emits only tensors (a forward hook).

What it must not do: change the model it is given or any class (stage classes are new subclasses), need a process
group, decide how many stages there are (that is `planning`), or import a model package (it reads the model's
contract, `contract_of(model).pp`, and upstream's `get_pipeline_stage_metas` hook).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .hf_utils import _assign_pipeline_forwards, model_keeps_self_forward, statically_defines
from .hf_validation import _reentrant_checkpointing_problem, check_forward_reproduction
from .outputs import pipeline_output_names, read_stage_output

__all__ = ["build_stage_modules", "stage_metas"]


# ------------------------------------------------------------------------------------------------------------
# Building stage modules without copying the whole model
# ------------------------------------------------------------------------------------------------------------


def _has_kept_descendant(fqn: str, keep: set[str]) -> bool:
    prefix = fqn + "."
    return any(name.startswith(prefix) for name in keep)


def _detach_unkept(module: nn.Module, prefix: str, keep: set[str], undo: list[tuple[nn.Module, str, Any]]) -> None:
    """Replace, in place and reversibly, every child of `module` the stage does not keep (see `build_stage_modules`)."""
    for name, child in list(module._modules.items()):
        fqn = f"{prefix}{name}"
        if child is None or fqn in keep:
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            kept = [k for k in child._modules if f"{fqn}.{k}" in keep or _has_kept_descendant(f"{fqn}.{k}", keep)]
            replacement = nn.ModuleDict({k: child._modules[k] for k in kept})
            undo.append((module, name, child))
            module._modules[name] = replacement
            for k in kept:
                if f"{fqn}.{k}" not in keep:
                    _detach_unkept(child._modules[k], f"{fqn}.{k}.", keep, undo)
            continue
        if not _has_kept_descendant(fqn, keep):
            undo.append((module, name, child))
            module._modules[name] = None
            continue
        _detach_unkept(child, f"{fqn}.", keep, undo)


def _copy_kept(model: nn.Module, keep: set[str]) -> nn.Module:
    undo: list[tuple[nn.Module, str, Any]] = []
    try:
        _detach_unkept(model, "", keep, undo)
        return copy.deepcopy(model)
    finally:
        for parent, name, child in reversed(undo):
            parent._modules[name] = child


# ------------------------------------------------------------------------------------------------------------
# Stage classes: the pipeline forward as the class's own forward
# ------------------------------------------------------------------------------------------------------------

ForwardFactory = Callable[[], Callable[..., Any]]

_STAGE_CLASSES: dict[tuple[type, ForwardFactory], type] = {}


def _stage_class(cls: type, factory: ForwardFactory, *, hidden_states_supported: bool = False) -> type:
    """The subclass of `cls` whose `forward` is `factory()` (made once per class and factory, then reused).

    It keeps `cls`'s name, module and every class attribute (contract, `_no_split_modules`, `_tp_plan`, hooks);
    `_am_pipeline_stage_of` names `cls`. `hidden_states_supported`: the generic causal-LM forward can return hidden
    states (upstream's `_pp_return_hidden_states_supported` flag).
    """
    key = (cls, factory)
    found = _STAGE_CLASSES.get(key)
    if found is None:
        namespace: dict[str, Any] = {
            "forward": factory(),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_am_pipeline_stage_of": cls,
        }
        if hidden_states_supported:
            namespace["_pp_return_hidden_states_supported"] = True
        found = _STAGE_CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return found


def _as_stage(module: nn.Module, factory: ForwardFactory, hidden_states_supported: bool = False) -> None:
    """Make `module` (a stage's own copy, never the caller's model) an instance of its stage class."""
    cls = getattr(type(module), "_am_pipeline_stage_of", type(module))
    module.__class__ = _stage_class(cls, factory, hidden_states_supported=hidden_states_supported)


def _emit_tensors_only(stage_model: nn.Module, *, stage_index: int = -1) -> nn.Module:
    """Make the stage return tensors only: `ModelOutput` -> `.logits`; anything else that is not a tensor or a
    tuple of tensors raises a ValueError (it could not travel to the next stage). Idempotent.

    A forward hook of this module (no forward is rebound): it travels with `copy.deepcopy` and acts on the copy.
    """
    if not any(getattr(hook, "func", None) is _tensors_only for hook in stage_model._forward_hooks.values()):
        stage_model.register_forward_hook(functools.partial(_tensors_only, stage_index=stage_index))
    return stage_model


def _tensors_only(_module: nn.Module, _args: Any, output: Any, *, stage_index: int) -> Any:
    """`_emit_tensors_only`'s forward hook: the stage output that can travel to the next stage, or a ValueError."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is not None and not isinstance(output, tuple) and hasattr(output, "keys"):
        return logits
    if isinstance(output, tuple) and type(output) is not tuple:
        raise ValueError(
            f"Pipeline stage {stage_index} returned a {type(output).__name__} (a tuple subclass): torch's pipeline "
            "treats only a plain tuple as several outputs, so this would travel as ONE non-tensor value and "
            "the last stage's backward would fail. Fix: return a plain tuple and declare what each position is "
            "in the model's contract, `PipelineContract(output_names=...)` (`pipeline_output_names`, see "
            "am_pipelining.outputs)."
        )
    if isinstance(output, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in output):
        return tuple(output)
    described = (
        f"a {type(output).__name__} holding {[type(o).__name__ for o in output]}"
        if isinstance(output, (tuple, list))
        else f"a {type(output).__name__}"
    )
    raise ValueError(
        f"Pipeline stage {stage_index} returned {described}; only tensors (or a tuple of tensors) can travel "
        "between stages. Fix: return masks/caches/metadata as tensors, or rebuild them on each stage "
        "(e.g. causal masks are rebuilt and cached per stage)."
    )


def build_stage_modules(
    model: nn.Module,
    module_names_per_stage: Sequence[Sequence[str]],
    stage_ids: Sequence[int],
    *,
    patch_inner_model: bool = True,
    patch_causal_lm_model: bool = True,
) -> list[nn.Module]:
    """One pruned copy of `model` per stage id, running the pipeline forwards (no process group needed).

    Only the modules a stage keeps are copied: the others are detached from `model` during the copy and put back
    after, so `model` is unchanged and a meta-device model allocates nothing. In each copy, modules not kept are
    `None`, `ModuleList`s become `ModuleDict`s keyed by the original index strings, and tied weights stay tied
    when both ends are kept. Unless the model keeps its own forward, the copy's text decoder (`patch_inner_model`)
    and top-level model (`patch_causal_lm_model`; the names are upstream's) are instances of their stage classes
    (subclasses with the pipeline forward; parameter names and class attributes unchanged).

    Raises:
        ValueError: listing every forward-level feature of `model` the pipeline forwards would not reproduce
            (`check_forward_reproduction`), before any stage is built.
    """
    reentrant = _reentrant_checkpointing_problem(model)
    if reentrant is not None:
        raise ValueError(reentrant)
    check_forward_reproduction(model)
    keep_self_forward = model_keeps_self_forward(model)
    stage_models = []
    for stage_id in stage_ids:
        keep = set(module_names_per_stage[stage_id])
        stage_model = _copy_kept(model, keep)
        for module in stage_model.modules():
            module.__dict__.pop("_pp_causal_mask_cache", None)
            module.__dict__.pop("_pp_mask_builds", None)
        if not keep_self_forward:
            # the forwards `patch_hf_model_for_pp` would bind, made the stage classes' own
            _assign_pipeline_forwards(
                stage_model, inner=patch_inner_model, outer=patch_causal_lm_model, assign=_as_stage
            )
        stage_model._pp_stage_index = stage_id  # type: ignore[assignment]
        _emit_tensors_only(stage_model, stage_index=stage_id)
        stage_models.append(stage_model)
    return stage_models


# ------------------------------------------------------------------------------------------------------------
# Static stage shapes
# ------------------------------------------------------------------------------------------------------------


def _hidden_and_vocab_size(config: Any) -> tuple[int, int]:
    text_config = getattr(config, "text_config", None)
    sizes = []
    for field in ("hidden_size", "vocab_size"):
        value = getattr(config, field, None)
        if value is None and text_config is not None:
            value = getattr(text_config, field, None)
        if value is None:
            raise ValueError(
                f"Cannot determine {field} from {type(config).__name__}. Expected either model_config.{field} or "
                f"model_config.text_config.{field}."
            )
        sizes.append(int(value))
    return sizes[0], sizes[1]


def stage_metas(
    stage_model: Any,
    *,
    is_first: bool,
    is_last: bool,
    microbatch_size: int,
    seq_len: int,
    dtype: torch.dtype | None = None,
    config: Any = None,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Meta tensors describing a stage's input and output, so torch skips its shape-inference round trip.

    `config` (hidden and vocabulary sizes, `text_config` fallback) defaults to `stage_model.config`.

    A model's `get_pipeline_stage_metas(*, is_first, microbatch_size, seq_len, dtype)` wins when defined (on the
    last stage, its outputs must fit the model's `pipeline_output_names` when it declares them).
    Otherwise: first stage input `[mb, S]` int64, others `[mb, S, H]`; output `[mb, S, V]` when the stage has
    an `lm_head` (and does not return hidden states), else `[mb, S, H]`.
    """
    if dtype is None:
        first_param = next(stage_model.parameters(), None)
        dtype = first_param.dtype if first_param is not None else torch.float32
    if statically_defines(stage_model, "get_pipeline_stage_metas"):
        hook_inputs, hook_outputs = stage_model.get_pipeline_stage_metas(
            is_first=is_first, microbatch_size=microbatch_size, seq_len=seq_len, dtype=dtype
        )
        names = pipeline_output_names(stage_model)
        if is_last and names is not None:
            read_stage_output(tuple(hook_outputs), names=names)  # the declaration must fit the declared shapes
        return tuple(hook_inputs), tuple(hook_outputs)
    hidden, vocab = _hidden_and_vocab_size(stage_model.config if config is None else config)
    meta = torch.device("meta")
    if is_first:
        inputs: tuple[torch.Tensor, ...] = (torch.empty(microbatch_size, seq_len, dtype=torch.long, device=meta),)
    else:
        inputs = (torch.empty(microbatch_size, seq_len, hidden, dtype=dtype, device=meta, requires_grad=True),)
    has_head = getattr(stage_model, "lm_head", None) is not None and is_last
    returns_hidden = getattr(stage_model, "_pp_return_hidden_states", False) is True
    width = vocab if has_head and not returns_hidden else hidden
    outputs = (torch.empty(microbatch_size, seq_len, width, dtype=dtype, device=meta, requires_grad=True),)
    return inputs, outputs
