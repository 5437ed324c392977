"""Casting a model to a storage dtype while fp32-pinned tensors stay fp32, bit for bit.

What it is for: `cast_model_to_dtype` (the bf16 storage cast that honours `_keep_in_fp32_modules[_strict]`, FSDP2
sharding and `skip_modules`), `yield_fp32_model` (fp32 for the duration of a block, e.g. random init) and
`cast_frozen_modules_to_compute_dtype` (frozen towers and LoRA base layers to the compute dtype).
What it must not do: round a pinned tensor, not even transiently: pinned tensors are never converted to the target
dtype and back; `Module._apply` (the path `Module.to` takes, and which FSDP2 hooks to re-register its sharded
storage) receives a conversion that maps pinned tensors to fp32 and leaves skipped ones untouched.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .keep_rules import KeepRule, canonical_name, fp32_keep_rules, match_keep_rule

__all__ = [
    "cast_frozen_modules_to_compute_dtype",
    "cast_model_to_dtype",
    "is_dtensor",
    "yield_fp32_model",
]

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed support
    _DTensor = None  # type: ignore[assignment,misc]

try:
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:
    _FSDPModule = None  # type: ignore[assignment,misc]


def is_dtensor(tensor: object) -> bool:
    """Whether `tensor` is a `torch.distributed.tensor.DTensor` (e.g. an FSDP2-sharded parameter)."""
    return _DTensor is not None and isinstance(tensor, _DTensor)


def _check_skip_modules(skip_modules: Iterable[str]) -> tuple[str, ...]:
    if isinstance(skip_modules, str):
        raise TypeError(
            f"skip_modules must be a collection of module names, got the string {skip_modules!r}; "
            f"write ({skip_modules!r},)"
        )
    names = tuple(skip_modules)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"skip_modules must hold module names (str); invalid entries: {bad!r}")
    return names


def _skipped_tensor_ids(model: nn.Module, skip_modules: tuple[str, ...]) -> set[int]:
    """ids of every parameter, gradient and buffer under a module whose attribute name or dotted name is skipped."""
    if not skip_modules:
        return set()
    wanted = set(skip_modules)
    ids: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        attribute = name.rsplit(".", 1)[-1]
        if attribute in wanted or name in wanted or canonical_name(name) in wanted:
            for param in module.parameters():
                ids.add(id(param))
                if param.grad is not None:
                    ids.add(id(param.grad))
            ids.update(id(b) for b in module.buffers())
    return ids


def _reshard_fsdp_modules(model: nn.Module) -> None:
    # An unsharded FSDP2 module registers its full parameters; FSDP2's _apply re-registers the sharded ones before
    # converting. Reshard first so the tensors we classify are the ones _apply will see.
    if _FSDPModule is None:
        return
    for module in model.modules():
        if isinstance(module, _FSDPModule):
            module.reshard()


def _pinned_tensor_ids(model: nn.Module, rules: tuple[KeepRule, ...]) -> tuple[set[int], list[str]]:
    """ids of tensors to keep in fp32, and the names of non-strict matches left unpinned because they are DTensors.

    Pinned: every parameter (and its gradient) matching a strict rule; every plain (non-DTensor) parameter matching
    a non-strict rule; every buffer matching any rule. Names are matched with and without wrapper segments.
    """
    pinned: set[int] = set()
    unpinned_sharded: list[str] = []
    if not rules:
        return pinned, unpinned_sharded
    for name, param in model.named_parameters(remove_duplicate=False):
        rule = match_keep_rule(name, rules)
        if rule is None:
            continue
        if rule.strict or not is_dtensor(param):
            pinned.add(id(param))
            if param.grad is not None:
                pinned.add(id(param.grad))
        else:
            unpinned_sharded.append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if match_keep_rule(name, rules) is not None:
            pinned.add(id(buffer))
    # A tensor reachable under a pinned name is pinned, even if another alias did not match.
    unpinned_sharded = [n for n in unpinned_sharded if id(model.get_parameter(n)) not in pinned]
    return pinned, unpinned_sharded


def cast_model_to_dtype(
    model: nn.Module,
    dtype: torch.dtype = torch.bfloat16,
    skip_modules: Iterable[str] = (),
) -> nn.Module:
    """Cast floating parameters and buffers to `dtype`, except fp32-pinned ones (fp32) and skipped modules (as is).

    Pinned tensors follow the model's keep rules (`fp32_keep_rules`: substring match of `_keep_in_fp32_modules_strict`
    and `_keep_in_fp32_modules` on dotted names, activation-checkpoint wrappers resolved):
      - strict rules pin parameters and buffers, also FSDP2-sharded (DTensor) parameters, which stay DTensors
        with their local shards unchanged;
      - non-strict rules pin buffers and plain parameters; a DTensor parameter matched only by a non-strict rule
        is cast to `dtype` with a warning, because FSDP2 all-gathers a parameter group in one dtype.
    Pinned tensors are never converted to `dtype`, so their values survive bit-exactly (a pinned tensor stored in
    another float dtype is upcast to fp32). Integer and bool tensors are left alone, as by `Module.to`.

    Args:
        model: the model, plain or FSDP2-sharded; modified in place.
        dtype: the floating storage dtype for everything not pinned or skipped.
        skip_modules: attribute names (e.g. "_fp32_params", any depth) or dotted module names whose whole subtree
            is left untouched, e.g. an FSDP2-sharded fp32 parameter holder. Names that match nothing are ignored.

    Returns:
        `model`.

    Raises:
        TypeError: `dtype` is not a floating dtype, `skip_modules` is a bare string, or a keep list is malformed.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"cast_model_to_dtype: dtype must be a floating torch.dtype, got {dtype!r}")
    skip_names = _check_skip_modules(skip_modules)
    rules = fp32_keep_rules(model)
    _reshard_fsdp_modules(model)
    skipped = _skipped_tensor_ids(model, skip_names)
    pinned, unpinned_sharded = _pinned_tensor_ids(model, rules)
    if unpinned_sharded and dtype != torch.float32:
        warnings.warn(
            f"cast_model_to_dtype: {len(unpinned_sharded)} FSDP2-sharded parameter(s) match only non-strict fp32 "
            f"keep keywords and were cast to {dtype} (FSDP2 all-gathers a parameter group in one dtype): "
            f"{unpinned_sharded}. To keep them fp32, list the keyword in _keep_in_fp32_modules_strict and shard "
            "those modules in their own fully_shard group.",
            stacklevel=2,
        )

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) in skipped or not tensor.is_floating_point():
            return tensor
        return tensor.to(torch.float32 if id(tensor) in pinned else dtype)

    # The decisions above are keyed by id(); hold every tensor until _apply is done so no id can be recycled.
    params = list(model.parameters())
    alive = [*params, *(p.grad for p in params if p.grad is not None), *model.buffers()]
    model._apply(convert)
    del alive
    return model


