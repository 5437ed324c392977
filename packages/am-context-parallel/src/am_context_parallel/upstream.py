"""NeMo AutoModel's CP spellings (pre-refactor `cp_utils`, `gemma4_moe/cp_batch`), as thin wrappers over the core.

What it is for: code written against upstream runs unchanged after `from am_context_parallel.upstream import ...`:
`make_cp_batch_and_ctx(device_mesh, batch, loss_mask, use_te, padding_token_id, num_chunks, seq_lens_padding_value,
extra_seq_buffers)` without a model, `make_contiguous_shard_cp_batch_and_ctx(cp_mesh, tp_mesh, batch, loss_mask,
padding_token_id)`, `_synthesize_single_document_seq_ids`, and the torch-style `get_train_context`,
`create_context_parallel_ctx`, `attach_context_parallel_hooks`, `attach_cp_sdpa_hooks`,
`unshard_context_parallel_tensor`. Upstream builds the torch-style ones on torch's experimental `context_parallel`
(in-place head-tail sharding of registered buffers, SDPA swapped for ring attention); here the same contract is met
with `LoadBalancedLayout` (the same head-tail layout) and `RingAttentionContext`.

The model-less routing lives HERE only (the core routes one model, through transformers' attention registry, and
checks that every block called the ring): upstream's model-less entry points cannot know the model, so while their
context is open they route transformers' `sdpa` / `eager` registry entries (for every model) and, through a torch
function mode on the calling thread (no module attribute is rebound), every `scaled_dot_product_attention` call to
the ring, as torch's `context_parallel` does. What that cannot see (as upstream): attention computed without either
(a model that multiplies Q and K itself) stays local and is NOT detected here; use the core
`am_context_parallel.make_cp_batch_and_ctx(mesh, batch, model=model)`, which refuses such a model.
What it must not do: be imported by the core, hold a second implementation of anything, import transformers, or
accept an option it does not honour (`cp_rotate_method="allgather"`: our ring always rotates K/V point to point).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .batch import shard_cp_batch

# upstream's name, private there too: importable by name (`from am_context_parallel.upstream import ...`), not in
# `__all__`
from .batch_keys import _synthesize_single_document_seq_ids as _synthesize_single_document_seq_ids
from .context import RingAttentionContext, current_ring_context
from .contiguous import contiguous_shard
from .hf import RING_ATTENTION_NAME, hf_ring_attention_forward
from .layouts import LoadBalancedLayout
from .mesh import cp_rank
from .model_protocol import ContiguousCPOptions

__all__ = [
    "attach_context_parallel_hooks",
    "attach_cp_sdpa_hooks",
    "create_context_parallel_ctx",
    "get_train_context",
    "make_contiguous_shard_cp_batch_and_ctx",
    "make_cp_batch_and_ctx",
    "routed_hf_attention",
    "unshard_context_parallel_tensor",
]

ContextFactory = Callable[[], contextlib.AbstractContextManager[Any]]
_ROUTED_NAMES = ("sdpa", "eager", RING_ATTENTION_NAME)
_MISSING = object()
_SDPA = F.scaled_dot_product_attention  # the torch function the ring stands in for (see _RingSDPAMode)

# torch's names for its K/V rotation; our ring sends K/V chunks point to point, which is torch's "alltoall".
_ROTATE_METHODS = (None, "alltoall")


@torch._dynamo.disable
def _ring_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`'s signature on local `[B, heads, S_local, d]` tensors, run as the ring.

    Raises:
        RuntimeError: outside a ring context (local attention of a shard would be silently wrong).
        ValueError: with an `attn_mask` (built for local tokens, it cannot describe the sharded sequence).
        NotImplementedError: with attention dropout.
    """
    ctx = current_ring_context()
    if ctx is None:
        raise RuntimeError(
            "scaled_dot_product_attention was routed to context-parallel ring attention outside a CP context; run "
            "forward and backward inside the context from make_cp_batch_and_ctx / create_context_parallel_ctx"
        )
    if attn_mask is not None:
        raise ValueError(
            f"ring attention got an attn_mask of shape {tuple(attn_mask.shape)}; a mask of the local tokens cannot "
            "describe a sharded sequence: call attach_context_parallel_hooks(model) (drops it, sets is_causal=True) "
            "or pass documents as padding_mask / _packed_seq_ids to make_cp_batch_and_ctx"
        )
    if dropout_p:
        raise NotImplementedError(f"attention dropout ({dropout_p}) is not supported by ring attention; use 0.0")
    del enable_gqa  # the ring handles fewer K/V heads than query heads either way
    return ctx.attention(query, key, value, causal=is_causal, scale=scale)


