"""One description of how the rows of a forward are laid out: documents, padding and explicit masks.

What it is for: the causal LM accepts packing and masking in every spelling upstream trainers use — `seq_idx`
(document ids), `_packed_seq_ids` (1-based, 0 = padding), THD boundaries `cu_seqlens` / `cu_seqlens_padded` (with
`qkv_format="thd"` and `max_seqlen`), `position_ids` that restart at each document (transformers' packed format), a
2-D `attention_mask`, `padding_mask`, and `causal_mask_mapping` / a 4-D mask. `resolve_batch_layout` turns them
into one `BatchLayout` (canonical document ids, one padding mask, the explicit masks), and `BatchLayout.block_inputs`
gives every block what it reads: attention a boolean document/padding mask, Mamba its padding multiplier and the
document ids (state and conv reset), MoE the padding it excludes from routing.
What it must not do: accept an input it cannot honour or ignore one it accepted. Conflicting document sources,
malformed boundaries and THD without boundaries are refused in one ValueError listing every problem; nothing here
issues a collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .attention import build_attention_mask

__all__ = [
    "LAYOUT_KWARGS",
    "BatchLayout",
    "canonical_document_ids",
    "document_ids_from_position_ids",
    "pop_layout_kwargs",
    "resolve_batch_layout",
]

QKV_FORMATS = ("bshd", "thd")
# Collators pad per-microbatch boundary tensors with this value (upstream convention); it is dropped.
_CU_SEQLENS_SENTINEL = -1000
_MASK_MAPPING_KEYS = ("full_attention", "linear_attention")


def canonical_document_ids(ids: torch.Tensor) -> torch.Tensor:
    """[B, S] ids -> [B, S] int64 run numbers 0, 1, ...: a new document wherever the id changes along the row.

    Two separated runs with the same id (padding between documents, say) become two documents, so the result is
    non-decreasing as the scan requires.
    """
    starts = torch.zeros_like(ids, dtype=torch.int64)
    starts[:, 1:] = (ids[:, 1:] != ids[:, :-1]).to(torch.int64)
    return starts.cumsum(dim=1)


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, S] positions -> [B, S] document ids, or None when every row is one document.

    transformers' packed format: a position that does not follow its predecessor + 1 starts a new document.
    """
    starts = torch.zeros_like(position_ids, dtype=torch.int64)
    starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1).to(torch.int64)
    if not bool(starts.any()):
        return None
    return starts.cumsum(dim=1)


@dataclass
class BatchLayout:
    """Documents, padding and masks of a forward over [B, S] tokens (S = this call's tokens, after any cache).

    seq_idx: [B, S] int64 non-decreasing document ids, or None (each row one document).
    padding_mask: [B, S] bool, True = padding (None: no padding).
    key_mask: [B, past + S] 1/0, the keys attention may read besides documents (None: all).
    full_attention_mask: a caller's 4-D attention mask (bool True = attend, or additive float), or None.
    mamba_mask: a caller's 2-D Mamba mask ("linear_attention"), or None (derived from `padding_mask`).
    cp: the model's context-parallel context (`cp.NemotronCPContext`) when this rank holds one contiguous block of
    a sharded batch; `seq_idx` then holds the GLOBAL document ids of the ring context (0 = padding).
    """

    seq_idx: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    full_attention_mask: torch.Tensor | None = None
    mamba_mask: torch.Tensor | None = None
    cp: Any = None

    def block_inputs(self, hidden_states: torch.Tensor, *, past_length: int = 0, cache: Any = None) -> dict[str, Any]:
        """Keyword inputs of `NemotronBlock.forward` for hidden states [B, S, H]."""
        batch, seqlen = hidden_states.shape[:2]
        attn_mask: torch.Tensor | None
        if self.cp is not None:
            attn_mask = None  # the ring builds its masks from the context's positions and document ids
        elif self.full_attention_mask is not None:
            attn_mask = _restrict_to_documents(self.full_attention_mask, self.seq_idx, past_length)
        else:
            attn_mask = build_attention_mask(
                batch_size=batch,
                query_length=seqlen,
                past_length=past_length,
                attention_mask=self.key_mask,
                seq_idx=self.seq_idx,
                device=hidden_states.device,
            )
        mamba_mask = self.mamba_mask
        if mamba_mask is None and self.padding_mask is not None and seqlen > 1:
            mamba_mask = (~self.padding_mask).to(hidden_states.dtype)
        elif mamba_mask is not None:
            mamba_mask = mamba_mask[:, -seqlen:].to(hidden_states.dtype)
        inputs = {
            "attention_mask": attn_mask,
            "mamba_mask": mamba_mask,
            "padding_mask": self.padding_mask,
            "seq_idx": self.seq_idx,
            "cache": cache,
        }
        if self.cp is not None:
            inputs["cp"] = self.cp
        return inputs


