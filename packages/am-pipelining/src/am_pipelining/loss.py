"""Pipeline loss for causal LMs, including multi-token prediction (MTP) depths.

Semantics (labels are the already next-token-shifted main labels, so `labels[t]` is token t+1): MTP depth k
(0-based) predicts token t+k+2, i.e. its targets are the labels rolled left k+1 times; the last k+1 positions and
every position whose target would come from another packed sequence are ignored. The MTP term is
`sum_k loss_k × scaling_factor / D`, added to the main loss while the model trains.

This module runs on the last pipeline stage as the schedule's `loss_fn`; it does no communication and never imports
transformers or a model package. The MTP term (targets and scaled sum) is am-context-parallel's `mtp_loss`, the one
implementation the models call too; `shift_packed_tensor` and `MTPLossOutput` are re-exported from there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from am_context_parallel import MTPLossOutput, mtp_loss, mtp_targets, shift_packed_tensor
from am_context_parallel.mtp_loss import roll_tensor
from am_model_contract import contract_of

from .outputs import pipeline_output_names, read_stage_output

__all__ = [
    "roll_tensor",
    "shift_packed_tensor",
    "get_mtp_loss_scaling_factor",
    "calculate_mtp_loss",
    "MTPLossOutput",
    "PipelineCausalLMLoss",
    "MTPLossConfig",
]


def get_mtp_loss_scaling_factor(model: Any, default: float = 0.1) -> float:
    """`model.mtp_config.loss_scaling_factor` when the model has an MTP config, else `default`."""
    value = getattr(getattr(model, "mtp_config", None), "loss_scaling_factor", None)
    return float(value) if value is not None else default


def _call_loss(
    loss_fn: Callable[..., torch.Tensor], logits: torch.Tensor, labels: torch.Tensor, num_label_tokens: Any
) -> torch.Tensor:
    try:
        accepts = "num_label_tokens" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        accepts = False
    if accepts and num_label_tokens is not None:
        return loss_fn(logits, labels, num_label_tokens=num_label_tokens)
    return loss_fn(logits, labels)


def _output_projection(model: Any, lm_weight: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if lm_weight is not None:
        return lambda h: h @ lm_weight.t()
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None and callable(getattr(model, "get_output_embeddings", None)):
        lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise ValueError("lm_head module not found in model: pass lm_weight or MTP logits instead of hidden states.")
    return lm_head


def _resolve_seq_idx(
    labels: torch.Tensor, seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> torch.Tensor | None:
    if seq_idx is None and cu_seqlens is not None:
        bounds = cu_seqlens.reshape(-1)
        seq_len = labels.shape[-1]
        seq_idx = torch.searchsorted(bounds[1:], torch.arange(seq_len, device=labels.device), right=True)
    if seq_idx is None:
        return None
    if seq_idx.dim() == 1 and labels.dim() == 2:
        seq_idx = seq_idx.unsqueeze(0).expand_as(labels)
    elif seq_idx.dim() == 2 and labels.dim() == 1 and seq_idx.shape[0] == 1:
        seq_idx = seq_idx.squeeze(0)
    if seq_idx.shape != labels.shape:
        raise ValueError(
            f"calculate_mtp_loss: seq_idx.shape={tuple(seq_idx.shape)} does not match labels.shape="
            f"{tuple(labels.shape)}; under PP, chunk seq_idx into per-microbatch pieces together with the labels."
        )
    return seq_idx


def _refuse_grad_reduce_group(group: Any) -> None:
    if group is not None:
        raise ValueError(
            "grad_reduce_group is not supported: this loss runs locally on the last pipeline stage and never "
            "materializes a sharded LM-head weight, so there are no gradients to reduce over a group (FSDP2 reduces "
            "parameter gradients itself). Leave it None."
        )


def calculate_mtp_loss(
    loss_fn: Callable[..., torch.Tensor],
    *,
    mtp_per_depth_h: Sequence[torch.Tensor] | None = None,
    mtp_per_depth_logits: Sequence[torch.Tensor] | None = None,
    mtp_per_depth_targets: Sequence[torch.Tensor] | None = None,
    labels: torch.Tensor,
    model: Any = None,
    scaling_factor: float = 0.1,
    num_label_tokens: Any = None,
    ignore_index: int = -100,
    cu_seqlens: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    lm_weight: torch.Tensor | None = None,
    grad_reduce_group: Any = None,
    return_per_depth: bool = False,
) -> torch.Tensor | MTPLossOutput:
    """MTP loss: `sum_k loss_fn(logits_k, targets_k) × scaling_factor / D` over depths k = 0..D-1 (upstream's
    signature and checks over am-context-parallel's `mtp_targets` / `mtp_loss`, the one implementation).

    Args:
        loss_fn: `(logits [B, S, V], labels [B, S]) -> scalar` (may accept `num_label_tokens=`).
        mtp_per_depth_h: D hidden states [B, S, H], projected with the model's `lm_head` (or `lm_weight`).
        mtp_per_depth_logits: D logits [B, S, V] (exactly one of the two must be given).
        mtp_per_depth_targets: precomputed targets per depth (context-parallel path); exclusive with
            `cu_seqlens`/`seq_idx`.
        labels: main labels [B, S] (or flat [T]), already shifted to the next token.
        seq_idx / cu_seqlens: packed-sequence ids [B, S] or boundaries, so targets never cross sequences.
        return_per_depth: also return the unscaled per-depth losses.

    Raises:
        ValueError: both or neither per-depth inputs, bad target count/shape, targets with seq metadata,
            seq_idx shape mismatch, no lm_head for hidden states.
    """
    _refuse_grad_reduce_group(grad_reduce_group)
    if (mtp_per_depth_h is None) == (mtp_per_depth_logits is None):
        raise ValueError("Provide exactly one of mtp_per_depth_h or mtp_per_depth_logits")
    outputs = list(mtp_per_depth_h if mtp_per_depth_h is not None else mtp_per_depth_logits or [])
    depths = len(outputs)
    if depths == 0:
        raise ValueError("calculate_mtp_loss needs at least one MTP depth.")
    if labels.dim() == 1:
        outputs = [o.squeeze(0) if o.dim() == 3 and o.shape[0] == 1 else o for o in outputs]
    if mtp_per_depth_targets is not None:
        if cu_seqlens is not None or seq_idx is not None:
            raise ValueError("mtp_per_depth_targets cannot be combined with cu_seqlens or seq_idx (already applied).")
        if len(mtp_per_depth_targets) != depths:
            raise ValueError(f"Got {len(mtp_per_depth_targets)} MTP target tensors for {depths} MTP depths.")
        for k, target in enumerate(mtp_per_depth_targets):
            if target.shape != labels.shape:
                raise ValueError(
                    f"MTP targets of depth {k} have shape {tuple(target.shape)}, labels {tuple(labels.shape)}."
                )
        targets = list(mtp_per_depth_targets)
    else:
        targets = mtp_targets(
            labels, depths, seq_idx=_resolve_seq_idx(labels, seq_idx, cu_seqlens), ignore_index=ignore_index
        )
    # The term itself is am-context-parallel's `mtp_loss`, the one implementation the models call too.
    out = mtp_loss(
        outputs,
        targets,
        loss_fn=lambda logits, target: _call_loss(loss_fn, logits, target, num_label_tokens),
        scaling_factor=scaling_factor,
        project=_output_projection(model, lm_weight) if mtp_per_depth_h is not None else None,
    )
    return out if return_per_depth else out.loss


class PipelineCausalLMLoss(nn.Module):
    """The schedule's `loss_fn` for the last stage: main LM loss plus MTP depths when the stage emits them.

    The last stage returns logits [B, S, V], a `StageOutput`, or a plain tuple read by the names the stage module
    declares in its contract's `pp.output_names` (`pipeline_output_names`, e.g. `("logits", "mtp_per_depth_h",
    "seq_idx")`, see `am_pipelining.outputs`); an undeclared tuple is upstream's `(logits, mtp_1, ..., mtp_D)`, the
    MTP entries being hidden states (or logits when `model.mtp_outputs_are_logits`). Nothing is inferred from dtypes
    or shapes. MTP is added only while `model.training`.

    A model that owns its training-loss rule (e.g. Nemotron-H's next-token + MTP loss) declares it in its contract,
    `pp.loss(output, labels, *, loss_fn, labels_shifted, seq_idx, scaling_factor, ignore_index)`; the loss then
    calls it (labels already shifted; seq_idx from the output's int32 tail or from `cu_seqlens`, else
    None; scaling_factor None means the model's own), so the pipeline, the single-process trainer and the model
    compute one rule (with `mtp_per_depth_targets=` when the caller gives precomputed MTP targets). Without the hook
    the generic rule below applies.

    Args:
        loss_fn: `(logits, labels) -> scalar`, e.g. a token-sum cross entropy.
        model: the last stage's module (its `lm_head` projects MTP hidden states; its `mtp_config` gives the
            default scaling).
        scaling_factor: overrides the model's MTP loss scaling when given.
    """

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        model: Any,
        scaling_factor: float | None = None,
        ignore_index: int = -100,
        grad_reduce_group: Any = None,
    ) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        # Not a registered submodule: the loss must not own (or re-export) the stage's parameters.
        self.__dict__["model"] = model
        self.scaling_factor = scaling_factor
        self.ignore_index = ignore_index
        _refuse_grad_reduce_group(grad_reduce_group)
        self.cu_seqlens: torch.Tensor | None = None

    def forward(
        self, output: Any, labels: torch.Tensor, *, mtp_per_depth_targets: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The loss of one microbatch. labels: [B, S] already shifted. mtp_per_depth_targets: D [B, S] MTP targets
        computed on the whole sequences (context parallelism: a shard cannot roll its labels across a block edge);
        None: they are rolled from `labels` within documents."""
        model = self.model
        parts = read_stage_output(
            output,
            names=pipeline_output_names(model),
            mtp_outputs_are_logits=bool(getattr(model, "mtp_outputs_are_logits", False)),
        )
        scaling = self.scaling_factor
        if scaling is None and not isinstance(output, (torch.Tensor, tuple, list)):
            scaling = getattr(output, "mtp_loss_scaling_factor", None)
        combined_loss = contract_of(model).pp.loss if model is not None else None
        if combined_loss is not None:
            seq_idx = parts.seq_idx if mtp_per_depth_targets is None else None  # targets already respect documents
            if seq_idx is None and mtp_per_depth_targets is None and self.cu_seqlens is not None:
                seq_idx = _resolve_seq_idx(labels, None, self.cu_seqlens)
            # A stage tuple is handed on as (logits, *mtp) with its seq_idx apart; a model output object as is.
            named = (parts.logits, *parts.mtp_per_depth_h) if isinstance(output, (tuple, list)) else output
            extra = {} if mtp_per_depth_targets is None else {"mtp_per_depth_targets": list(mtp_per_depth_targets)}
            return combined_loss(
                named,
                labels,
                loss_fn=self.loss_fn,
                labels_shifted=True,
                seq_idx=seq_idx,
                scaling_factor=scaling,
                ignore_index=self.ignore_index,
                **extra,
            )
        loss = _call_loss(self.loss_fn, parts.logits, labels, None)
        training = bool(getattr(model, "training", True))
        if training and (parts.mtp_per_depth_h or parts.mtp_per_depth_logits):
            if scaling is None:
                scaling = get_mtp_loss_scaling_factor(model)
            loss = loss + calculate_mtp_loss(  # type: ignore[operator]
                self.loss_fn,
                mtp_per_depth_h=parts.mtp_per_depth_h or None,
                mtp_per_depth_logits=parts.mtp_per_depth_logits or None,
                labels=labels,
                model=model,
                scaling_factor=scaling,
                ignore_index=self.ignore_index,
                mtp_per_depth_targets=mtp_per_depth_targets,
                seq_idx=parts.seq_idx if mtp_per_depth_targets is None else None,
                cu_seqlens=self.cu_seqlens if parts.seq_idx is None and mtp_per_depth_targets is None else None,
            )
        return loss


@dataclass
class MTPLossConfig:
    """Config that builds a `PipelineCausalLMLoss`."""

    scaling_factor: float | None = None
    ignore_index: int = -100

    def build(
        self, loss_fn: Callable[..., torch.Tensor], model: Any, *, grad_reduce_group: Any = None
    ) -> PipelineCausalLMLoss:
        return PipelineCausalLMLoss(
            loss_fn, model, self.scaling_factor, ignore_index=self.ignore_index, grad_reduce_group=grad_reduce_group
        )
