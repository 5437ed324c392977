"""Shard a training batch over the CP group: the one entry point and the load-balanced layout.

What it is for: the one entry point `make_cp_batch_and_ctx` (contiguous for a model that declares it, in
`contiguous.py` > THD > identity > load-balanced, here, with the model's attention routed to the ring and checked by
`coverage.py`); the THD path is `thd.make_cp_batch_for_te`. Which keys are sharded and how they pad is
`batch_keys.py`; every input problem is reported at once, before anything is changed, by `batch_checks.py`. What a
model declares is read by `model_protocol.py`. Upstream's other spellings (`make_contiguous_shard_cp_batch_and_ctx`,
the model-less `make_cp_batch_and_ctx`) are thin wrappers in `upstream.py` over `shard_cp_batch` /
`contiguous_shard`.
What it must not do: shard in place (torch's experimental `context_parallel` resizes buffers in place and rejects
tensors that need grad; we build new tensors and put them in the batch dict), or communicate (the CP rank comes
from the mesh).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .batch_checks import _check_token_tensors, _refuse_function_in_batch, _validate
from .batch_keys import (
    _add_position_key,
    _doc_ids_for_ring,
    _ensure_position_ids,
    _padding_mask_from_attention_mask,
    _sequence_keys,
    _shard_keys,
)
from .context import RingAttentionContext
from .contiguous import ContextFactory, contiguous_shard
from .coverage import cp_attention_problems
from .layouts import LoadBalancedLayout
from .mesh import cp_rank, sub_mesh
from .model_protocol import CP_LAYOUTS, ContiguousCPOptions, model_cp_options
from .thd import make_cp_batch_for_te

__all__ = ["make_cp_batch_and_ctx", "shard_cp_batch"]


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
    layout: str | None = None,
) -> tuple[ContextFactory, dict[str, Any]]:
    """Shard `batch` along the sequence for the `cp` dim of `device_mesh`; return `(context_factory, batch)`.

    Resolution order: a `model` whose contract declares `cp.layout="contiguous"` (see `model_protocol.py`) gets the
    contiguous shard and its `RingAttentionContext` (`contiguous_shard` with the contract's
    `cp.options()`; run even at C = 1, where it only adds position ids, document ids and padding_mask) > THD
    for Transformer Engine (`use_te`) > identity when C ≤ 1 or there is no `cp` dim (same batch object, unchanged)
    > the load-balanced head-tail layout.

    `layout` ("contiguous" or "load_balanced", one of `CP_LAYOUTS`): the layout a run plan chose for `model`; it
    picks the path instead of the model's contract, which is only checked against it (a plan made for another
    model is refused, not re-derived). None (upstream's convention): the model's contract picks.

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
            model that declares the contiguous layout; for a `layout` that is not one of `CP_LAYOUTS`, given
            without `model`, other than the one the model's contract declares, or "load_balanced" with `use_te`;
            on every path (C <= 1 included), for float (or bool) token ids or labels and for labels whose batch
            size differs from the inputs'.
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
        layout=layout,
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
    layout: str | None = None,
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
    options = _contiguous_options(model, layout, use_te=use_te)
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
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    _validate(batch, keys, required=list(extra_seq_buffers or []))

    attention_mask = batch.pop("attention_mask", None)
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    assert primary is not None
    _ensure_position_ids(batch, primary)
    _add_position_key(batch, keys)
    padding_mask = batch.get("padding_mask")
    if padding_mask is None and attention_mask is not None:
        padding_mask = _padding_mask_from_attention_mask(attention_mask)
    doc_ids = _doc_ids_for_ring(batch, padding_mask)

    head_tail = LoadBalancedLayout(cp_size=cp_size, cp_rank=cp_rank(cp_mesh))
    seq_len, padded_len = _shard_keys(batch, keys, head_tail)
    if doc_ids is None and padded_len != seq_len:
        doc_ids = torch.ones(primary.shape[:2], dtype=torch.long, device=primary.device)
    local_doc_ids = head_tail.shard(doc_ids, seq_dim=1, pad_value=0) if doc_ids is not None else None
    ctx = RingAttentionContext(
        group=cp_mesh.get_group(),
        layout=head_tail,
        positions=head_tail.local_indices(padded_len, device=primary.device),
        doc_ids=local_doc_ids,
        seq_len=seq_len,
        padded_len=padded_len,
        route_hf_attention=model is not None,
        model=model,
    )
    return ctx, batch


def _contiguous_options(model: Any, layout: str | None, *, use_te: bool) -> ContiguousCPOptions | None:
    """The contiguous options to shard with, None for the other paths: from the model's contract when `layout` is
    None; with a `layout` (a run plan's), that layout decides and the contract is only checked against it.

    Raises:
        ValueError: listing every problem of `layout` (not one of `CP_LAYOUTS`, no `model` to check it against,
            another layout than the model's contract declares, "load_balanced" with `use_te`).
    """
    if layout is None:
        return model_cp_options(model) if model is not None else None
    problems = []
    if layout not in CP_LAYOUTS:
        problems.append(f"layout must be one of {list(CP_LAYOUTS)}; got {layout!r}")
    if model is None:
        problems.append("layout= is checked against the model that runs in the context: pass model= too")
    if use_te and layout == "load_balanced":
        problems.append('use_te=True shards for THD, not the "load_balanced" layout; drop one of them')
    options = model_cp_options(model) if model is not None else None
    if model is not None and layout in CP_LAYOUTS:
        declared = "contiguous" if options is not None else "load_balanced"
        if layout != declared:
            problems.append(
                f"layout={layout!r}, but {type(model).__name__}'s contract declares cp.layout={declared!r} (the "
                "plan was made for another model); plan with the model that runs"
            )
    if problems:
        raise ValueError("make_cp_batch_and_ctx: " + "; ".join(problems))
    return options


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