def _restrict_to_documents(mask: torch.Tensor, seq_idx: torch.Tensor | None, past_length: int) -> torch.Tensor:
    """A caller's 4-D mask further limited to keys of the query's own document (a no-op for a document mask)."""
    if seq_idx is None:
        return mask
    same = seq_idx[:, None, :, None] == seq_idx[:, None, None, :]
    if past_length:
        same = torch.nn.functional.pad(same, (past_length, 0), value=True)
    if mask.dtype == torch.bool:
        return mask & same
    return mask.masked_fill(~same, torch.finfo(mask.dtype).min)


def _as_rows(name: str, value: torch.Tensor, batch: int, seqlen: int, problems: list[str]) -> torch.Tensor | None:
    """[S] or [1, S] -> [B, S] (broadcast), [B, S] unchanged; anything else is a problem."""
    if value.dim() == 1:
        value = value[None]
    if value.dim() != 2 or value.shape[1] != seqlen or value.shape[0] not in (1, batch):
        problems.append(f"{name} has shape {tuple(value.shape)}; expected [B, S] = {(batch, seqlen)} (or [S])")
        return None
    return value.expand(batch, seqlen)


def _boundaries(name: str, value: Any, problems: list[str]) -> torch.Tensor | None:
    """1-D int64 boundaries from [N+1] or [1, N+1] (trailing -1000 sentinels dropped), validated."""
    bounds = torch.as_tensor(value).reshape(-1).to(torch.int64)
    bounds = bounds[bounds != _CU_SEQLENS_SENTINEL]
    if bounds.numel() < 2 or int(bounds[0]) != 0 or bool((bounds[1:] < bounds[:-1]).any()):
        problems.append(f"{name}={bounds.tolist()} must start at 0 and be non-decreasing, with at least one sequence")
        return None
    return bounds