def _entry_storage_dtype(model: nn.Module, skip_names: tuple[str, ...]) -> torch.dtype:
    """The one dtype of the floating parameters that a cast would change (not pinned, not skipped).

    Pinned parameters are fp32 whatever the storage dtype, so they say nothing about it: reading them (e.g. a
    model whose first parameter is a kept-fp32 norm) would leave the whole model in fp32 after the block.
    """
    skipped = _skipped_tensor_ids(model, skip_names)
    pinned, _ = _pinned_tensor_ids(model, fp32_keep_rules(model))
    dtypes: dict[torch.dtype, str] = {}
    for name, param in model.named_parameters():
        if param.is_floating_point() and id(param) not in pinned and id(param) not in skipped:
            dtypes.setdefault(param.dtype, name)
    if len(dtypes) > 1:
        found = ", ".join(f"{dtype} (e.g. {name!r})" for dtype, name in dtypes.items())
        raise ValueError(
            f"yield_fp32_model: the unpinned floating parameters hold several dtypes ({found}), so there is no "
            "single dtype to restore on exit; pass restore_dtype=<the storage dtype> explicitly."
        )
    return next(iter(dtypes), torch.float32)


@contextlib.contextmanager
def yield_fp32_model(
    model: nn.Module,
    restore_dtype: torch.dtype | None = None,
    *,
    skip_modules: Iterable[str] = (),
) -> Iterator[nn.Module]:
    """Hold `model` in fp32 inside the block, then cast it to `restore_dtype` (pinned tensors stay fp32).

    Typical use: sample random initial weights in fp32, then round once to bf16 (unbiased rounding of the
    fp32 sample rather than sampling in bf16). Works before and after FSDP2 sharding.

    Args:
        model: the model, modified in place.
        restore_dtype: the dtype to cast back to on exit; default: the storage dtype on entry, i.e. the dtype of
            the floating parameters that are neither pinned nor skipped (fp32 when there is none).
        skip_modules: passed to `cast_model_to_dtype` both ways.

    Yields:
        `model` itself.

    Raises:
        ValueError: `restore_dtype` is None and the unpinned parameters hold more than one dtype (e.g. after
            `cast_frozen_modules_to_compute_dtype`); nothing is cast then.
    """
    if restore_dtype is None:
        _reshard_fsdp_modules(model)  # classify the sharded parameters, as cast_model_to_dtype does
        restore_dtype = _entry_storage_dtype(model, _check_skip_modules(skip_modules))
    cast_model_to_dtype(model, torch.float32, skip_modules=skip_modules)
    try:
        yield model
    finally:
        cast_model_to_dtype(model, restore_dtype, skip_modules=skip_modules)


