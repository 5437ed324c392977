"""The causal LM forward's input normalisation: every argument `NemotronHForCausalLM.forward` takes is resolved or
refused here, once.

What it is for: `resolve_forward_inputs` turns upstream's and transformers' spellings (a mask mapping passed as
`attention_mask`, THD rows as `[T]`, `labels` or `shift_labels`, `num_items_in_batch`, `cp_size` / `cp_rank`, the
packing keywords) into one `ForwardInputs`: the tokens, the `BatchLayout` (documents, padding, masks, the CP context),
the targets, and whether MTP runs. Under context parallelism every problem is raised on every rank before any
transfer (`cp.resolve_layout`).
What it must not do: run a module (the forward does), or accept an input it then ignores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .cp import NemotronCPContext, cp_kwarg_problems, resolve_layout
from .inputs import BatchLayout, pop_layout_kwargs
from .mtp_inputs import per_depth
from .pipeline_stage import is_pipeline_stage

__all__ = ["ForwardInputs", "resolve_forward_inputs"]

# Keyword arguments of transformers' generate() / Trainer that must agree with the entered CP context (1 / 0 outside).
_CP_KWARGS = ("cp_rank", "cp_size")


@dataclass(frozen=True)
class ForwardInputs:
    """One forward's resolved inputs.

    input_ids: [B, S] ids, or [B, S, H] hidden states on a non-first pipeline stage; inputs_embeds: [B, S, H];
    layout: documents, padding, masks and the CP context; targets: [B, S] labels (unshifted) or next-token targets
    (`labels_shifted`); mtp_runs: MTP runs off the pipeline in this call; per_depth_targets: the caller's D MTP
    targets; num_items_in_batch: transformers' loss normaliser; pipeline_stage: this model is a pruned
    stage.
    """

    input_ids: torch.Tensor | None
    inputs_embeds: torch.Tensor | None
    layout: BatchLayout
    targets: torch.Tensor | None
    labels_shifted: bool
    mtp_runs: bool
    per_depth_targets: list[torch.Tensor] | None
    num_items_in_batch: Any
    pipeline_stage: bool


def resolve_forward_inputs(
    model: Any,
    *,
    input_ids: torch.Tensor | None,
    mtp_embed_inputs: tuple[torch.Tensor, ...],
    attention_mask: torch.Tensor | dict[str, Any] | None,
    causal_mask_mapping: dict[str, Any] | None,
    inputs_embeds: torch.Tensor | None,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    past_key_values: Any,
    use_cache: bool | None,
    position_ids: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
    mtp_per_depth_input_ids: Sequence[torch.Tensor] | torch.Tensor | None,
    mtp_per_depth_targets: Sequence[torch.Tensor] | torch.Tensor | None,
    logits_to_keep: int | torch.Tensor,
    compute_logits: bool,
    kwargs: dict[str, Any],
) -> ForwardInputs:
    """`ForwardInputs` of one `NemotronHForCausalLM.forward` call (see its docstring for each argument).

    Raises:
        TypeError: unknown keyword arguments. ValueError: every invalid or contradictory input (one message; under
            context parallelism on every rank, before any transfer).
    """
    owner = type(model).__name__
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    if kwargs.pop("output_attentions", None):
        raise ValueError("output_attentions is not supported (SDPA does not return attention weights).")
    cp_kwargs = {name: kwargs.pop(name) for name in _CP_KWARGS if name in kwargs}
    layout_kwargs = pop_layout_kwargs(kwargs)
    if kwargs:
        raise TypeError(f"{owner}.forward got unexpected keyword arguments {sorted(kwargs)}.")
    if isinstance(attention_mask, dict):  # transformers passes its mask mapping as attention_mask
        if causal_mask_mapping is not None:
            raise ValueError("got a mask mapping as attention_mask and causal_mask_mapping; pass one of them")
        causal_mask_mapping, attention_mask = attention_mask, None
    if layout_kwargs.get("qkv_format") == "thd":  # one packed row may come as [T] / [T, H]
        input_ids = input_ids[None] if input_ids is not None and input_ids.dim() == 1 else input_ids
        inputs_embeds = inputs_embeds[None] if inputs_embeds is not None and inputs_embeds.dim() == 2 else inputs_embeds
        labels = labels[None] if labels is not None and labels.dim() == 1 else labels
    if position_ids is not None:
        layout_kwargs["position_ids"] = position_ids
    if padding_mask is not None:
        layout_kwargs["padding_mask"] = padding_mask
    if labels is not None and shift_labels is not None:
        raise ValueError("pass labels (unshifted) or shift_labels (already shifted), not both")
    reference = input_ids if input_ids is not None else inputs_embeds
    if reference is None:
        raise ValueError("input_ids must be provided if inputs_embeds is not provided.")

    seqlen = reference.shape[1]
    stage = is_pipeline_stage(model)
    mtp_runs = model.mtp is not None and past_key_values is None and not use_cache
    mtp_runs = mtp_runs and (model.training or model.compute_mtp_in_eval)
    per_depth_given = bool(mtp_embed_inputs) or mtp_per_depth_input_ids is not None

    def cp_problems(cp: NemotronCPContext) -> list[str]:
        problems = model.cp_problems(seq_len=seqlen * cp.size, local_seq_len=seqlen, cp_size=cp.size)
        problems += cp_kwarg_problems(cp_kwargs, cp.size, cp.rank)
        if labels is not None:
            problems.append(
                "labels would be shifted here, across block edges; prepare the batch with "
                "model.prepare_batch_for_cp before sharding and pass its labels as shift_labels (or compute the "
                "loss with model.combined_loss(out, labels, labels_shifted=True))"
            )
        if use_cache or past_key_values is not None:
            problems.append("a generation cache cannot be combined with context parallelism")
        first_stage = model.model.embed_tokens is not None
        needs_ids = mtp_runs or (stage and model.num_mtp_depths > 0)
        if needs_ids and first_stage and not per_depth_given:
            problems.append(
                "MTP needs mtp_per_depth_input_ids shifted on the whole sequence before sharding "
                "(model.prepare_batch_for_cp)"
            )
        if shift_labels is not None and mtp_runs and mtp_per_depth_targets is None:
            problems.append("the MTP loss needs mtp_per_depth_targets from model.prepare_batch_for_cp")
        return problems

    layout = resolve_layout(
        owner=owner,
        batch=reference.shape[0],
        seqlen=seqlen,
        device=reference.device,
        past_length=past_key_values.get_seq_length() if past_key_values is not None else 0,
        attention_mask=attention_mask,
        causal_mask_mapping=causal_mask_mapping,
        **layout_kwargs,
        cp_problems=cp_problems,
    )
    if layout.cp is None and cp_kwarg_problems(cp_kwargs, 1, 0):
        raise ValueError(
            "; ".join(cp_kwarg_problems(cp_kwargs, 1, 0)) + ": context parallelism runs inside the "
            "RingAttentionContext of make_cp_batch_and_ctx(mesh, batch, model=model), after "
            "model.prepare_batch_for_cp(batch)."
        )
    targets = labels if labels is not None else shift_labels
    if not stage:
        if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError(
                f"logits_to_keep={logits_to_keep!r} cannot be combined with labels: the loss needs the logits of every "
                "position. Pass logits_to_keep=0 (the default) when computing a loss."
            )
        if labels is not None and not compute_logits:
            raise ValueError("compute_logits=False cannot be combined with labels (the loss needs logits).")
        if not mtp_runs and (per_depth_given or mtp_per_depth_targets is not None):
            raise ValueError("per-depth MTP inputs were given but MTP does not run (no MTP, eval, or a cache).")
    return ForwardInputs(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        layout=layout,
        targets=targets,
        labels_shifted=shift_labels is not None,
        mtp_runs=mtp_runs and not stage,
        per_depth_targets=per_depth(mtp_per_depth_targets),
        num_items_in_batch=num_items_in_batch,
        pipeline_stage=stage,
    )