def _layout_from_cu_seqlens(
    cu_seqlens: Any,
    cu_seqlens_padded: Any,
    *,
    batch: int,
    seqlen: int,
    max_seqlens: dict[str, Any],
    device: torch.device,
    problems: list[str],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """THD boundaries -> ([1, S] document ids, [1, S] padding). Sequence i occupies [padded[i], padded[i+1]) of
    which the first `cu_seqlens[i+1] - cu_seqlens[i]` tokens are real; tokens past the last boundary are padding."""
    if batch != 1:
        problems.append(f"cu_seqlens describe one packed row, but the batch has {batch} rows; pack into [1, T]")
        return None, None
    real = _boundaries("cu_seqlens", cu_seqlens, problems) if cu_seqlens is not None else None
    padded = _boundaries("cu_seqlens_padded", cu_seqlens_padded, problems) if cu_seqlens_padded is not None else None
    layout = padded if padded is not None else real
    if layout is None:
        return None, None
    lengths = layout.diff()
    real_lengths = real.diff() if real is not None else lengths
    if int(layout[-1]) > seqlen:
        problems.append(f"the boundaries end at {int(layout[-1])} but the row holds {seqlen} tokens")
    if real_lengths.numel() != lengths.numel():
        problems.append(
            f"cu_seqlens and cu_seqlens_padded describe {real_lengths.numel()} and {lengths.numel()} sequences"
        )
    elif bool((real_lengths > lengths).any()):
        problems.append("a sequence of cu_seqlens is longer than its slot in cu_seqlens_padded")
    longest = int(lengths.max())
    for name, value in max_seqlens.items():
        if value is not None and int(torch.as_tensor(value).max()) < longest:
            problems.append(
                f"{name}={int(torch.as_tensor(value).max())} is shorter than the longest sequence ({longest})"
            )
    if problems:
        return None, None
    positions = torch.arange(seqlen, device=device)
    layout, real_lengths = layout.to(device), real_lengths.to(device)
    ids = torch.searchsorted(layout[1:], positions, right=True)  # tokens past the end: id N (padding)
    starts = torch.cat([layout[:-1], layout[-1:]])
    lengths_per_id = torch.cat([real_lengths, real_lengths.new_zeros(1)])
    padding = positions - starts[ids] >= lengths_per_id[ids]
    return ids[None], padding[None]


def resolve_batch_layout(
    *,
    batch: int,
    seqlen: int,
    device: torch.device,
    past_length: int = 0,
    attention_mask: torch.Tensor | None = None,
    causal_mask_mapping: Mapping[str, Any] | None = None,
    padding_mask: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    packed_seq_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    qkv_format: str | None = None,
    cu_seqlens: Any = None,
    cu_seqlens_padded: Any = None,
    max_seqlens: dict[str, Any] | None = None,
    cp: Any = None,
) -> BatchLayout:
    """Resolve every packing / masking input of a forward over [B, S] tokens into one `BatchLayout`.

    Documents come from the first of `seq_idx`, `_packed_seq_ids` (`packed_seq_ids`), `cu_seqlens(_padded)`; when
    several are given they must agree on the document starts between real tokens. Without any of them,
    `position_ids` that restart mark document starts. Padding is the union of `attention_mask == 0` (its last S
    columns), `padding_mask`, `_packed_seq_ids == 0` and THD slots past each sequence's real length. Positions that
    restart must restart at a document start.

    cp: under context parallelism (this rank's contiguous block of a sharded batch) the documents are the ring
    context's GLOBAL ids (`cp.ring.doc_ids`, 0 = padding), used as they are; the other sources must agree with them
    on this block, THD boundaries, explicit 4-D masks and a cache are refused, and a non-zero id may not come back
    after another one (the ring would join the two runs, the recurrence cannot).

    Raises:
        ValueError: every problem at once (shapes, THD without boundaries, bad boundaries, disagreeing sources, a
            cache combined with packed documents).
    """
    problems: list[str] = []
    if qkv_format not in (None, *QKV_FORMATS):
        problems.append(f"qkv_format={qkv_format!r} is not supported; use 'bshd' (default) or 'thd' with cu_seqlens")
    if qkv_format == "thd" and cu_seqlens is None and cu_seqlens_padded is None:
        problems.append("qkv_format='thd' needs cu_seqlens (and optionally cu_seqlens_padded)")

    full_mask = mamba_mask = None
    if causal_mask_mapping is not None:
        unknown = sorted(k for k, v in causal_mask_mapping.items() if k not in _MASK_MAPPING_KEYS and v is not None)
        if unknown:
            problems.append(f"causal_mask_mapping has entries {unknown} that no Nemotron-H layer reads")
        full_mask = causal_mask_mapping.get("full_attention")
        mamba_mask = causal_mask_mapping.get("linear_attention")
    if attention_mask is not None and attention_mask.dim() == 4:
        if full_mask is not None:
            problems.append("got a 4-D attention_mask and causal_mask_mapping['full_attention']; pass one of them")
        full_mask, attention_mask = attention_mask, None
    if full_mask is not None and (full_mask.dim() != 4 or full_mask.shape[0] not in (1, batch)):
        problems.append(f"the full-attention mask has shape {tuple(full_mask.shape)}; expected [B, 1, S, past + S]")
    if mamba_mask is not None and (mamba_mask.dim() != 2 or mamba_mask.shape[-1] < seqlen):
        problems.append(f"causal_mask_mapping['linear_attention'] has shape {tuple(mamba_mask.shape)}; expected [B, S]")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] != past_length + seqlen):
        problems.append(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected [B, past + S] = "
            f"{(batch, past_length + seqlen)}"
        )
        attention_mask = None

    pads: list[torch.Tensor] = []
    if attention_mask is not None:
        pads.append(attention_mask[:, -seqlen:] == 0)
    if padding_mask is not None:
        rows = _as_rows("padding_mask", padding_mask, batch, seqlen, problems)
        if rows is not None:
            pads.append(rows.to(torch.bool))

    sources: list[tuple[str, torch.Tensor]] = []
    if cp is not None:
        _check_context_parallel_inputs(
            problems,
            thd=qkv_format == "thd" or cu_seqlens is not None or cu_seqlens_padded is not None,
            masks=full_mask is not None or mamba_mask is not None,
            past_length=past_length,
        )
        context_ids = cp.ring.doc_ids
        if context_ids is not None:
            rows = _as_rows("the ring context's doc_ids", context_ids, batch, seqlen, problems)
            if rows is not None:
                sources.append(("the ring context's document ids", rows))
                pads.append(rows == 0)
                if _has_returning_ids(rows):
                    problems.append(
                        "a document id comes back after another one on this rank's block (padding inside a document?); "
                        "number every run of tokens as its own document (model.prepare_batch_for_cp does)"
                    )
    if seq_idx is not None:
        rows = _as_rows("seq_idx", seq_idx, batch, seqlen, problems)
        if rows is not None:
            sources.append(("seq_idx", rows))
    if packed_seq_ids is not None:
        rows = _as_rows("_packed_seq_ids", packed_seq_ids, batch, seqlen, problems)
        if rows is not None:
            sources.append(("_packed_seq_ids", rows))
            pads.append(rows == 0)
    if cu_seqlens is not None or cu_seqlens_padded is not None:
        ids, thd_pads = _layout_from_cu_seqlens(
            cu_seqlens,
            cu_seqlens_padded,
            batch=batch,
            seqlen=seqlen,
            max_seqlens=max_seqlens or {},
            device=device,
            problems=problems,
        )
        if ids is not None and thd_pads is not None:
            sources.append(("cu_seqlens", ids))
            pads.append(thd_pads)
    position_docs = None
    if position_ids is not None:
        position_rows = _as_rows("position_ids", position_ids, batch, seqlen, problems)
        if position_rows is not None:
            position_docs = document_ids_from_position_ids(position_rows)

    padding = None
    if pads:
        padding = pads[0]
        for extra in pads[1:]:
            padding = padding | extra
    documents = None
    real = None if padding is None else ~padding
    if sources:
        # Under CP the context's global ids are used as they are (ids must match across ranks).
        documents = sources[0][1].to(torch.int64) if cp is not None else canonical_document_ids(sources[0][1])
        for name, other in sources[1:]:
            if not _same_starts(documents, canonical_document_ids(other), real):
                problems.append(f"{sources[0][0]} and {name} describe different document boundaries")
        if position_docs is not None and not _starts_within(position_docs, documents, real):
            problems.append(f"position_ids restart inside a document of {sources[0][0]}")
    elif position_docs is not None:
        documents = position_docs
    if documents is not None and past_length:
        problems.append("packed documents cannot be combined with a generation cache; generate one sequence per row")
    if problems:
        raise ValueError("Invalid Nemotron-H forward inputs:\n  - " + "\n  - ".join(problems))

    key_mask = attention_mask
    if padding is not None and (attention_mask is None or len(pads) > 1):
        keep = (~padding).to(torch.int64)
        key_mask = keep if not past_length else torch.cat([keep.new_ones(batch, past_length), keep], dim=1)
        if attention_mask is not None:
            key_mask = key_mask * (attention_mask != 0).to(torch.int64)
    if padding is not None and not bool(padding.any()):
        padding = None
    return BatchLayout(
        seq_idx=documents,
        padding_mask=padding,
        key_mask=key_mask,
        full_attention_mask=full_mask,
        mamba_mask=mamba_mask,
        cp=cp,
    )


