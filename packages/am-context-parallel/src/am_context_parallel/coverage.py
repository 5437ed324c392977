"""Can the package show that every attention of a model goes through the ring? Asked up front, and checked at the
first forward of every context.

What it is for: ring CP is exact only when EVERY attention layer of the model runs as the ring; a layer that
computes attention itself (HF Falcon calls `F.scaled_dot_product_attention` directly, old-style eager code multiplies
Q and K itself) attends only to this rank's tokens, silently. The rule is structural, never a list of architectures:
  1. `attention_blocks(model)`: the model's layer stack, found from its structure — the shallowest `ModuleList` /
     `ModuleDict` of one block class (with `config.num_hidden_layers` entries when the model has an HF config).
  2. `cp_attention_problems(model)` (pure, no collective): what can be known before anything runs — no layer stack,
     an HF `_attn_implementation` that cannot be routed (flash / flex / a kernel name), a block class whose modeling
     code never dispatches through transformers' `ALL_ATTENTION_FUNCTIONS` registry, attention logit soft-capping,
     attention dropout in training.
  3. `AttentionCoverage`: while a `RingAttentionContext` built with the model is entered, the first forward of the
     model counts ring-attention calls per block; a block that made none raises, naming the model class, the calls
     seen and expected and the fix (every rank runs the same model, so every rank raises: nothing hangs).
What it must not do: import transformers (the registry check reads the block's module source text only when its
class comes from a `transformers.models.*` module), or patch anything outside the model it is given (module hooks on
that model only, removed when the context exits).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["AttentionCoverage", "ROUTABLE_ATTENTION", "attention_blocks", "cp_attention_problems", "hf_configs"]

# HF attention implementations the context routes to the ring (by setting the blocks' config to the ring's name).
# None: a config that never chose one (transformers picks sdpa/eager).
ROUTABLE_ATTENTION = (None, "sdpa", "eager", "am_cp_ring")
# How a transformers modeling file dispatches attention through the registry (`ALL_ATTENTION_FUNCTIONS`, or
# `AttentionInterface` in older releases).
_REGISTRY_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface")
_FIX = (
    "run this model with cp=1, use an attention implementation routed through transformers' attention registry "
    "(attn_implementation='sdpa' or 'eager' on a model whose attention dispatches through ALL_ATTENTION_FUNCTIONS), "
    "or let the model call `current_ring_context().attention(q, k, v, ...)` in every attention layer"
)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module inside activation-checkpointing wrappers (the class that holds the attention code)."""
    inner = getattr(module, "_checkpoint_wrapped_module", None)
    return _unwrapped(inner) if isinstance(inner, nn.Module) else module


