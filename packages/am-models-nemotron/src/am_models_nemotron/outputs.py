"""The causal LM's output class.

What it is for: `NemotronHCausalLMOutputWithPast`, a transformers `CausalLMOutputWithPast` with the MTP fields
declared as dataclass fields (they survive FSDP2's output reconstruction), whose `loss` is the next-token cross
entropy only, as upstream and transformers return it (the combined loss is `loss.combined_causal_lm_loss`); and
`select_hidden_states`, transformers' `output_hidden_states` selection; `split_output`, the parts of any of the
model's outputs (the output class, a last pipeline stage's tuple, bare logits); `keep_positions`, transformers'
`logits_to_keep`.
What it must not do: compute a loss, or count the MTP loss into `loss` (a recipe that adds the MTP loss itself would
count it twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["NemotronHCausalLMOutputWithPast", "keep_positions", "select_hidden_states", "split_output"]


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


def split_output(
    output: Any, *, mtp_depths: int
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None, list[torch.Tensor] | None]:
    """`(logits, MTP hidden states, seq_idx, MTP targets)` of one of the model's outputs.

    output: `NemotronHCausalLMOutputWithPast`; a last pipeline stage's tuple `(logits [B, S, V], *D MTP hidden states
    [B, S, H], int32 seq_idx [B, S])` (the tail only when D > 0); or bare logits. Missing parts are [] / None.
    """
    if isinstance(output, tuple):
        mtp_hidden: list[torch.Tensor] = []
        seq_idx = None
        if mtp_depths and len(output) >= 1 + mtp_depths:
            mtp_hidden = list(output[1 : 1 + mtp_depths])
            if len(output) == mtp_depths + 2:
                seq_idx = output[-1]
        return output[0], mtp_hidden, seq_idx, None
    if isinstance(output, torch.Tensor):
        return output, [], None, None
    return output.logits, list(output.mtp_per_depth_h or []), None, getattr(output, "mtp_per_depth_targets", None)


def keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """transformers' `logits_to_keep` on hidden states [B, S, H]: 0 keeps all, n > 0 the last n positions, a tensor
    the positions it indexes.

    Raises:
        ValueError: a negative count.
    """
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep]
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
    return hidden[:, -logits_to_keep:]
