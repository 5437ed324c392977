"""Gemma 4's tensor-parallel plan, as data: transformers' style names over our module names.

What it is for: the `{module pattern: style}` maps that am-tensor-parallel (or any reader of transformers' plans)
applies over a `tp` mesh dimension — `TEXT_MODEL_TP_PLAN` on `Gemma4TextModel._tp_plan` (patterns relative to the
text model), `CAUSAL_LM_TP_PLAN` on `Gemma4ForCausalLM._tp_plan` (the head). A reader that merges plans the way
transformers does (`am_tensor_parallel.declared_plan`) sees `model.layers.*.self_attn.q_proj: colwise`, ... and
`lm_head: colwise_gather_output`.

The sharding (Megatron's): attention is split by heads (q/k/v `colwise`, `o_proj` `rowwise`; the per-head q/k norms
are replicated with their gradients summed over tp), the dense GeGLU MLP by its intermediate features (gate/up
`colwise`, down `rowwise`), the vocabulary of the tied embedding and head (`embedding_rowwise` + a gathered
`colwise` head; the tied weight stays one parameter). Every attention, sliding and full, must have query heads and
key/value heads (`num_key_value_heads`, `num_global_key_value_heads` on K=V full layers) divisible by tp;
am-tensor-parallel's `tp_problems` reads them from each attention module and lists every layer that does not.

Experts are NOT tensor-parallel: under tp the MoE block (router and experts) stays whole on every tp rank (each tp
rank routes the same tokens through the same experts), and the experts are split by expert parallelism
(`apply_expert_parallel` over an `ep` mesh dimension), which keeps whole experts per ep rank — transformers'
`moe_tp_experts` (each expert's matrices cut over tp) is not used. Per-layer-input (PLE) projections stay replicated.

Sequence parallelism: not declared. Gemma 4's decoder multiplies the stream by a `layer_scalar` buffer and feeds
the raw residual to the MoE router; neither runs on DTensor sequence shards, so a trainer runs Gemma 4 with
`sequence_parallel=False` (am-tensor-parallel refuses it through `tp_sequence_parallel_problem`).

What it must not do: import am-tensor-parallel (the plan is plain data; the infrastructure reads it).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

__all__ = ["CAUSAL_LM_TP_PLAN", "TEXT_MODEL_TP_PLAN", "sequence_parallel_problem"]

TEXT_MODEL_TP_PLAN = MappingProxyType(
    {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
)
CAUSAL_LM_TP_PLAN = MappingProxyType({"lm_head": "colwise_gather_output"})


def sequence_parallel_problem(model: Any) -> str:
    """Why Gemma 4 does not run with sequence parallelism (the `tp_sequence_parallel_problem` hook's answer)."""
    del model
    return (
        "Gemma 4 declares no sequence-parallel layout (its decoder scales the stream by a `layer_scalar` buffer and "
        "routes the MoE block on the raw residual, which do not run on sequence shards): use sequence_parallel=False"
    )