def attention_blocks(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The model's layer stack: `(qualified name, blocks)`, or None when it has none.

    Candidates are the `nn.ModuleList` / `nn.ModuleDict` containers whose entries are all of one class (after
    unwrapping activation checkpointing); with an HF config, those of `num_hidden_layers` entries are preferred (a
    MoE block's expert list is not the stack); among them the shallowest wins, then the longest.
    """
    candidates: list[tuple[str, list[nn.Module]]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        blocks = list(module.values()) if isinstance(module, nn.ModuleDict) else list(module)
        if blocks and len({type(_unwrapped(block)) for block in blocks}) == 1:
            candidates.append((name, blocks))
    if not candidates:
        return None
    layers = getattr(_text_config(model), "num_hidden_layers", None)
    matching = [c for c in candidates if len(c[1]) == layers]
    pool = matching or candidates
    return min(pool, key=lambda c: (c[0].count(".") if c[0] else -1, -len(c[1])))


def hf_configs(blocks: list[nn.Module]) -> list[Any]:
    """The distinct HF configs (objects with `_attn_implementation`) read by the blocks' modules."""
    seen: dict[int, Any] = {}
    for block in blocks:
        for module in block.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                seen.setdefault(id(config), config)
    return list(seen.values())


def _dispatches_through_registry(block_class: type) -> bool | None:
    """Whether a transformers block's modeling module references the attention registry (None: not transformers)."""
    module_name = block_class.__module__
    if not module_name.startswith("transformers."):
        return None
    source_module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(source_module) if source_module is not None else ""
    except (OSError, TypeError):  # no source shipped: nothing can be shown up front; the first forward decides
        return None
    return any(marker in source for marker in _REGISTRY_MARKERS)


def cp_attention_problems(model: nn.Module) -> list[str]:
    """What can be known up front (no process group, no forward) that keeps the ring from every attention of `model`.

    One line per problem, each naming the model class and the fix; [] when nothing is known to be wrong (the first
    forward under the context still counts the ring calls per block). A model that declares the contiguous layout
    (contract `cp.layout="contiguous"`) owns its CP attention and is not asked.
    """
    from .model_protocol import model_cp_options

    name = type(model).__name__
    if model_cp_options(model) is not None:
        return []
    found = attention_blocks(model)
    if found is None:
        return [
            f"{name}: no layer stack (a ModuleList of one block class) was found, so the package cannot show that "
            f"every attention layer runs as the ring; {_FIX}"
        ]
    stack, blocks = found
    problems = []
    for config in hf_configs(blocks):
        implementation = config._attn_implementation
        if implementation not in ROUTABLE_ATTENTION:
            problems.append(
                f"{name}: attn_implementation={implementation!r} cannot be routed to the ring (only "
                f"{[i for i in ROUTABLE_ATTENTION if i]} can); load the model with attn_implementation='sdpa'"
            )
        softcap = getattr(config, "attn_logit_softcapping", None)
        if softcap is not None:
            problems.append(
                f"{name}: attention logit soft-capping ({softcap}) is not supported by ring attention; set "
                "config.attn_logit_softcapping=None or run this model with cp=1"
            )
    block_class = type(_unwrapped(blocks[0]))
    if _dispatches_through_registry(block_class) is False:
        problems.append(
            f"{name}: its attention ({block_class.__module__}) calls attention itself instead of dispatching "
            f"through transformers' ALL_ATTENTION_FUNCTIONS, so the ring would never see it and each rank would "
            f"attend only to its own tokens; {_FIX}"
        )
    if model.training:
        rates = sorted(
            {
                float(rate)
                for block in blocks
                for module in block.modules()
                for rate in [getattr(module, "attention_dropout", None)]
                if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0
            }
        )
        if rates:
            problems.append(
                f"{name}: attention dropout {rates} is not supported by ring attention; set attention_dropout=0 "
                f"in the config (or call model.eval())"
            )
    del stack
    return problems


class AttentionCoverage:
    """First-forward check that every block of `model`'s layer stack called the ring at least once.

    `attach()` registers forward hooks on the model and its blocks (this model only); `record()` is called by the
    context for every ring-attention call. Counting starts at the first block (or model) forward and is checked at
    the end of the model's forward — or, when the blocks ran without the model's own forward (a caller that runs
    `model.model` and its own head), when the context closes (`close()`). The hooks are then removed; later forwards
    of the same context are not counted. `detach()` removes them without a verdict (an exception is propagating).
    """

    def __init__(self, model: nn.Module) -> None:
        found = attention_blocks(model)
        if found is None:
            raise ValueError("\n".join(cp_attention_problems(model)))
        self.model = model
        self.stack, self.blocks = found
        self.verified = False
        self._counts: list[int] | None = None
        self._current: int | None = None
        self._handles: list[RemovableHandle] = []

    def attach(self) -> None:
        if self.verified or self._handles:
            return
        self._handles.append(self.model.register_forward_pre_hook(self._start))
        self._handles.append(self.model.register_forward_hook(self._finish))  # not on an exception: keep it
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(lambda *_, i=index: self._enter(i)))
            self._handles.append(block.register_forward_hook(lambda *_: self._enter(None), always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._counts, self._current = None, None

    def close(self) -> None:
        """The context closes normally: check a forward that started but whose model-level end was not seen."""
        if self._counts is not None and not self.verified:
            self._finish()
        self.detach()

    def record(self) -> None:
        """One ring-attention call (inside the block being run, if any)."""
        if self._counts is not None and self._current is not None:
            self._counts[self._current] += 1

    def _enter(self, index: int | None) -> None:
        if index is not None:
            self._start()
        self._current = index

    def _start(self, *_: Any) -> None:
        if self._counts is None and not self.verified:
            self._counts = [0] * len(self.blocks)

    def _finish(self, *_: Any) -> None:
        counts = self._counts
        self.detach()
        self.verified = True
        if counts is None:
            return
        silent = [i for i, count in enumerate(counts) if count == 0]
        if silent:
            raise RuntimeError(
                f"context parallelism would be silently wrong for {type(self.model).__name__}: during its first "
                f"forward under the CP context, {len(self.blocks) - len(silent)} of the {len(self.blocks)} blocks of "
                f"'{self.stack}' called ring attention (expected every block to call it at least once; ring calls "
                f"per block {counts}; blocks {silent} made none). Those blocks computed attention (or another "
                f"sequence mixing) on this rank's tokens only; {_FIX}"
            )
