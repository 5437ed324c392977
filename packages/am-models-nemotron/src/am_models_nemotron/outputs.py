"""The causal LM's output class and THE combined training loss (next-token loss + scaled MTP loss).

What it is for: `NemotronHCausalLMOutputWithPast`, a transformers `CausalLMOutputWithPast` with the MTP fields
declared as dataclass fields (they survive FSDP2's output reconstruction), whose `loss` is the next-token cross
entropy only, as upstream and transformers return it; and `combined_causal_lm_loss`, the one function that adds the
MTP depths to it. Users, `NemotronHForCausalLM.combined_loss` (the duck-typed hook am-pipelining's
`PipelineCausalLMLoss` and the reference trainer call) and the forward's own `mtp_loss` all go through it, so the
rule — depth k (0-based) at position t predicts token t + k + 2, never across a document, weight
`scaling / D` per depth — exists once.
What it must not do: import am-pipelining (it discovers the hook), or count the MTP loss into `loss` (a recipe that
adds the MTP loss itself would count it twice).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .loss import cross_entropy
from .mtp import mtp_depth_losses, shift_labels, shift_within_documents

__all__ = [
    "CombinedLoss",
    "NemotronHCausalLMOutputWithPast",
    "causal_lm_targets",
    "combined_causal_lm_loss",
    "select_hidden_states",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class NemotronHCausalLMOutputWithPast(CausalLMOutputWithPast):
    """Output of `NemotronHForCausalLM.forward` off the pipeline.

    loss: next-token cross entropy only (mean over non-ignored targets), when labels are given.
    logits: [B, S_kept, V]. past_key_values: the `NemotronHybridCache` when caching. hidden_states: transformers'
    convention — (embeddings, output of layers 0..L-2, final normed hidden state), L + 1 tensors [B, S, H].
    mtp_per_depth_h: list of D hidden states [B, S, H] (training, or eval with `compute_mtp_in_eval`).
    mtp_loss: `mtp_loss_scaling_factor` x the mean over depths of each depth's mean cross entropy (labels given
    and MTP ran); NOT included in `loss`. Add it with `combined_causal_lm_loss` / `model.combined_loss`.
    mtp_loss_scaling_factor: the weight used for `mtp_loss`.
    mtp_per_depth_targets: the D precomputed [B, S] MTP targets the forward was given (context parallelism: shifted
    before sharding), which `model.combined_loss` then uses; None otherwise.
    """

    mtp_per_depth_h: list[torch.Tensor] | None = None
    mtp_loss: torch.Tensor | None = None
    mtp_loss_scaling_factor: float | None = None
    mtp_per_depth_targets: list[torch.Tensor] | None = None


@dataclass
class CombinedLoss:
    """loss = lm_loss + mtp_loss (mtp_loss None when no MTP depth took part); per-depth losses unscaled."""

    loss: torch.Tensor
    lm_loss: torch.Tensor
    mtp_loss: torch.Tensor | None
    mtp_per_depth_losses: list[torch.Tensor]


def _default_lm_loss(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    return cross_entropy(logits, targets, ignore_index=ignore_index)


def causal_lm_targets(
    labels: torch.Tensor,
    *,
    depths: int = 0,
    seq_idx: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    labels_shifted: bool = False,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(next-token targets [B, S], D MTP targets [B, S]): THE target rule.

    Position t's next-token target is labels[t + 1] (or labels[t] when `labels_shifted`); depth k's is the
    next-token target k + 1 positions on (the token t + k + 2). `ignore_index` past the row, across a document
    (`seq_idx`), at padding positions and where the target token is padding (`padding_mask`, True = padding).
    Context parallelism calls it on the whole sequence before sharding, so block edges are right.
    """
    if padding_mask is not None and not labels_shifted:
        labels = labels.masked_fill(padding_mask, ignore_index)
    shifted = labels if labels_shifted else shift_labels(labels, 1, seq_idx=seq_idx, ignore_index=ignore_index)
    if padding_mask is not None:
        shifted = shifted.masked_fill(padding_mask, ignore_index)
        if labels_shifted:  # the target of position t is the token t + 1: ignored where that token is padding
            # Past the row the caller's label stands (it names the token after the row; -100 where there is none),
            # as without a padding mask; otherwise a trainer's full windows would lose their last target under CP.
            shifted = shifted.masked_fill(shift_within_documents(padding_mask, 1, fill_value=False), ignore_index)
    targets = []
    for k in range(depths):
        target = shift_labels(shifted, k + 1, seq_idx=seq_idx, ignore_index=ignore_index)
        targets.append(target if padding_mask is None else target.masked_fill(padding_mask, ignore_index))
    return shifted, targets


