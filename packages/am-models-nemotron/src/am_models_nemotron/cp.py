"""Model-level context parallelism of Nemotron-H on contiguous shards (am-context-parallel's declared path).

What it is for: the model declares `cp.layout="contiguous"` in `NemotronHForCausalLM.am_contract()`, so
`make_cp_batch_and_ctx(mesh, batch, model=model)` gives rank r tokens [r·P/C, (r+1)·P/C) of every sequence and a
`RingAttentionContext`. Inside it, the forward runs: attention layers as the context's exact ring (global positions,
document ids, 0 = padding), Mamba layers with `Mamba2CPContext` over the same group and the context's global
document ids (state passing + conv halo, `mamba2_cp`), MLP / MoE token-local with padding excluded from routing.
What has to be shifted crosses block edges, so it is prepared on the WHOLE batch before sharding
(`prepare_batch_for_cp`): next-token labels, the MTP inputs and targets of every depth, and the document ids.
Bad input is refused before the first ring or Mamba transfer, on every rank at once (`raise_on_every_rank`: one
tiny all-gather of a flag, so a problem found on one rank never leaves the others waiting in a transfer).
What it must not do: import a pipelining or capability package, shard anything itself, or shift across a block edge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from am_context_parallel import (
    AttentionKernel,
    ContiguousCPOptions,
    ContiguousLayout,
    FlashCPUAttentionKernel,
    RingAttentionContext,
    TorchAttentionKernel,
    current_ring_context,
)

from .inputs import BatchLayout, pop_layout_kwargs, resolve_batch_layout
from .loss import causal_lm_targets
from .mamba2_cp import Mamba2CPContext, conv_halo_width
from .mtp import shift_within_documents

__all__ = [
    "MTP_CP_KEYS",
    "NemotronCPContext",
    "active_cp_context",
    "block_cp_problems",
    "cp_kwarg_problems",
    "nemotron_cp_options",
    "prepare_batch_for_cp",
    "raise_on_every_rank",
    "resolve_layout",
    "ring_kernel",
]

# Batch keys the sharder carries for MTP ([B, D, S]: sequence dim 2) with their padding values.
MTP_CP_KEYS: dict[str, tuple[int, Any]] = {"mtp_per_depth_input_ids": (2, 0), "mtp_per_depth_targets": (2, -100)}


@dataclass(frozen=True)
class NemotronCPContext:
    """This rank's place in a context-parallel forward: the entered ring context and the Mamba2 state passing."""

    ring: RingAttentionContext
    mamba: Mamba2CPContext

    @property
    def rank(self) -> int:
        return self.mamba.rank

    @property
    def size(self) -> int:
        return self.mamba.size


def active_cp_context(*, owner: str) -> NemotronCPContext | None:
    """The CP context of the entered `RingAttentionContext` (None outside one, or for a group of one rank).

    Raises:
        ValueError: the entered context does not use the contiguous layout (the recurrence needs contiguous blocks;
            shard with `make_cp_batch_and_ctx(..., model=model)`).
    """
    ring = current_ring_context()
    if ring is None or ring.layout.cp_size <= 1:
        return None
    if not isinstance(ring.layout, ContiguousLayout):
        raise ValueError(
            f"{owner} under context parallelism needs the contiguous layout (each rank one block: the Mamba2 "
            f"recurrence passes its state from rank to rank), but the entered context uses {ring.layout!r}; shard "
            "with make_cp_batch_and_ctx(mesh, batch, model=model)."
        )
    return NemotronCPContext(ring=ring, mamba=Mamba2CPContext(ring.group))


def raise_on_every_rank(problems: list[str], cp: NemotronCPContext, *, owner: str) -> None:
    """Raise on every rank of the CP group when any rank has problems: one all-gather of a flag, issued before any
    other transfer of the forward. The ranks with problems list them; the others name those ranks."""
    flag = torch.tensor([1 if problems else 0], dtype=torch.int32, device=_flag_device(cp.ring.group))
    flags = [torch.zeros_like(flag) for _ in range(cp.size)]
    dist.all_gather(flags, flag, group=cp.ring.group)
    failed = [rank for rank, value in enumerate(flags) if int(value.item())]
    if not failed:
        return
    if problems:
        raise ValueError(
            f"{owner} under context parallelism (rank {cp.rank} of {cp.size}):\n  - " + "\n  - ".join(problems)
        )
    raise ValueError(f"{owner} under context parallelism: CP rank(s) {failed} got invalid inputs (see their error).")


def _flag_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ring_kernel(device: torch.device) -> AttentionKernel:
    """The ring's per-chunk kernel: torch's fused CPU flash op on the CPU (where present: no [S_local, S_local]
    score matrix is kept), else the plain-PyTorch kernel."""
    if torch.device(device).type == "cpu" and FlashCPUAttentionKernel.available():
        return FlashCPUAttentionKernel()
    return TorchAttentionKernel()


def nemotron_cp_options(*, mtp: bool) -> ContiguousCPOptions:
    """What the contiguous sharder must know: the ring kernel, the MTP keys to shard (when MTP is configured), and
    that the MTP inputs are built from token ids (so `inputs_embeds` is refused then)."""
    return ContiguousCPOptions(
        kernel=ring_kernel,
        route_hf_attention=False,
        extra_seq_keys=dict(MTP_CP_KEYS) if mtp else {},
        primary_keys=("input_ids",) if mtp else ("input_ids", "inputs_embeds"),
    )