@contextlib.contextmanager
def routed_hf_attention() -> Iterator[None]:
    """While open, transformers' `sdpa`, `eager` and `am_cp_ring` registry entries all dispatch to the ring, for every
    model and thread (upstream's process-wide routing; the core routes one model instead).

    A no-op when transformers has not been imported (no HF model can exist then).
    """
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is None:
        yield
        return
    mapping: dict[str, Any] = interface._global_mapping
    saved = {name: mapping.get(name, _MISSING) for name in _ROUTED_NAMES}
    for name in _ROUTED_NAMES:
        mapping[name] = hf_ring_attention_forward
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is _MISSING:
                mapping.pop(name, None)
            else:
                mapping[name] = previous


class _ProcessWideRing:
    """A core `RingAttentionContext` whose entry also swaps the process-wide attention entry points to the ring.

    Reads like the context it wraps (`positions`, `doc_ids`, `layout`, `unshard`, `attention`, ...)."""

    def __init__(self, ring: RingAttentionContext) -> None:
        self.ring = ring

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ring, name)

    def __call__(self) -> contextlib.AbstractContextManager[RingAttentionContext]:
        return _process_wide(self.ring)


@contextlib.contextmanager
def _process_wide(ring: RingAttentionContext) -> Iterator[RingAttentionContext]:
    """The core ring context with upstream's process-wide routing while open (HF's registry entries and SDPA)."""
    with ring() as entered, routed_hf_attention(), _RingSDPAMode():
        yield entered


def make_cp_batch_and_ctx(
    device_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    use_te: bool = False,
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
    extra_seq_buffers: list[str] | None = None,
) -> tuple[ContextFactory, dict[str, Any]]:
    """Upstream's model-less `make_cp_batch_and_ctx`: the core's sharding, with process-wide attention routing.

    Same positional order, defaults, paths and batch semantics as `am_context_parallel.make_cp_batch_and_ctx` (see
    it). On the load-balanced path (C > 1) the returned factory enters the core's ring context and, while open,
    `routed_hf_attention()` and the `F.scaled_dot_product_attention` swap (module docstring): nothing checks that
    the model's attention reached the ring — pass the model to the core function for that.
    """
    ctx, batch = shard_cp_batch(
        device_mesh,
        batch,
        loss_mask,
        use_te,
        padding_token_id,
        num_chunks,
        seq_lens_padding_value,
        extra_seq_buffers,
        model=None,
        require_model=False,
    )
    if isinstance(ctx, RingAttentionContext) and ctx.model is None:
        return _ProcessWideRing(ctx), batch
    return ctx, batch


def make_contiguous_shard_cp_batch_and_ctx(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    *,
    options: ContiguousCPOptions | None = None,
    extra_seq_buffers: list[str] | None = None,
) -> tuple[ContextFactory, dict[str, Any]]:
    """Upstream's Gemma 4 contiguous shard (`gemma4_moe/cp_batch`): the core's `contiguous_shard` without a model.

    The core entry is `make_cp_batch_and_ctx(mesh, batch, model=model)` for a model that declares
    `cp.layout="contiguous"` in its contract. Returns a `RingAttentionContext` for C > 1 (upstream: `nullcontext`),
    which routes no HF attention (`options.route_hf_attention=True` needs the model: use the core entry), and
    `(contextlib.nullcontext, batch)` for C <= 1. See `batch.contiguous_shard` for the keys and padding.
    """
    return contiguous_shard(
        cp_mesh,
        tp_mesh,
        batch,
        loss_mask,
        padding_token_id,
        options=options if options is not None else ContiguousCPOptions(),
        extra_seq_buffers=extra_seq_buffers,
        model=None,
    )