def combined_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    mtp_per_depth_h: Sequence[torch.Tensor] | None = None,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    mtp_loss_scaling_factor: float = 0.1,
    seq_idx: torch.Tensor | None = None,
    loss_fn: LossFn | None = None,
    labels_shifted: bool = False,
    mtp_per_depth_targets: Sequence[torch.Tensor] | None = None,
    padding_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> CombinedLoss:
    """Next-token loss plus `mtp_loss_scaling_factor / D` x the sum of the D MTP depth losses.

    logits: [B, S, V]; labels: [B, S] token ids — unshifted (transformers' convention: the target of position t is
    labels[t + 1]) or, with `labels_shifted=True`, already the next-token targets (the pipeline's convention);
    mtp_per_depth_h: D hidden states [B, S, H], projected by `lm_head`; seq_idx: [B, S] document ids of packed rows
    (targets never cross a document); mtp_per_depth_targets: D precomputed [B, S] targets (context parallelism:
    shifted before sharding), used instead of shifting `labels`.

    loss_fn: `(logits, targets) -> scalar`; default the mean cross entropy over non-ignored targets (an MTP depth
    without targets then counts 0). A token-sum loss divided by a global count (the reference trainer's) works too.

    Raises:
        ValueError: MTP hidden states without `lm_head`, or precomputed targets of the wrong count or shape.
    """
    depths = len(mtp_per_depth_h) if mtp_per_depth_h else 0
    shifted, targets = causal_lm_targets(
        labels,
        depths=depths if mtp_per_depth_targets is None else 0,
        seq_idx=seq_idx,
        padding_mask=padding_mask,
        labels_shifted=labels_shifted,
        ignore_index=ignore_index,
    )
    lm_loss = (loss_fn or functools.partial(_default_lm_loss, ignore_index=ignore_index))(logits, shifted)
    depth_losses: list[torch.Tensor] = []
    if mtp_per_depth_h:
        if lm_head is None:
            raise ValueError("combined_causal_lm_loss: MTP hidden states need lm_head to become logits.")
        depth_losses = mtp_depth_losses(
            mtp_per_depth_h,
            shifted_labels=shifted,
            lm_head=lm_head,
            seq_idx=seq_idx,
            loss_fn=loss_fn,
            targets=mtp_per_depth_targets if mtp_per_depth_targets is not None else targets,
            ignore_index=ignore_index,
        )
    if not depth_losses:
        return CombinedLoss(loss=lm_loss, lm_loss=lm_loss, mtp_loss=None, mtp_per_depth_losses=[])
    mtp_loss = torch.stack(depth_losses).sum() * mtp_loss_scaling_factor / len(depth_losses)
    return CombinedLoss(loss=lm_loss + mtp_loss, lm_loss=lm_loss, mtp_loss=mtp_loss, mtp_per_depth_losses=depth_losses)


def select_hidden_states(
    hidden_states: list[torch.Tensor] | None, selection: bool | int | Sequence[int] | None
) -> tuple[torch.Tensor | None, ...] | None:
    """transformers' `output_hidden_states` selection over the L + 1 collected states: True keeps all, an index or
    indices keep those (negative ones count from the end) and put None elsewhere."""
    if hidden_states is None:
        return None
    if selection is None or isinstance(selection, bool):
        return tuple(hidden_states)
    count = len(hidden_states)
    indices = [selection] if isinstance(selection, int) else list(selection)
    chosen = {i % count for i in indices if -count <= i < count}
    return tuple(h if i in chosen else None for i, h in enumerate(hidden_states))


class NemotronLossMixin:
    """`combined_loss`, the model's one training-loss rule (the model provides `num_mtp_depths`, `lm_head`,
    `mtp_config`, `compute_mtp_in_eval` and `training`)."""

    if TYPE_CHECKING:

        @property
        def num_mtp_depths(self) -> int: ...  # defined by NemotronPipelineMixin

    lm_head: Any
    mtp_config: Any
    compute_mtp_in_eval: bool
    training: bool

    def combined_loss(
        self,
        output: Any,
        labels: torch.Tensor,
        *,
        loss_fn: Any = None,
        labels_shifted: bool = False,
        seq_idx: torch.Tensor | None = None,
        scaling_factor: float | None = None,
        mtp_per_depth_targets: Sequence[torch.Tensor] | None = None,
        ignore_index: int = -100,
    ) -> torch.Tensor:
        """THE training loss of one of this model's outputs: next-token loss + scaled MTP loss (`outputs`).

        A duck-typed hook: am-pipelining's `PipelineCausalLMLoss` and the reference trainer call it when the model
        has it. output: the forward's `NemotronHCausalLMOutputWithPast`, a last pipeline stage's tuple `(logits,
        *D MTP hidden states, int32 seq_idx [B, S])`, or bare logits. labels: [B, S], unshifted unless
        `labels_shifted` (the pipeline's convention). MTP counts while training (or with `compute_mtp_in_eval`);
        seq_idx defaults to the stage tuple's tail. scaling_factor: default `mtp_config.loss_scaling_factor`.
        ignore_index: the label value that is no target (also written where a target would cross a document).
        """
        depths = self.num_mtp_depths
        mtp_hidden: list[torch.Tensor] = []
        if isinstance(output, tuple):
            logits = output[0]
            if depths and len(output) >= 1 + depths:
                mtp_hidden = list(output[1 : 1 + depths])
                if seq_idx is None and len(output) == depths + 2:
                    seq_idx = output[-1]
        elif isinstance(output, torch.Tensor):
            logits = output
        else:
            logits = output.logits
            mtp_hidden = list(output.mtp_per_depth_h or [])
            if mtp_per_depth_targets is None:
                mtp_per_depth_targets = getattr(output, "mtp_per_depth_targets", None)
        if not (self.training or self.compute_mtp_in_eval):
            mtp_hidden = []
        return combined_causal_lm_loss(
            logits,
            labels,
            mtp_per_depth_h=mtp_hidden,
            lm_head=self.lm_head,
            mtp_loss_scaling_factor=self.mtp_config.loss_scaling_factor if scaling_factor is None else scaling_factor,
            seq_idx=seq_idx,
            loss_fn=loss_fn,
            labels_shifted=labels_shifted,
            mtp_per_depth_targets=mtp_per_depth_targets,
            ignore_index=ignore_index,
        ).loss
