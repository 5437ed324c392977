"""Shard a training batch over the CP group: padding semantics, layouts, and the attention context.

What it is for: the one entry point `make_cp_batch_and_ctx` (contiguous for a model that declares it > THD >
identity > load-balanced, with the model's attention routed to the ring and checked by `coverage.py`); the THD path
is `thd.make_cp_batch_for_te`. Every input problem is reported at once, before anything is changed. What a model
declares is read by `model_protocol.py`. Upstream's other spellings (`make_contiguous_shard_cp_batch_and_ctx`, the
model-less `make_cp_batch_and_ctx`) are thin wrappers in `upstream.py` over `shard_cp_batch` / `contiguous_shard`.
What it must not do: shard in place (torch's experimental `context_parallel` resizes buffers in place and rejects
tensors that need grad; we build new tensors and put them in the batch dict), or communicate (the CP rank comes
from the mesh).

Padding (to a multiple of 2C): input_ids → `padding_token_id`, labels → −100, padding_mask → True,
attention_mask → False, `_packed_seq_ids` → 0, loss_mask → 0, floats → 0, position_ids continue `last+1, ...`
(3-D mRoPE position ids `[3, B, S]` carry the sequence on dim 2), model-supplied keys with their own pad values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .context import RingAttentionContext
from .coverage import cp_attention_problems
from .layouts import ContiguousLayout, Layout, LoadBalancedLayout
from .mesh import cp_rank, sub_mesh
from .model_protocol import ContiguousCPOptions, model_cp_options
from .thd import make_cp_batch_for_te

__all__ = ["contiguous_shard", "make_cp_batch_and_ctx", "shard_cp_batch"]

ContextFactory = Callable[[], contextlib.AbstractContextManager[Any]]

_PRIMARY_KEYS = ("input_ids", "inputs_embeds")


@dataclass(frozen=True)
class _SeqKey:
    seq_dim: int
    batch_dim: int
    pad_value: Any


def _default_pad(key: str, tensor: torch.Tensor, padding_token_id: int) -> Any:
    if key == "input_ids":
        return padding_token_id
    if key == "labels":
        return -100
    if key == "padding_mask":
        return True
    if key == "attention_mask":
        return False
    if key == "position_ids":
        return "continue"
    return False if tensor.dtype == torch.bool else 0


def _position_seq_dim(position_ids: torch.Tensor) -> int:
    return 2 if position_ids.dim() == 3 else 1


def _sequence_keys(
    batch: dict[str, Any], padding_token_id: int, extra_seq_buffers: list[str] | None, *model_keys: str
) -> dict[str, _SeqKey]:
    """The keys both paths pad and shard (with upstream's pad values), `model_keys` (pad 0), the batch's position
    ids (continuing, `[3, B, S]` mRoPE on dim 2) and every present `extra_seq_buffers` key."""
    keys = {
        "input_ids": _SeqKey(1, 0, padding_token_id),
        "inputs_embeds": _SeqKey(1, 0, 0),
        "labels": _SeqKey(1, 0, -100),
        "padding_mask": _SeqKey(1, 0, True),
        "_packed_seq_ids": _SeqKey(1, 0, 0),
        "loss_mask": _SeqKey(1, 0, 0),
        **{key: _SeqKey(1, 0, 0) for key in model_keys},
    }
    _add_position_key(batch, keys)
    for key in extra_seq_buffers or []:
        if isinstance(batch.get(key), torch.Tensor):
            keys.setdefault(key, _SeqKey(1, 0, _default_pad(key, batch[key], padding_token_id)))
    return keys


def _add_position_key(batch: dict[str, Any], keys: dict[str, _SeqKey]) -> None:
    if isinstance(batch.get("position_ids"), torch.Tensor):
        seq_dim = _position_seq_dim(batch["position_ids"])
        keys["position_ids"] = _SeqKey(seq_dim, seq_dim - 1, "continue")


def _padding_mask_from_attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """`[B, S]` True = pad, from a 2-D keep-mask or a 4-D `[B, 1, S, S]` mask (its diagonal)."""
    if mask.dim() == 4:
        diagonal = torch.diagonal(mask[:, 0], dim1=-2, dim2=-1)
        return ~diagonal if diagonal.dtype == torch.bool else diagonal != 0
    return ~mask.bool()


def _synthesize_single_document_seq_ids(batch: dict[str, Any]) -> None:
    """Add `_packed_seq_ids` `[B, S]` when missing: 1 for real tokens, 0 for padding (or all ones).

    Collators emit `_packed_seq_ids` only for rows with two or more packed documents, but the ring mask always
    needs document boundaries (0 marks padding that nothing attends to).
    """
    if "_packed_seq_ids" in batch:
        return
    if "padding_mask" in batch:
        batch["_packed_seq_ids"] = (~batch["padding_mask"].bool()).long()
        return
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    if primary is None:
        return
    batch["_packed_seq_ids"] = torch.ones(primary.shape[:2], dtype=torch.long, device=primary.device)


def _ensure_position_ids(batch: dict[str, Any], primary: torch.Tensor, *, synthesize: bool = True) -> None:
    """Expand `[1, S]` position ids to `[B, S]`; when missing, add `arange(S)` if `synthesize` (never overrides:
    packed sequences carry their own)."""
    b, s = primary.shape[0], primary.shape[1]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        if synthesize:
            batch["position_ids"] = torch.arange(s, device=primary.device).unsqueeze(0).expand(b, s).contiguous()
    elif position_ids.dim() == 2 and position_ids.shape[0] == 1 and b > 1:
        batch["position_ids"] = position_ids.expand(b, -1).contiguous()


def _validate(
    batch: dict[str, Any],
    keys: dict[str, _SeqKey],
    *,
    needs_labels: bool,
    extra_missing: list[str],
    primary_keys: tuple[str, ...] = _PRIMARY_KEYS,
) -> None:
    """Raise one ValueError listing every problem with the batch (nothing has been modified yet)."""
    problems = []
    present = [k for k in _PRIMARY_KEYS if batch.get(k) is not None]
    if len(present) != 1:
        what = "both" if present else "neither"
        problems.append(
            f"context parallelism requires exactly one of 'input_ids' or 'inputs_embeds' in the batch; got {what}"
        )
    elif present[0] not in primary_keys:
        problems.append(
            f"the model accepts only {list(primary_keys)} under context parallelism (its "
            f"ContiguousCPOptions.primary_keys), got '{present[0]}': a model that embeds its own shard needs the "
            "token ids"
        )
    if needs_labels and batch.get("labels") is None:
        problems.append(
            "context parallelism requires 'labels' in the batch (or labels passed as `loss_mask`): the loss is "
            "computed on the sharded sequence, so labels must be sharded with it"
        )
    problems += [f"sequence buffer '{key}' is missing from the batch" for key in extra_missing]
    if len(present) == 1:
        reference_key = present[0]
        reference = batch[reference_key]
        b, s = reference.shape[0], reference.shape[1] if reference.dim() >= 2 else None
        if reference.dim() < 2:
            problems.append(f"'{reference_key}' must be [B, S, ...]; got shape {tuple(reference.shape)}")
        for key, spec in keys.items():
            value = batch.get(key)
            if value is None or s is None:
                continue
            if not isinstance(value, torch.Tensor):
                problems.append(f"'{key}' must be a tensor; got {type(value).__name__}")
            elif value.dim() <= max(spec.seq_dim, spec.batch_dim):
                problems.append(
                    f"'{key}' has shape {tuple(value.shape)} but its sequence dim is {spec.seq_dim}; it needs at "
                    f"least {max(spec.seq_dim, spec.batch_dim) + 1} dims (fix the declared sequence dim or the tensor)"
                )
            else:
                if value.shape[spec.seq_dim] != s:
                    problems.append(
                        f"'{key}' has {value.shape[spec.seq_dim]} tokens on its sequence dim {spec.seq_dim} "
                        f"(shape {tuple(value.shape)}) but '{reference_key}' has S={s}; every sequence tensor of "
                        "the batch must have the same length"
                    )
                if value.shape[spec.batch_dim] not in (1, b):
                    problems.append(
                        f"'{key}' has batch size {value.shape[spec.batch_dim]} on dim {spec.batch_dim} "
                        f"(shape {tuple(value.shape)}) but '{reference_key}' has B={b}"
                    )
    if problems:
        raise ValueError("cannot shard the batch for context parallelism:\n  - " + "\n  - ".join(problems))


def _shard_keys(batch: dict[str, Any], keys: dict[str, _SeqKey], layout: Layout) -> tuple[int, int]:
    """Pad and shard every key in `keys` (out of place), writing the local tensors back into `batch`."""
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    assert primary is not None
    seq_len = primary.shape[1]
    padded_len = layout.padded_length(seq_len)
    for key, spec in keys.items():
        if batch.get(key) is not None:
            batch[key] = layout.shard(batch[key], seq_dim=spec.seq_dim, pad_value=spec.pad_value)
    return seq_len, padded_len


def _doc_ids_for_ring(batch: dict[str, Any], padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Full-length `[B, S]` document ids for the ring mask, or None when every token is one real document."""
    if batch.get("_packed_seq_ids") is not None:
        return batch["_packed_seq_ids"].long()
    if padding_mask is not None:
        return (~padding_mask.bool()).long()
    return None


_REMOVED_BATCH_HOOK = "_cp_make_batch_fn"


def _check_token_tensors(batch: dict[str, Any]) -> None:
    """Token ids and labels must be integer tensors and labels must have the batch size of the inputs: checked on
    every path (identity included), since a float id or a label row that belongs to no input row trains wrongly
    without an error further down (labels are not broadcast)."""
    problems = []
    for key in ("input_ids", "labels"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
        ):
            problems.append(
                f"'{key}' must be an integer tensor of token ids{' (-100 = ignore)' * (key == 'labels')}; got "
                f"{value.dtype}: cast with .long()"
                + (", or pass embeddings as 'inputs_embeds'" if key == "input_ids" else "")
            )
    labels = batch.get("labels")
    primary_key = next((k for k in _PRIMARY_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
    if isinstance(labels, torch.Tensor) and primary_key is not None:
        primary = batch[primary_key]
        if labels.dim() >= 1 and primary.dim() >= 1 and labels.shape[0] != primary.shape[0]:
            problems.append(
                f"'labels' has batch size {labels.shape[0]} (shape {tuple(labels.shape)}) but '{primary_key}' has "
                f"B={primary.shape[0]} (shape {tuple(primary.shape)}); labels are not broadcast: give one label row "
                "per input row"
            )
    if problems:
        raise ValueError("cannot shard the batch for context parallelism:\n  - " + "\n  - ".join(problems))


def _refuse_function_in_batch(batch: dict[str, Any]) -> None:
    if _REMOVED_BATCH_HOOK in batch:
        raise ValueError(
            f"batch[{_REMOVED_BATCH_HOOK!r}] is no longer read (am-context-parallel 0.2: no function travels inside a "
            "batch). A model that shards contiguously declares it in its contract instead — `am_contract()` with "
            '`ContextParallelContract(layout="contiguous", options=...)`, options returning a ContiguousCPOptions — '
            "and the caller "
            "passes the model: `make_cp_batch_and_ctx(mesh, batch, model=model)`. Remove the key from the batch "
            "(Gemma 4 >= 0.2 no longer adds it)."
        )


def make_cp_batch_and_ctx(
    device_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    use_te: bool = False,
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
    extra_seq_buffers: list[str] | None = None,
    *,
    model: Any = None,
) -> tuple[ContextFactory, dict[str, Any]]:
    """Shard `batch` along the sequence for the `cp` dim of `device_mesh`; return `(context_factory, batch)`.

    Resolution order: a `model` whose contract declares `cp.layout="contiguous"` (see `model_protocol.py`) gets the
    contiguous shard and its `RingAttentionContext` (`contiguous_shard` with the contract's
    `cp.options()`; run even at C = 1, where it only adds position ids, document ids and padding_mask) > THD
    for Transformer Engine (`use_te`) > identity when C ≤ 1 or there is no `cp` dim (same batch object, unchanged)
    > the load-balanced head-tail layout.

    Load-balanced path (C > 1): `model` is required — it is the model that runs inside the context. Refused up front
    (`ValueError`, nothing changed, no collective) when the package cannot show that every attention layer of it goes
    through the ring (`cp_attention_problems`: no layer stack, an attention implementation that cannot be routed,
    attention code that bypasses transformers' registry, attention dropout); inside the context its blocks dispatch HF
    attention to the ring (only this model: nothing process-wide) and its first forward must call the ring in every
    block (`RuntimeError` otherwise). `attention_mask` is popped (its padding becomes document id 0 for the ring);
    position_ids are synthesized as `arange(S)` when missing; input_ids/inputs_embeds `[B, S, ...]`, labels,
    position_ids (`[B, S]` or mRoPE `[3, B, S]`), padding_mask, `_packed_seq_ids`, a `loss_mask` (argument or batch key;
    the local one is stored in `batch["loss_mask"]`) and every `extra_seq_buffers` key are padded to a multiple of 2C
    and replaced IN THE DICT by this rank's out-of-place shard (embeddings keep their autograd history). The returned
    factory is a `RingAttentionContext`: run forward AND backward inside `with ctx():` so attention is a ring
    over the CP group.
    The caller must then: compute the loss as a global token mean over the CP group and all-reduce gradients over
    it (`cp_token_mean_loss`, `all_reduce_cp_gradients`); labels must be ALREADY shifted (label t = token t+1),
    since a shard cannot see its neighbour's next token; pop `loss_mask` before `model(**batch)`.

    `num_chunks` and `seq_lens_padding_value` configure the THD path (`use_te=True`) only. At C ≤ 1 nothing is
    sharded: the batch (and a `loss_mask`) are already this rank's.

    Raises:
        ValueError: listing every problem (missing labels, both/neither of input_ids/inputs_embeds, sequence tensors
            of different lengths or with a sequence dim they do not have, missing extra buffers); for a batch that
            still carries the removed `_cp_make_batch_fn` hook; without `model` at C > 1 on the load-balanced path,
            or with the model's `cp_attention_problems`; for THD options without `use_te`, or `use_te` with a
            model that declares the contiguous layout; on every path (C <= 1 included), for float (or bool) token ids
            or labels and for labels whose batch size differs from the inputs'.
    """
    return shard_cp_batch(
        device_mesh,
        batch,
        loss_mask,
        use_te,
        padding_token_id,
        num_chunks,
        seq_lens_padding_value,
        extra_seq_buffers,
        model=model,
        require_model=True,
    )


def shard_cp_batch(
    device_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None,
    use_te: bool,
    padding_token_id: int,
    num_chunks: int,
    seq_lens_padding_value: int,
    extra_seq_buffers: list[str] | None,
    *,
    model: Any,
    require_model: bool,
) -> tuple[ContextFactory, dict[str, Any]]:
    """`make_cp_batch_and_ctx`'s work; `require_model=False` (upstream's model-less convention, `upstream.py` only)
    returns a load-balanced context that routes nothing and checks nothing (the caller routes attention)."""
    _refuse_function_in_batch(batch)
    _check_token_tensors(batch)
    if not use_te and (num_chunks != 1 or seq_lens_padding_value != -1000):
        raise ValueError(
            f"num_chunks={num_chunks} and seq_lens_padding_value={seq_lens_padding_value} configure the THD path "
            "only; pass use_te=True to use it, or leave them at their defaults (1, -1000)"
        )
    cp_mesh, tp_mesh = sub_mesh(device_mesh, "cp"), sub_mesh(device_mesh, "tp")
    options = model_cp_options(model) if model is not None else None
    if options is not None:
        if use_te:
            raise ValueError(
                f"use_te=True asks for the THD path, but {type(model).__name__}'s contract declares "
                '`cp.layout="contiguous"` (it runs its own ring attention on contiguous shards); drop use_te'
            )
        return contiguous_shard(
            cp_mesh,
            tp_mesh,
            batch,
            loss_mask,
            padding_token_id,
            options=options,
            extra_seq_buffers=extra_seq_buffers,
            model=model,
        )
    if use_te:
        if extra_seq_buffers:
            raise ValueError(
                f"extra_seq_buffers {extra_seq_buffers} are not supported by the TE THD context-parallel path; "
                "convert them to THD yourself or use the default path"
            )
        te_batch = make_cp_batch_for_te(
            cp_mesh,
            batch,
            padding_token_id=padding_token_id,
            num_chunks=num_chunks,
            seq_lens_padding_value=seq_lens_padding_value,
        )
        return contextlib.nullcontext, te_batch
    cp_size = cp_mesh.size() if cp_mesh is not None else 1
    if cp_size <= 1:
        return contextlib.nullcontext, batch
    if require_model:
        _check_model_for_ring(model)

    keys = _sequence_keys(batch, padding_token_id, extra_seq_buffers)
    extra = list(extra_seq_buffers or [])
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None and attention_mask.dim() == 2:  # a 4-D mask is only read for its diagonal below
        keys["attention_mask"] = _SeqKey(1, 0, False)
    _validate(batch, keys, needs_labels=True, extra_missing=[k for k in extra if k not in batch])

    attention_mask = batch.pop("attention_mask", None)
    keys.pop("attention_mask", None)
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    assert primary is not None
    _ensure_position_ids(batch, primary)
    _add_position_key(batch, keys)
    padding_mask = batch.get("padding_mask")
    if padding_mask is None and attention_mask is not None:
        padding_mask = _padding_mask_from_attention_mask(attention_mask)
    doc_ids = _doc_ids_for_ring(batch, padding_mask)

    layout = LoadBalancedLayout(cp_size=cp_size, cp_rank=cp_rank(cp_mesh))
    seq_len, padded_len = _shard_keys(batch, keys, layout)
    if doc_ids is None and padded_len != seq_len:
        doc_ids = torch.ones(primary.shape[:2], dtype=torch.long, device=primary.device)
    local_doc_ids = layout.shard(doc_ids, seq_dim=1, pad_value=0) if doc_ids is not None else None
    ctx = RingAttentionContext(
        group=cp_mesh.get_group(),
        layout=layout,
        positions=layout.local_indices(padded_len, device=primary.device),
        doc_ids=local_doc_ids,
        seq_len=seq_len,
        padded_len=padded_len,
        route_hf_attention=model is not None,
        model=model,
    )
    return ctx, batch


def _check_model_for_ring(model: Any) -> None:
    """Refuse, before anything changes, a load-balanced run whose model is unknown or cannot be shown to send every
    attention layer through the ring."""
    if model is None:
        raise ValueError(
            "make_cp_batch_and_ctx(mesh, batch, model=model): at C > 1 the load-balanced path needs the model that "
            "will run inside the context, so that its attention is routed to the ring and checked (a layer that "
            "attends by itself would see only this rank's tokens). Pass model=; upstream's model-less calling "
            "convention is am_context_parallel.upstream.make_cp_batch_and_ctx (process-wide routing, unchecked)"
        )
    problems = cp_attention_problems(model)
    if problems:
        raise ValueError(
            "context parallelism cannot be shown to be exact for this model:\n  - " + "\n  - ".join(problems)
        )


def contiguous_shard(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None,
    padding_token_id: int,
    *,
    options: ContiguousCPOptions,
    extra_seq_buffers: list[str] | None,
    model: Any,
) -> tuple[ContextFactory, dict[str, Any]]:
    """Contiguous shard: rank r keeps tokens `[r·P/C, (r+1)·P/C)` of every sequence tensor; returns `(ctx, batch)`.

    The generic path of models whose contract declares `cp.layout="contiguous"` (`make_cp_batch_and_ctx(..., model=)`
    calls this with their `cp.options()`; upstream's `make_contiguous_shard_cp_batch_and_ctx` wraps it). Pops
    `attention_mask` (deriving `padding_mask` from it when missing); synthesizes `_packed_seq_ids`
    (`_synthesize_single_document_seq_ids`), and position_ids `arange(S)` when missing and C > 1 or `tp_mesh` has more
    than one rank (upstream's rule; a `[1, S]` tensor is expanded to B); labels come from the batch, else `loss_mask` is
    promoted to labels. Keys sharded: input_ids, inputs_embeds, labels, position_ids (continuing), padding_mask,
    `_packed_seq_ids`, mm_token_type_ids, per_layer_inputs (`[B, S, L, H]`), loss_mask, the model's
    `options.extra_seq_keys` (when present in the batch), and — required when named — upstream's
    `batch["_cp_metadata_seq_dims"]` / `batch["_cp_metadata_pad_values"]` (popped; pad default 0) and
    `extra_seq_buffers` (seq dim 1, padded like `make_cp_batch_and_ctx` pads them). Padded to a multiple of
    `options.pad_multiple · C` (2C by default). No collective.

    Returns:
        For C > 1 a `RingAttentionContext` (contiguous layout, the global positions of the local tokens, the local
        `_packed_seq_ids` as document ids, the lengths; kernel and HF routing from `options`) and the same dict,
        updated; run forward AND backward inside `with ctx():`. For C ≤ 1, `(contextlib.nullcontext, batch)`.

    Raises:
        ValueError: listing every problem with the batch.
    """
    _refuse_function_in_batch(batch)
    seq_dims: dict[str, int] = dict(batch.pop("_cp_metadata_seq_dims", None) or {})
    pad_values: dict[str, Any] = dict(batch.pop("_cp_metadata_pad_values", None) or {})
    attention_mask = batch.get("attention_mask")
    if batch.get("labels") is None and loss_mask is not None:
        batch["labels"] = loss_mask
        loss_mask = None
    # upstream's contiguous shard also carries the VLM / per-layer-input keys (per_layer_inputs is [B, S, L, H])
    keys = _sequence_keys(batch, padding_token_id, extra_seq_buffers, "mm_token_type_ids", "per_layer_inputs")
    for key, (dim, pad_value) in options.extra_seq_keys.items():
        keys[key] = _SeqKey(dim, 0, pad_value)
    for key, dim in seq_dims.items():
        keys[key] = _SeqKey(dim, 0, pad_values.get(key, 0))
    required = [*seq_dims, *(extra_seq_buffers or [])]
    if attention_mask is not None and attention_mask.dim() == 2:
        keys["attention_mask"] = _SeqKey(1, 0, False)
    _validate(
        batch,
        keys,
        needs_labels=True,
        extra_missing=[k for k in required if k not in batch],
        primary_keys=options.primary_keys,
    )
    keys.pop("attention_mask", None)

    attention_mask = batch.pop("attention_mask", None)
    if "padding_mask" not in batch and attention_mask is not None:
        batch["padding_mask"] = _padding_mask_from_attention_mask(attention_mask)
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    assert primary is not None
    cp_size = cp_mesh.size() if cp_mesh is not None else 1
    tp_size = tp_mesh.size() if tp_mesh is not None else 1
    # Upstream's rule: position ids are synthesized when the sequence is sharded (C > 1) or tensor parallel
    # (TP > 1, whose sequence-parallel regions need explicit positions); at C = TP = 1 the model makes its own.
    _ensure_position_ids(batch, primary, synthesize=cp_size > 1 or tp_size > 1)
    _add_position_key(batch, keys)
    _synthesize_single_document_seq_ids(batch)
    layout = ContiguousLayout(
        cp_size=cp_size, cp_rank=cp_rank(cp_mesh) if cp_size > 1 else 0, pad_multiple=options.pad_multiple
    )
    seq_len, padded_len = _shard_keys(batch, keys, layout)
    if cp_size <= 1:
        return contextlib.nullcontext, batch
    ctx = RingAttentionContext(
        group=cp_mesh.get_group(),
        layout=layout,
        positions=layout.local_indices(padded_len, device=primary.device),
        doc_ids=batch["_packed_seq_ids"].long(),
        seq_len=seq_len,
        padded_len=padded_len,
        route_hf_attention=options.route_hf_attention,
        kernel=options.kernel_for(primary.device),
        model=model if options.route_hf_attention else None,
    )
    return ctx, batch