def _check_context_parallel_inputs(problems: list[str], *, thd: bool, masks: bool, past_length: int) -> None:
    fix = "prepare the batch with model.prepare_batch_for_cp before sharding"
    if thd:
        problems.append(f"THD boundaries (qkv_format / cu_seqlens) cannot describe a contiguous CP block; {fix}")
    if masks:
        problems.append(
            "explicit attention masks are not used under context parallelism (the ring builds its masks "
            f"from the document ids); pass padding as padding_mask and documents as _packed_seq_ids; {fix}"
        )
    if past_length:
        problems.append("a generation cache cannot be combined with context parallelism; generate without CP")


def _has_returning_ids(ids: torch.Tensor) -> bool:
    """Whether a non-zero id appears in two separate runs of a row ([1, 1, 0, 1]: the ring would join them)."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    runs = (starts & (ids != 0)).sum(dim=1)
    distinct = torch.tensor([int(row[row != 0].unique().numel()) for row in ids], device=ids.device)
    return bool((runs != distinct).any())


def _starts_within(candidate: torch.Tensor, documents: torch.Tensor, real: torch.Tensor | None) -> bool:
    """Whether every start of `candidate` between real tokens is also a start of `documents`."""
    extra = (candidate[:, 1:] != candidate[:, :-1]) & (documents[:, 1:] == documents[:, :-1])
    if real is not None:
        extra = extra & real[:, 1:] & real[:, :-1]
    return not bool(extra.any())


def _same_starts(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor | None) -> bool:
    """Whether two [B, S] id tensors start documents at the same tokens, judged between consecutive real tokens."""
    starts_a = a[:, 1:] != a[:, :-1]
    starts_b = b[:, 1:] != b[:, :-1]
    differ = starts_a != starts_b
    if real is not None:
        differ = differ & real[:, 1:] & real[:, :-1]
    return not bool(differ.any())


# Forward keyword arguments that describe the layout, as upstream trainers name them.
LAYOUT_KWARGS: tuple[str, ...] = (
    "padding_mask",
    "seq_idx",
    "_packed_seq_ids",
    "position_ids",
    "qkv_format",
    "cu_seqlens",
    "cu_seqlens_padded",
    "max_seqlen",
    "max_seqlen_q",
    "max_seqlen_kv",
)


def pop_layout_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the `LAYOUT_KWARGS` from a forward's **kwargs and return them as `resolve_batch_layout` arguments."""
    found = {name: kwargs.pop(name) for name in LAYOUT_KWARGS if name in kwargs}
    max_seqlens = {name: found.pop(name) for name in ("max_seqlen", "max_seqlen_q", "max_seqlen_kv") if name in found}
    if "_packed_seq_ids" in found:
        found["packed_seq_ids"] = found.pop("_packed_seq_ids")
    if max_seqlens:
        found["max_seqlens"] = max_seqlens
    return found