def prepare_batch_for_cp(
    batch: Mapping[str, Any],
    *,
    mtp_depths: int,
    labels_shifted: bool = False,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """A copy of `batch` ready for the contiguous sharder: everything that crosses a block edge, computed on the
    whole sequences.

    batch: `input_ids` [B, S] (or `inputs_embeds` without MTP), `labels` [B, S], and any packing / padding inputs
    the forward accepts (`attention_mask`, `padding_mask`, `seq_idx`, `_packed_seq_ids`, `position_ids`,
    `qkv_format` / `cu_seqlens` / `cu_seqlens_padded` / `max_seqlen`). Returns: `labels` as next-token targets
    (shifted here unless `labels_shifted`; padding and document ends ignored), `_packed_seq_ids` [B, S] (1-based
    runs, 0 = padding: the global document ids the ring and the Mamba layers read), `padding_mask`, and with
    `mtp_depths` D > 0 `mtp_per_depth_input_ids` / `mtp_per_depth_targets` [B, D, S] (depth d's input: the token
    d + 1 places ahead in the same document, id 0 past its end; its target: the token d + 2 ahead). The packing
    inputs that cannot be sharded (`seq_idx`, THD boundaries, `attention_mask`) are consumed.

    Raises:
        ValueError: no labels, MTP without token ids, or invalid packing inputs (every problem listed).
    """
    prepared = dict(batch)
    if prepared.get("labels") is None:
        raise ValueError("prepare_batch_for_cp needs labels [B, S] (the sharder shards them).")
    ids = prepared.get("input_ids")
    primary = ids if ids is not None else prepared.get("inputs_embeds")
    if primary is None:
        raise ValueError("prepare_batch_for_cp needs input_ids [B, S] or inputs_embeds [B, S, H].")
    if mtp_depths and (ids is None or ids.is_floating_point()):
        raise ValueError("Under context parallelism MTP builds its per-depth inputs from input_ids; pass token ids.")
    attention_mask = prepared.pop("attention_mask", None)
    layout = resolve_batch_layout(
        batch=primary.shape[0],
        seqlen=primary.shape[1],
        device=primary.device,
        attention_mask=attention_mask,
        **pop_layout_kwargs(prepared),
    )
    if "position_ids" in batch:
        prepared["position_ids"] = batch["position_ids"]
    batch_size, seqlen = primary.shape[:2]
    documents = layout.seq_idx
    if documents is None:
        documents = torch.zeros(batch_size, seqlen, dtype=torch.long, device=primary.device)
    padding = layout.padding_mask
    if padding is None:
        padding = torch.zeros(batch_size, seqlen, dtype=torch.bool, device=primary.device)
    labels, targets = causal_lm_targets(
        prepared["labels"],
        depths=mtp_depths,
        seq_idx=documents,
        padding_mask=padding,
        labels_shifted=labels_shifted,
        ignore_index=ignore_index,
    )
    prepared["labels"] = labels
    prepared["padding_mask"] = padding
    prepared["_packed_seq_ids"] = (documents + 1).masked_fill(padding, 0)
    if mtp_depths:
        assert ids is not None
        shifted_ids = [shift_within_documents(ids, d + 1, seq_idx=documents) for d in range(mtp_depths)]
        prepared["mtp_per_depth_input_ids"] = torch.stack(shifted_ids, dim=1)
        prepared["mtp_per_depth_targets"] = torch.stack(targets, dim=1)
    return prepared


def block_cp_problems(blocks: Any, *, seqlen: int, training: bool) -> list[str]:
    """What the given blocks cannot run on a block of `seqlen` tokens under CP (the same on every rank)."""
    problems = []
    for block in blocks:
        mixer = block.mixer
        if block.block_type == "mamba" and seqlen < conv_halo_width(mixer.conv_kernel):
            problems.append(
                f"S_local={seqlen} tokens per rank is shorter than the Mamba conv halo "
                f"({conv_halo_width(mixer.conv_kernel)}); use a longer sequence or fewer CP ranks"
            )
            break
    if training and any(b.block_type == "attention" and b.mixer.dropout for b in blocks):
        problems.append("attention dropout is not supported by ring attention; set attention_dropout=0")
    kernels = sorted({b.mixer.core_attention.attn for b in blocks if b.block_type == "attention"} - {"sdpa"})
    if kernels:
        # The ring computes every chunk with am-context-parallel's kernel; running it silently in place of the
        # chosen backend would be a substitution.
        problems.append(
            f"BackendConfig.attn={kernels[0]!r}: under context parallelism attention runs am-context-parallel's ring "
            "with its own per-chunk kernel; use attn='sdpa' with cp > 1"
        )
    return problems


def resolve_layout(
    *, owner: str, cp_problems: Callable[[NemotronCPContext], list[str]] | None = None, **arguments: Any
) -> BatchLayout:
    """`resolve_batch_layout(**arguments)`, under context parallelism too: inside an entered ring context the layout
    carries the `NemotronCPContext`, and every problem (the layout's and `cp_problems(cp)`'s) makes every rank raise
    before any transfer."""
    cp = active_cp_context(owner=owner)
    if cp is None:
        return resolve_batch_layout(**arguments)
    problems = list(cp_problems(cp)) if cp_problems is not None else []
    layout = None
    try:
        layout = resolve_batch_layout(**arguments, cp=cp)
    except ValueError as exc:
        problems.append(str(exc))
    raise_on_every_rank(problems, cp, owner=owner)
    assert layout is not None
    return layout


def cp_kwarg_problems(values: dict[str, Any], size: int, rank: int) -> list[str]:
    """cp_size / cp_rank keyword arguments that disagree with the actual CP group (size, rank)."""
    problems = []
    if values.get("cp_size") is not None and int(values["cp_size"]) != size:
        problems.append(f"cp_size={int(values['cp_size'])} but the CP group has {size} rank(s)")
    if values.get("cp_rank") is not None and int(values["cp_rank"]) != rank:
        problems.append(f"cp_rank={int(values['cp_rank'])} but this is CP rank {rank}")
    return problems
