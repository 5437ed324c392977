"""Tensor and sequence parallelism from plans as data.

A plan maps module-name patterns to transformers' style names (`{"layers.*.self_attn.q_proj": "colwise"}`);
`plan` reads a model's declared plan and matches it, `validate` lists every problem before any collective and
freezes a `TensorParallelPlan`, `styles` translates style names to torch `ParallelStyle`s, `apply` shards the model
over a `tp` mesh dimension with `parallelize_module`, `loss` is the cross-entropy over a vocabulary-sharded head.
Depends on torch and am-model-contract (a model's plan is its contract's `tp.plan`); never imports a model package or
transformers.
"""

from __future__ import annotations

from ._version import __version__
from .apply import apply_tensor_parallel, reduce_partial_grads, tp_submesh
from .comm import CollectiveBytes, count_collective_bytes
from .loss import vocab_parallel_cross_entropy
from .plan import TensorParallelPlan, declared_plan, experts_whole, layer_pattern, match_plan
from .segments import SummedLinear, gather_segments, region_input, region_output, segment_sizes_problems, shard_segments
from .styles import (
    FULL_STATE_METHOD,
    MODULE_STYLE_METHOD,
    PROBLEMS_METHOD,
    SHARD_STATE_METHOD,
    STYLES,
    UNSUPPORTED_STYLES,
    translate_style,
)
from .validate import HEAD_COUNT_ATTRIBUTES, plan_tensor_parallel, tp_problems

__all__ = [
    "__version__",
    # plans
    "TensorParallelPlan",
    "declared_plan",
    "experts_whole",
    "layer_pattern",
    "match_plan",
    # validation
    "HEAD_COUNT_ATTRIBUTES",
    "plan_tensor_parallel",
    "tp_problems",
    # styles
    "FULL_STATE_METHOD",
    "MODULE_STYLE_METHOD",
    "PROBLEMS_METHOD",
    "SHARD_STATE_METHOD",
    "STYLES",
    "UNSUPPORTED_STYLES",
    "translate_style",
    # modules that shard themselves
    "SummedLinear",
    "gather_segments",
    "region_input",
    "region_output",
    "segment_sizes_problems",
    "shard_segments",
    # apply
    "apply_tensor_parallel",
    "reduce_partial_grads",
    "tp_submesh",
    # loss
    "vocab_parallel_cross_entropy",
    # communication
    "CollectiveBytes",
    "count_collective_bytes",
]