def get_train_context(
    enable_loss_parallel: bool, enable_compiled_autograd: bool, cp_context: Any = None
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A factory of the context to run forward and backward in: loss parallel, compiled autograd, then CP.

    Args:
        enable_loss_parallel: enter torch's `loss_parallel()` (cross entropy on vocabulary-sharded DTensor logits).
        enable_compiled_autograd: enter torch's compiled autograd for the backward.
        cp_context: the CP context: a context manager (what `create_context_parallel_ctx` returns) or a factory
            of one (the `RingAttentionContext` / `nullcontext` from `make_cp_batch_and_ctx`); None for no CP.
    """

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if enable_loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            if enable_compiled_autograd:
                stack.enter_context(torch._dynamo.utils.maybe_enable_compiled_autograd(True))
            if cp_context is not None:
                is_manager = hasattr(cp_context, "__enter__")
                stack.enter_context(cp_context if is_manager else cp_context())
            yield

    return context


class _BufferShardContext:
    """Shards registered buffers in place on entry, routes SDPA to the ring, restores the buffers on exit."""

    def __init__(
        self, cp_mesh: Any, buffers: list[torch.Tensor], seq_dims: list[int], no_restore: set[int], seq_len: int
    ) -> None:
        self._buffers, self._seq_dims, self._no_restore = buffers, seq_dims, no_restore
        self._layout = LoadBalancedLayout(cp_size=cp_mesh.size(), cp_rank=cp_rank(cp_mesh))
        self._ring = RingAttentionContext(
            group=cp_mesh.get_group(),
            layout=self._layout,
            positions=self._layout.local_indices(seq_len, device=buffers[0].device if buffers else None),
            doc_ids=None,
            seq_len=seq_len,
            padded_len=seq_len,
        )
        self._saved: list[torch.Tensor | None] = []
        self._stack: contextlib.ExitStack | None = None
        self._used = False

    def __enter__(self) -> RingAttentionContext:
        if self._used:
            raise RuntimeError("a context from create_context_parallel_ctx shards its buffers once; create a new one")
        self._used = True
        self._saved = []
        for buffer, seq_dim in zip(self._buffers, self._seq_dims, strict=True):
            local = self._layout.shard(buffer.detach(), seq_dim=seq_dim)
            keep = id(buffer) not in self._no_restore
            self._saved.append(buffer.detach().clone() if keep else None)
            buffer.data = local.contiguous()  # in place for every holder of `buffer` (no resize_ of grad tensors)
        self._stack = contextlib.ExitStack()
        return self._stack.enter_context(_process_wide(self._ring))

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None
        self._stack.close()
        for buffer, saved in zip(self._buffers, self._saved, strict=True):
            if saved is not None:
                buffer.data = saved


class _RingSDPAMode(TorchFunctionMode):
    """While active on a thread, every `scaled_dot_product_attention` call there runs as the ring.

    A torch function mode, not a rebinding of `torch.nn.functional.scaled_dot_product_attention`: nothing global is
    patched (the mode stack is per thread), and a call through a name bound at import time is routed too.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is _SDPA:
            return _ring_sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def create_context_parallel_ctx(
    cp_mesh: Any,
    cp_buffers: Sequence[torch.Tensor],
    cp_seq_dims: Sequence[int],
    cp_no_restore_buffers: set[torch.Tensor] | Sequence[torch.Tensor],
    cp_rotate_method: str | None = None,
) -> contextlib.AbstractContextManager[Any]:
    """A context that shards `cp_buffers` head-tail over `cp_mesh` in place and makes attention a ring.

    On entry every buffer (`[..., S, ...]` with the sequence on its `cp_seq_dims` entry) is replaced in place by
    this rank's chunks r and 2C−1−r of 2C (torch's load-balanced layout, `LoadBalancedLayout`); inside, calls of
    `torch.nn.functional.scaled_dot_product_attention` (looked up through the module at call time) and HF's
    `sdpa`/`eager` attention compute exact attention over the group; on exit the buffers not in
    `cp_no_restore_buffers` get their full contents back. Enter it once.

    Args:
        cp_mesh: the 1-D CP mesh (anything with `size()`, `get_group()`, `get_local_rank()`).
        cp_buffers: tensors sharing one sequence length S, a multiple of 2C (pad first, e.g. with
            `pad_sequence_dim`). A tensor that requires grad is sharded by swapping its `.data` (its autograd
            history is not carried: shard embeddings out of place with `make_cp_batch_and_ctx`).
        cp_seq_dims: the sequence dim of each buffer.
        cp_no_restore_buffers: buffers left sharded on exit (e.g. labels the loss reads afterwards).
        cp_rotate_method: None or "alltoall" (the ring's point-to-point K/V rotation).

    Raises:
        ValueError: listing every problem: lengths of buffers and dims differ, sequence lengths differ or are not a
            multiple of 2C, a no-restore tensor is not one of the buffers, or `cp_rotate_method="allgather"`.
    """
    buffers, seq_dims = list(cp_buffers), list(cp_seq_dims)
    cp_size = cp_mesh.size()
    problems: list[str] = []
    if cp_rotate_method not in _ROTATE_METHODS:
        problems.append(
            f"cp_rotate_method={cp_rotate_method!r}: the ring rotates K/V point to point (torch's 'alltoall'); "
            "an all-gather rotation is not implemented, pass None or 'alltoall'"
        )
    if len(buffers) != len(seq_dims):
        problems.append(f"{len(buffers)} cp_buffers but {len(seq_dims)} cp_seq_dims; give one dim per buffer")
    lengths = {b.shape[d] for b, d in zip(buffers, seq_dims, strict=False) if -b.dim() <= d < b.dim()}
    bad_dims = [i for i, (b, d) in enumerate(zip(buffers, seq_dims, strict=False)) if not -b.dim() <= d < b.dim()]
    if bad_dims:
        problems.append(f"cp_seq_dims of buffers {bad_dims} are outside their tensors' dims")
    if len(lengths) > 1:
        problems.append(f"the buffers have different sequence lengths {sorted(lengths)}; they must share one")
    bad_lengths = sorted(n for n in lengths if n % (2 * cp_size))
    if bad_lengths:
        problems.append(f"CP sequence length {bad_lengths[0]} must be divisible by 2C = {2 * cp_size}; pad it first")
    ids = {id(b) for b in buffers}
    strangers = [i for i, t in enumerate(cp_no_restore_buffers) if id(t) not in ids]
    if strangers:
        problems.append(f"cp_no_restore_buffers entries {strangers} are not among cp_buffers (matched by identity)")
    if problems:
        raise ValueError("create_context_parallel_ctx:\n" + "\n".join(f"  - {p}" for p in problems))
    if cp_size <= 1:
        return contextlib.nullcontext()
    seq_len = next(iter(lengths)) if lengths else 0
    return _BufferShardContext(cp_mesh, buffers, seq_dims, {id(t) for t in cp_no_restore_buffers}, seq_len)


def _attention_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Every module whose name ends with `self_attn`, unwrapped from activation checkpointing (so hooks fire in
    the recompute too)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            yield module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module


def attach_context_parallel_hooks(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """On every `*self_attn` module, drop an `attention_mask` keyword and set `is_causal=True` before forward.

    A 4-D mask built for the local tokens cannot describe a sequence sharded over the CP group; the ring masks
    causally by global position instead. Calls without an `attention_mask` keyword are untouched. Returns the hook
    handles (`handle.remove()` detaches them).
    """

    def drop_mask(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
            kwargs["is_causal"] = True
        return args, kwargs

    return [m.register_forward_pre_hook(drop_mask, prepend=True, with_kwargs=True) for m in _attention_modules(model)]


def attach_cp_sdpa_hooks(model: nn.Module, cp_mesh: Any) -> list[torch.utils.hooks.RemovableHandle]:
    """While a `*self_attn` module runs, its `scaled_dot_product_attention` calls are the ring (for compiled models).

    For models that call `F.scaled_dot_product_attention` themselves (compiled, or outside HF's dispatch): the
    pre-hook enters a torch function mode on this thread that sends those calls to the ring (a
    `torch._dynamo.disable`d function, so a compiled graph breaks around it); the post-hook leaves it, also when the
    forward raises. Nothing global is rebound. The ring needs the active CP context (`make_cp_batch_and_ctx` /
    `create_context_parallel_ctx`), whose group must be `cp_mesh`'s. At C = 1 nothing is attached (local attention
    is already exact). Returns the hook handles.
    """
    if cp_mesh.size() <= 1:
        return []
    active: list[_RingSDPAMode] = []

    def swap_in(_module: nn.Module, _args: tuple[Any, ...]) -> None:
        mode = _RingSDPAMode()
        mode.__enter__()
        active.append(mode)

    def restore(_module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        if active:
            active.pop().__exit__(None, None, None)

    handles = []
    for module in _attention_modules(model):
        handles.append(module.register_forward_pre_hook(swap_in))
        handles.append(module.register_forward_hook(restore, always_call=True))
    return handles


def unshard_context_parallel_tensor(cp_mesh: Any, tensor: torch.Tensor, *, seq_dim: int) -> torch.Tensor:
    """Undo the load-balanced (head-tail) layout: this rank's `[..., S/C, ...]` → the full `[..., S, ...]`.

    Identity at C ≤ 1. A collective over `cp_mesh`'s group (every rank calls it); differentiable (each rank gets
    its slice of the gradient). The length stays padded (S, a multiple of 2C).
    """
    cp_size = cp_mesh.size()
    if cp_size <= 1:
        return tensor
    layout = LoadBalancedLayout(cp_size=cp_size, cp_rank=cp_rank(cp_mesh))
    return layout.unshard(tensor, seq_dim=seq_dim, group=cp_mesh.get_group())
