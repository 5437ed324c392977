"""Plans as data: read a model's declared tensor-parallel plan, match its patterns to modules, freeze the result.

A plan maps module-name patterns to style names, as transformers writes them: `"layers.*.self_attn.q_proj":
"colwise"`, where `*` stands for a layer index (a number between dots) and nothing else. `declared_plan(model)`
reads what a model declares (its contract's `tp.plan`: transformers' merge of the classes' `_tp_plan`, the base
model's `config.base_model_tp_plan` under its prefix, `embed_tokens` made vocabulary-parallel); `plan_tensor_parallel`
validates a plan against a model and a tp size and returns a frozen `TensorParallelPlan` naming every module once.

Pure: no process group, no collective; the model is only read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from am_model_contract import contract_of

__all__ = [
    "TensorParallelPlan",
    "declared_plan",
    "experts_whole",
    "layer_pattern",
    "match_plan",
]


def layer_pattern(name: str) -> str:
    """transformers' generic name of a module: every index between dots becomes `*`
    (`model.layers.3.mlp.up_proj` -> `model.layers.*.mlp.up_proj`; `w1` keeps its digit)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def declared_plan(model: nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan a model declares, with full module-name patterns; None when it declares none.

    Its contract's `tp.plan` (`am_model_contract.contract_of`): for a model without `am_contract`, transformers'
    merge of every module class's `_tp_plan` and the base model's `config.base_model_tp_plan`
    (`am_model_contract.declared_tp_plan`), which our models also declare.
    """
    plan = contract_of(model).tp.plan
    return dict(plan) if plan else None


def experts_whole(plan: Mapping[str, str]) -> dict[str, str]:
    """`plan` with transformers' expert tensor parallelism taken out: the experts stay whole on every tp rank.

    Every `moe_tp_experts` entry (e.g. `model.layers.*.mlp.experts`) and the patterns under it (its parameters:
    `...experts.gate_up_proj`, `...experts.down_proj`) are dropped, and the block holding those experts (the
    pattern's parent, `model.layers.*.mlp`: router and experts) becomes `sequence_gather` unless the plan styles it:
    it runs whole, on whole sequences under sequence parallelism, as our models' MoE blocks do. Expert parallelism
    (am_moe) is what splits experts. A plan without `moe_tp_experts` comes back unchanged.
    """
    experts = [key for key, style in plan.items() if style == "moe_tp_experts"]
    kept = {key: style for key, style in plan.items() if not any(key == e or key.startswith(e + ".") for e in experts)}
    for key in experts:
        parent = key.rpartition(".")[0]
        if parent and parent not in kept:
            kept[parent] = "sequence_gather"
    return kept


def match_plan(model: nn.Module, plan: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """`({module name: style}, [patterns that match no module])`.

    A pattern matches a module when it equals the module's name or its `layer_pattern`. A pattern naming a
    parameter (`...experts.gate_up_proj`) matches no module and is reported as unmatched.
    """
    matched: dict[str, str] = {}
    used: set[str] = set()
    for name, _module in model.named_modules():
        key = next((k for k in (name, layer_pattern(name)) if k in plan), None) if name else None
        if key is not None:
            matched[name] = plan[key]
            used.add(key)
    return matched, [key for key in plan if key not in used]


@dataclass(frozen=True)
class TensorParallelPlan:
    """A validated tensor-parallel plan for one model and one tp size: the data every apply step reads.

    Attributes:
        tp: the size of the tp mesh dimension.
        styles: `{module name: style name}`, one entry per module (patterns already expanded).
        sequence_parallel: the residual stream between TP regions is sharded on the sequence dim (dim 1).
        loss_parallel: the output head keeps its vocabulary shard (`colwise` output, not gathered); the loss must be
            `vocab_parallel_cross_entropy`.
        input_embedding / output_head: the names of the model's input embedding and output projection ("" if none).
        norms: the modules run on sequence shards under sequence parallelism (empty without it).
        region_inputs: modules that open a TP region (parents of colwise projections): their input enters once for
            all their projections (gathered from the sequence shards under sequence parallelism).
        head_counts: `{attention module name: {attribute: local value}}`, the head counts set on the attention
            modules whose projections are sharded by heads.
        tied: `(embedding weight owner, head weight owner)` when they share one weight, else None.
    """

    tp: int
    styles: Mapping[str, str]
    sequence_parallel: bool = False
    loss_parallel: bool = False
    input_embedding: str = ""
    output_head: str = ""
    norms: tuple[str, ...] = ()
    region_inputs: tuple[str, ...] = ()
    head_counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    tied: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "styles", MappingProxyType(dict(self.styles)))
        object.__setattr__(self, "head_counts", MappingProxyType({k: dict(v) for k, v in self.head_counts.items()}))

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary (for `summary.json`-style records)."""
        return {
            "tp": self.tp,
            "sequence_parallel": self.sequence_parallel,
            "loss_parallel": self.loss_parallel,
            "styles": dict(self.styles),
            "norms": list(self.norms),
            "head_counts": {k: dict(v) for k, v in self.head_counts.items()},
            "tied": list(self.tied) if self.tied else None,
        }
