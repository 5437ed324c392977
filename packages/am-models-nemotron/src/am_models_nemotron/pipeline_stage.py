"""The pipeline-stage side of `NemotronHForCausalLM`: the duck-typed hooks am-pipelining looks up, and the forward
of a pruned stage.

What it is for: `NemotronPipelineMixin` — `customize_pipeline_stage_modules` (the last stage keeps `mtp`),
`get_pipeline_stage_metas` (static shapes: inputs `[mb, S]` int64 on the first stage, else hidden + D MTP
embeddings; outputs hidden + D embeddings, or on the last stage logits + D MTP hidden states + an int32 `[mb, S]`
document-id tail), `get_pipeline_kwargs_chunk_dims`, and `_stage_forward` (hidden states arrive in the `input_ids`
slot, the D MTP embeddings as extra positional tensors).
What it must not do: import am-pipelining, or run a different rule for documents and masks than the full model
(it resolves the same `BatchLayout` and builds the MTP embeddings with the same function).
"""

from __future__ import annotations

from typing import Any

import torch

from .inputs import BatchLayout
from .mtp_inputs import mtp_fusion_inputs

__all__ = ["NemotronPipelineMixin"]

# Per-sample forward kwargs that am-pipelining splits into micro-batches along dim 0.
_PER_SAMPLE_KWARGS = (
    "attention_mask",
    "seq_idx",
    "padding_mask",
    "_packed_seq_ids",
    "position_ids",
    "mtp_per_depth_input_ids",
    "mtp_per_depth_targets",
    "shift_labels",
)


class NemotronPipelineMixin:
    """Pipeline hooks of `NemotronHForCausalLM` (which provides `model`, `lm_head`, `mtp`, `nemotron_config` and
    `mtp_config`)."""

    model: Any
    lm_head: Any
    mtp: Any
    nemotron_config: Any
    mtp_config: Any

    @property
    def num_mtp_depths(self) -> int:
        """MTP depths D from the config (also on pipeline stages whose `mtp` module was pruned)."""
        return int(self.mtp_config.num_layers) if self.mtp_config.enabled else 0

    def _is_pipeline_stage(self) -> bool:
        return (
            self.lm_head is None
            or self.model.embed_tokens is None
            or len(self.model.layers) != self.nemotron_config.num_hidden_layers
        )

    def _stage_forward(
        self,
        input_ids: torch.Tensor | None,
        mtp_embed_inputs: tuple[torch.Tensor, ...],
        *,
        layout: BatchLayout,
        per_depth_input_ids: Any = None,
    ) -> Any:
        """Pipeline-stage contract (see `NemotronHForCausalLM.forward`). MTP depths travel and run whatever the
        train/eval mode, so a stage's output arity always equals `get_pipeline_stage_metas`."""
        depths = self.num_mtp_depths
        hidden = self.model(input_ids, layout=layout)
        if depths and self.model.embed_tokens is not None:
            assert input_ids is not None
            mtp_embed_inputs = tuple(
                mtp_fusion_inputs(
                    depths=depths,
                    embed_tokens=self.model.embed_tokens,
                    input_ids=input_ids,
                    inputs_embeds=None,
                    seq_idx=layout.seq_idx,
                    per_depth_input_ids=per_depth_input_ids,  # context parallelism: shifted before sharding
                )
            )
        if depths and len(mtp_embed_inputs) != depths:
            raise ValueError(
                f"This pipeline stage expects {depths} MTP embedding tensors after the hidden states, got "
                f"{len(mtp_embed_inputs)}."
            )
        if self.lm_head is None:
            return (hidden, *mtp_embed_inputs) if depths else hidden
        logits = self.lm_head(hidden)
        if not depths:
            return logits
        if self.mtp is None:
            raise ValueError("The last pipeline stage must hold the `mtp` module (customize_pipeline_stage_modules).")
        mtp_hidden = self.mtp(hidden, embed_inputs=mtp_embed_inputs, **layout.block_inputs(hidden))
        if layout.seq_idx is not None:
            tail = layout.seq_idx.to(torch.int32)
        else:
            tail = torch.zeros(hidden.shape[:2], dtype=torch.int32, device=hidden.device)
        return (logits, *mtp_hidden, tail)

    def customize_pipeline_stage_modules(
        self, module_names_per_stage: list[list[str]], *, layers_prefix: str = "model.", text_model: Any = None
    ) -> list[list[str]]:
        """Copy of the per-stage module names with `mtp` appended to the last stage when the model has MTP."""
        names = [list(stage) for stage in module_names_per_stage]
        if self.mtp is not None and names and "mtp" not in names[-1]:
            names[-1].append("mtp")
        return names

    def get_pipeline_stage_metas(
        self, *, is_first: bool, microbatch_size: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Meta tensors of this stage's inputs and outputs (arity 1 + D, last stage 1 + D + int32 seq_idx tail)."""
        cfg = self.nemotron_config
        depths = self.num_mtp_depths
        meta = torch.device("meta")

        def hidden() -> torch.Tensor:
            return torch.empty(microbatch_size, seq_len, cfg.hidden_size, dtype=dtype, device=meta, requires_grad=True)

        if is_first:
            inputs: tuple[torch.Tensor, ...] = (torch.empty(microbatch_size, seq_len, dtype=torch.long, device=meta),)
        else:
            inputs = (hidden(), *(hidden() for _ in range(depths)))
        if self.lm_head is None:
            outputs: tuple[torch.Tensor, ...] = (hidden(), *(hidden() for _ in range(depths)))
        else:
            logits = torch.empty(microbatch_size, seq_len, cfg.vocab_size, dtype=dtype, device=meta, requires_grad=True)
            outputs = (logits,)
            if depths:
                tail = torch.empty(microbatch_size, seq_len, dtype=torch.int32, device=meta)
                outputs = (logits, *(hidden() for _ in range(depths)), tail)
        return inputs, outputs

    def get_pipeline_kwargs_chunk_dims(self, kwargs: dict[str, Any]) -> dict[str, int]:
        """Per-sample tensors in `kwargs` are split into micro-batches along dim 0."""
        return {name: 0 for name in _PER_SAMPLE_KWARGS if isinstance(kwargs.get(name), torch.Tensor)}
