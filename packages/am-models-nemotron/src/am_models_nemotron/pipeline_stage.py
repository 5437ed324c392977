"""The pipeline-stage side of `NemotronHForCausalLM`: what its duck-typed pipeline hooks compute, and the forward of a
pruned stage.

What it is for: `is_pipeline_stage`, `stage_metas` (static shapes: inputs `[mb, S]` int64 on the first stage, else
hidden + D MTP embeddings; outputs hidden + D embeddings, or on the last stage logits + D MTP hidden states + an
int32 `[mb, S]` document-id tail), `PER_SAMPLE_KWARGS`, and `stage_forward` (hidden states arrive in the `input_ids`
slot, the D MTP embeddings as extra positional tensors).
What it must not do: import am-pipelining, or run a different rule for documents and masks than the full model
(it resolves the same `BatchLayout` and builds the MTP embeddings with the same function).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .mtp_inputs import mtp_fusion_inputs

if TYPE_CHECKING:
    from .forward_inputs import ForwardInputs

__all__ = ["PER_SAMPLE_KWARGS", "is_pipeline_stage", "stage_forward", "stage_metas"]

# Per-sample forward kwargs that am-pipelining splits into micro-batches along dim 0.
PER_SAMPLE_KWARGS = (
    "attention_mask",
    "seq_idx",
    "padding_mask",
    "_packed_seq_ids",
    "position_ids",
    "mtp_per_depth_input_ids",
    "mtp_per_depth_targets",
    "shift_labels",
)


def is_pipeline_stage(model: Any) -> bool:
    """Whether `model` (a `NemotronHForCausalLM`) was pruned to a pipeline stage (as am-pipelining prunes it)."""
    return (
        model.lm_head is None
        or model.model.embed_tokens is None
        or len(model.model.layers) != model.nemotron_config.num_hidden_layers
    )


def stage_forward(
    model: Any, inputs: ForwardInputs, mtp_embed_inputs: tuple[torch.Tensor, ...], per_depth_input_ids: Any
) -> Any:
    """The forward of a pipeline stage (contract: `NemotronHForCausalLM.forward`; `mtp_embed_inputs`: the D MTP
    embeddings a previous stage sent; `per_depth_input_ids`: under CP, shifted before sharding). MTP depths travel and
    run whatever the train/eval mode, so a stage's output arity always equals `stage_metas`."""
    depths = model.num_mtp_depths
    layout = inputs.layout
    input_ids = inputs.input_ids
    hidden = model.model(input_ids, layout=layout)
    if depths and model.model.embed_tokens is not None:
        assert input_ids is not None
        mtp_embed_inputs = tuple(
            mtp_fusion_inputs(
                depths=depths,
                embed_tokens=model.model.embed_tokens,
                input_ids=input_ids,
                inputs_embeds=None,
                seq_idx=layout.seq_idx,
                per_depth_input_ids=per_depth_input_ids,
            )
        )
    if depths and len(mtp_embed_inputs) != depths:
        raise ValueError(
            f"This pipeline stage expects {depths} MTP embedding tensors after the hidden states, got "
            f"{len(mtp_embed_inputs)}."
        )
    if model.lm_head is None:
        return (hidden, *mtp_embed_inputs) if depths else hidden
    logits = model.lm_head(hidden)
    if not depths:
        return logits
    if model.mtp is None:
        raise ValueError("The last pipeline stage must hold the `mtp` module (customize_pipeline_stage_modules).")
    mtp_hidden = model.mtp(hidden, embed_inputs=mtp_embed_inputs, **layout.block_inputs(hidden))
    if layout.seq_idx is not None:
        tail = layout.seq_idx.to(torch.int32)
    else:
        tail = torch.zeros(hidden.shape[:2], dtype=torch.int32, device=hidden.device)
    return (logits, *mtp_hidden, tail)


def stage_metas(
    model: Any, *, is_first: bool, microbatch_size: int, seq_len: int, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Meta tensors of a stage's inputs and outputs (arity 1 + D, last stage 1 + D + int32 seq_idx tail)."""
    cfg = model.nemotron_config
    depths = model.num_mtp_depths
    meta = torch.device("meta")

    def hidden() -> torch.Tensor:
        return torch.empty(microbatch_size, seq_len, cfg.hidden_size, dtype=dtype, device=meta, requires_grad=True)

    if is_first:
        inputs: tuple[torch.Tensor, ...] = (torch.empty(microbatch_size, seq_len, dtype=torch.long, device=meta),)
    else:
        inputs = (hidden(), *(hidden() for _ in range(depths)))
    if model.lm_head is None:
        outputs: tuple[torch.Tensor, ...] = (hidden(), *(hidden() for _ in range(depths)))
    else:
        logits = torch.empty(microbatch_size, seq_len, cfg.vocab_size, dtype=dtype, device=meta, requires_grad=True)
        outputs = (logits,)
        if depths:
            tail = torch.empty(microbatch_size, seq_len, dtype=torch.int32, device=meta)
            outputs = (logits, *(hidden() for _ in range(depths)), tail)
    return inputs, outputs
