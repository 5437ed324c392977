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

Sequence parallelism (`sequence_parallel=True`): the stream between the regions and the norms on sequence shards;
the MoE block (`Gemma4MoE`, `MOE_TP_PLAN`: `"sequence_gather"`) runs whole on whole sequences (input gathered, output
sliced back to the shard); tested equal to the single process, dense and MoE. Refused with the reason, before any
collective, by `tensor_parallel_problems` (the text model's validation hook, which am-tensor-parallel calls):
per-layer inputs (PLE: their gate is not a TP region).

What it must not do: import am-tensor-parallel (the plan is plain data; the infrastructure reads it).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

__all__ = ["CAUSAL_LM_TP_PLAN", "MOE_TP_PLAN", "TEXT_MODEL_TP_PLAN", "tensor_parallel_problems"]

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
# `Gemma4MoE._tp_plan` (the router and experts of a MoE layer, whole on every tp rank): on whole sequences under
# sequence parallelism (its inputs gathered from the shards, its output sliced back), so routing, the balancing terms
# and the ep all-to-all see exactly the tokens they see without it.
MOE_TP_PLAN = MappingProxyType({"": "sequence_gather"})


def tensor_parallel_problems(model: Any, tp: int, *, sequence_parallel: bool = False) -> list[str]:
    """What a Gemma 4 text model cannot run under tensor parallelism beyond what its plan's sizes say (the hook
    am-tensor-parallel's `tp_problems` calls on every module): sequence parallelism with per-layer inputs (PLE)."""
    del tp
    if not sequence_parallel:
        return []
    config = model.config
    problems = []
    if getattr(config, "hidden_size_per_layer_input", 0):
        problems.append(
            "sequence parallelism is not declared for Gemma 4 with per-layer inputs (PLE: the per-layer gate runs "
            "outside the TP regions on whole sequences): use sequence_parallel=False"
        )
    return problems
