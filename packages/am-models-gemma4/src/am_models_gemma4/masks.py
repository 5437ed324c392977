"""Per-forward attention masks of the Gemma 4 text model: who may attend to whom, built once per layer type.

What it is for: `build_attention_mask` (causal, sliding window, packed documents and padding, vision groups, cached
generation steps) and `AttentionInputs`, what every attention layer of one forward shares: the document ids, vision
group ids, the CP ring context (then the ring builds its masks from global positions) and the masks built on first
use by one layer and reused by the others of its type.
What it must not do: run attention (`local_attention.py`, `attention.py`) or hold state across forwards.

Masking rules (shared by the local path and the ring): key k is visible to query q when k <= q (causal), q - k <
window on sliding layers, both tokens are in the same document and it is not padding (id 0). With vision groups
(`use_bidirectional_attention="vision"`, sliding layers only), tokens of one image also see each other. A query
that sees nothing (padding) outputs 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .config import SLIDING
from .local_attention import window_block, window_block_mask

__all__ = ["AttentionInputs", "build_attention_mask"]


def build_attention_mask(
    *,
    seq_len: int,
    device: torch.device,
    doc_ids: torch.Tensor | None,
    vision_group_ids: torch.Tensor | None,
    sliding_window: int | None,
    past_length: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Boolean "may attend" mask `[B or 1, 1, S, past + S]` and the rows that see any key `[B, 1, S, 1]`.

    Queries are tokens `past .. past + S - 1` of the sequence, keys tokens `0 .. past + S - 1` (past > 0: a generation
    step after cached tokens; the caller keeps the mask's last columns when a sliding layer's cache returns fewer
    keys). Returns `(None, None)` when no mask is needed: without past, plain causal attention (SDPA's
    `is_causal`); with past, one query and no padding, which sees every key the cache returns. Rows that see nothing
    (padding queries) are given their own diagonal so softmax stays finite; the second value marks the real rows,
    whose outputs the caller keeps (the others become 0).

    doc_ids: `[B, past + S]` document ids, 0 = padding; vision_group_ids: `[B, S]` image-run ids, -1 = text (only
    without past: image tokens are in the prompt).
    """
    if past_length and vision_group_ids is not None:
        raise ValueError(
            "vision_group_ids (bidirectional image attention) apply to the prompt only; pass them with the prefill, "
            "not with a cached generation step"
        )
    if doc_ids is None and vision_group_ids is None:
        if past_length == 0 and sliding_window is None:
            return None, None
        if past_length and seq_len == 1:
            return None, None
    query = torch.arange(past_length, past_length + seq_len, device=device).view(-1, 1)
    key = torch.arange(past_length + seq_len, device=device).view(1, -1)
    allowed = (key <= query).unsqueeze(0)
    if vision_group_ids is not None:
        same_group = (vision_group_ids.unsqueeze(-1) == vision_group_ids.unsqueeze(-2)) & (
            vision_group_ids >= 0
        ).unsqueeze(-1)
        allowed = allowed | same_group
    if sliding_window is not None:
        allowed = allowed & (key > query - sliding_window).unsqueeze(0)
    if doc_ids is None:
        return allowed.unsqueeze(1), None
    query_docs = doc_ids[:, past_length:]
    same_doc = (query_docs.unsqueeze(-1) == doc_ids.unsqueeze(-2)) & (query_docs > 0).unsqueeze(-1)
    allowed = allowed & same_doc
    rows = allowed.any(dim=-1, keepdim=True)
    allowed = allowed | (~rows & (key == query).unsqueeze(0))
    return allowed.unsqueeze(1), rows.unsqueeze(1)


@dataclass
class AttentionInputs:
    """What every attention layer of one forward needs besides its own tensors.

    doc_ids: `[B, past + S]` (0 = padding) or None when every token is real and in one document. vision_group_ids:
    `[B, S]` (-1 = text) for vision-bidirectional sliding layers, or None. ring: the `RingAttentionContext` of a
    CP step (then masks come from its global positions and doc ids, and the two fields above are unused).
    past_length: tokens already in the generation cache before these S (0 in training and for a prefill).
    """

    seq_len: int
    device: torch.device
    doc_ids: torch.Tensor | None = None
    vision_group_ids: torch.Tensor | None = None
    ring: Any = None
    past_length: int = 0
    _masks: dict[tuple[str, int | None], tuple[torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=dict, repr=False
    )
    _block_masks: dict[tuple[str, str, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_for(self, layer_type: str, sliding_window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The (mask, real rows) pair of a layer type, built on first use and reused by the other layers."""
        key = (layer_type, sliding_window)
        if key not in self._masks:
            self._masks[key] = build_attention_mask(
                seq_len=self.seq_len,
                device=self.device,
                doc_ids=self.doc_ids,
                vision_group_ids=self.vision_group_ids if layer_type == SLIDING else None,
                sliding_window=sliding_window,
                past_length=self.past_length,
            )
        return self._masks[key]

    def window_block_mask_for(self, layer_type: str, sliding_window: int) -> torch.Tensor | None:
        """The sliding-window path's per-block additive mask of a layer type (`window_block_mask`), built once."""
        mask, _ = self.mask_for(layer_type, sliding_window)
        if mask is None or self.past_length or self.seq_len <= 2 * sliding_window:
            return None
        key = ("window_blocks", layer_type, sliding_window)
        if key not in self._block_masks:
            self._block_masks[key] = window_block_mask(mask, window=sliding_window, block=window_block(sliding_window))
        return self._block_masks[key]