def _is_within(name: str, roots: Iterable[str]) -> bool:
    """Whether module `name` is one of `roots` or lies below one of them ("" is the root of everything)."""
    return any(root == "" or name == root or name.startswith(root + ".") for root in roots)


def _ancestors(module_name: str) -> list[str]:
    parts = module_name.split(".") if module_name else []
    return ["", *(".".join(parts[:i]) for i in range(1, len(parts) + 1))]


def cast_frozen_modules_to_compute_dtype(model: nn.Module, compute_dtype: torch.dtype | None) -> nn.Module:
    """Store frozen (non-trainable) parts of a model in `compute_dtype`, e.g. a frozen vision tower or LoRA base.

    Trainable parameters keep their dtype (typically fp32 master weights) except inside a "mixed" subtree: a module
    that owns a frozen parameter and also has trainable descendants (LoRA: frozen base weight + trainable adapter
    children); its whole subtree is cast so the frozen and adapter paths compute in one dtype. Parameters and buffers
    matching the fp32 keep rules are never cast. DTensor parameters are skipped (cast them before sharding).
    Floating buffers are cast inside fully frozen subtrees (params present, none trainable) and mixed subtrees.

    Args:
        model: the model, modified in place.
        compute_dtype: target floating dtype; None makes this a no-op.

    Returns:
        `model`.
    """
    if compute_dtype is None:
        return model
    if not compute_dtype.is_floating_point:
        raise TypeError(f"compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}")
    rules = fp32_keep_rules(model)

    def pinned(name: str) -> bool:
        return match_keep_rule(name, rules) is not None

    frozen_owners: set[str] = set()
    trainable_ancestors: set[str] = set()
    params = list(model.named_parameters(remove_duplicate=False))
    for full_name, param in params:
        owner = full_name.rpartition(".")[0]
        if param.requires_grad:
            trainable_ancestors.update(_ancestors(owner))
        elif param.is_floating_point() and not pinned(full_name) and not is_dtensor(param):
            frozen_owners.add(owner)
    mixed = frozen_owners & trainable_ancestors

    done: set[int] = set()
    for full_name, param in params:
        if id(param) in done or pinned(full_name) or is_dtensor(param) or not param.is_floating_point():
            continue
        owner = full_name.rpartition(".")[0]
        if param.requires_grad and not _is_within(owner, mixed):
            continue
        done.add(id(param))
        param.data = param.data.to(compute_dtype)

    # Subtrees that hold parameters but no trainable one (a buffer under any of them lies under the outermost one).
    with_params = {a for full_name, _ in params for a in _ancestors(full_name.rpartition(".")[0])}
    cast_roots = [*(with_params - trainable_ancestors), *mixed]
    converted: dict[int, torch.Tensor] = {}
    for full_name, buffer in list(model.named_buffers(remove_duplicate=False)):
        owner_name, _, local = full_name.rpartition(".")
        if buffer is None or not buffer.is_floating_point() or pinned(full_name):
            continue
        if not _is_within(owner_name, cast_roots):
            continue
        if id(buffer) not in converted:
            converted[id(buffer)] = buffer.to(compute_dtype)
        model.get_submodule(owner_name)._buffers[local] = converted[id(buffer)]
    return model
