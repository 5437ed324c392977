"""Expert load balancing in the reference trainer: the `--moe-*` options, their up-front checks, and the step's part.

What it is for: the four options (`--moe-bias-update-rate`, `--moe-aux-loss-coeff`, `--moe-seq-aux-loss-coeff`,
`--moe-z-loss-coeff`; None = the model's own recipe, `type(model).moe_load_balancing`; 0 turns one off) become one
`am_moe.LoadBalancing` in the run plan (`balancing_plan`, with every problem named by `balancing_problems` before any
collective). At run time `MoEBalance` applies am-moe's recipe to this rank's model parts:
    build:          `configure_load_balancing(part, plan.moe_balancing, sequence_group=cp group)` on every part that
                    holds MoE routers (a pipeline stage without MoE layers is left alone)
    each step:      `set_aux_loss_scale(part, 1 / global routed tokens)` before the forwards, so that the terms'
                    gradients, summed over microbatches, dp x cp ranks and stages, are the single process's
    after backward: `aux_loss_values` of every part, summed over every rank (the coefficient-weighted terms of the
                    step's whole global batch, token-mean), for progress, summary.json and TensorBoard
    after the step: the step's GLOBAL expert load (counts summed over dp x cp, ep included, and over microbatches;
                    padding is never counted by am-moe) -> `update_expert_bias` per stage (each stage owns its
                    layers' biases; every rank of a stage applies the same update). Not for a skipped step.
The bias is an fp32 buffer of the model (`e_score_correction_bias`), so checkpoints (DCP and the HF export) hold it
and a resume continues from it exactly.
What it must not do: decide the layout (trainer/plan.py), read raw options at run time (it reads the plan), or
touch a model without MoE routers.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from am_moe import ExpertLoad, LoadBalancing
    from trainer.config import RunConfig

# option dest -> am_moe.LoadBalancing field
OPTION_FIELDS: dict[str, str] = {
    "moe_bias_update_rate": "bias_update_rate",
    "moe_aux_loss_coeff": "aux_loss_coeff",
    "moe_seq_aux_loss_coeff": "seq_aux_loss_coeff",
    "moe_z_loss_coeff": "z_loss_coeff",
}
# summary.json / TensorBoard names of am_moe.AUX_LOSS_TERMS ("aux_loss", "seq_aux_loss", "z_loss"), kept apart from
# the `aux_loss` of transformers MoE models (trainer/step_parts.py's RouterAuxLoss)
TERM_PREFIX = "moe_"


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_balancing_options(p: argparse.ArgumentParser) -> None:
    """The four `--moe-*` options (default None: the model's recipe, `type(model).moe_load_balancing`)."""
    helps = {
        "moe_bias_update_rate": "auxiliary-loss-free balancing (DeepSeek-V3): after each step every router's "
        "selection bias moves by RATE towards its under-loaded experts, from the step's global load",
        "moe_aux_loss_coeff": "batch-level (Switch) load-balancing loss coefficient",
        "moe_seq_aux_loss_coeff": "sequence-level (DeepSeek) load-balancing loss coefficient",
        "moe_z_loss_coeff": "router z-loss coefficient (ST-MoE)",
    }
    for dest, text in helps.items():
        p.add_argument(
            _flag(dest),
            dest=dest,
            type=float,
            default=None,
            metavar="X",
            help=f"{text}; 0 turns it off (default: the model's own recipe; MoE presets and models only)",
        )


def _given(cfg: RunConfig) -> dict[str, float]:
    """The `--moe-*` options the user set (command line or config file): dest -> value."""
    return {dest: getattr(cfg, dest) for dest in OPTION_FIELDS if getattr(cfg, dest, None) is not None}


def _has_balancers(model: nn.Module) -> bool:
    from am_moe import RouterBalancer

    return any(isinstance(m, RouterBalancer) for m in model.modules())


def recipe_of(model: nn.Module) -> LoadBalancing:
    """The model's declared balancing recipe (`type(model).moe_load_balancing`; all off when it declares none)."""
    from am_moe import LoadBalancing

    recipe = getattr(type(model), "moe_load_balancing", None)
    return recipe if isinstance(recipe, LoadBalancing) else LoadBalancing()


def balancing_problems(cfg: RunConfig, model: nn.Module | None) -> list[str]:
    """Every problem of the `--moe-*` options (an empty list means go), before any collective: a value that is not
    finite or is negative; any of them for a model without am-moe routers (dense, or a transformers MoE model, whose
    router loss is its config's `router_aux_loss_coef`); a bias update for routers without a selection bias
    (Gemma 4's softmax router)."""
    given = _given(cfg)
    problems = [
        f"{_flag(dest)} {value}: must be a finite number >= 0 (0 turns it off)"
        for dest, value in given.items()
        if not math.isfinite(value) or value < 0
    ]
    if model is None or not given:
        return problems
    flags = ", ".join(f"{_flag(dest)} {value}" for dest, value in given.items())
    if not _has_balancers(model):
        problems.append(
            f"{flags}: {type(model).__name__} has no am-moe router to balance (a dense model, or a transformers MoE "
            "model whose router loss is its config's router_aux_loss_coef); drop the --moe-* options"
        )
        return problems
    from am_moe import RouterBalancer

    rate = given.get("moe_bias_update_rate")
    unbiased = any(isinstance(m, RouterBalancer) and m.bias_name is None for m in model.modules())
    if rate is not None and rate > 0 and unbiased:
        problems.append(
            f"--moe-bias-update-rate {rate}: {type(model).__name__}'s routers have no selection bias (softmax "
            "routing, as its upstream training), so the auxiliary-loss-free update has nothing to move; use "
            "--moe-bias-update-rate 0 and the loss terms (--moe-aux-loss-coeff, --moe-seq-aux-loss-coeff, "
            "--moe-z-loss-coeff) instead"
        )
    return problems


def balancing_plan(cfg: RunConfig, model: nn.Module) -> LoadBalancing | None:
    """The run's `am_moe.LoadBalancing`: the model's recipe with the given `--moe-*` options over it; None for a
    model without am-moe routers. Call after `balancing_problems` found nothing."""
    from dataclasses import replace

    if not _has_balancers(model):
        return None
    overrides = {OPTION_FIELDS[dest]: value for dest, value in _given(cfg).items()}
    return replace(recipe_of(model), **overrides)


def balancing_json(balancing: LoadBalancing | None) -> dict[str, float] | None:
    """summary.json / plan form: {"bias_update_rate", "aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff"}."""
    if balancing is None:
        return None
    return {name: getattr(balancing, name) for name in OPTION_FIELDS.values()}


class MoEBalance:
    """This rank's part of the run's load balancing (see the module docstring); built once by the loop's `build`.

    Args:
        parts: this rank's model parts (pipeline stage modules, or the whole model), before FSDP2 or after.
        balancing: the run plan's `moe_balancing`.
        sequence_group: the cp group at cp > 1 (each rank holds a shard of the same rows), else None.
    """

    def __init__(self, parts: list[nn.Module], *, balancing: LoadBalancing, sequence_group: Any = None) -> None:
        from am_moe import configure_load_balancing

        self.balancing = balancing
        # A pipeline stage without MoE layers has no router: configure_load_balancing would refuse it.
        self.parts = [part for part in parts if _has_balancers(part)]
        for part in self.parts:
            configure_load_balancing(part, balancing, sequence_group=sequence_group)
        self.tokens = 1.0

    def before_step(self, global_tokens: int) -> None:
        """Scale the terms' gradients by 1 / the step's routed tokens (the global batch's: no padding in the
        trainer's windows), so their token-sums become the token-mean of the whole global batch."""
        from am_moe import set_aux_loss_scale

        self.tokens = float(global_tokens)
        for part in self.parts:
            set_aux_loss_scale(part, 1.0 / self.tokens)

    def step_terms(self, device: torch.device) -> dict[str, float] | None:
        """The step's coefficient-weighted terms, token-mean over the global batch (collective over every rank;
        every rank calls it, after the step's backward and before any other forward); None when no term is on."""
        from am_moe import AUX_LOSS_TERMS, aux_loss_values

        if not self.balancing.has_loss_terms:
            return None
        local = torch.zeros(len(AUX_LOSS_TERMS), dtype=torch.float64, device=device)
        for part in self.parts:  # each part's own layers: no collective here
            values = aux_loss_values(part, normalizer=self.tokens, reset=True)
            local += torch.tensor([values[name] for name in AUX_LOSS_TERMS], dtype=torch.float64, device=device)
        dist.all_reduce(local)  # stages x dp x cp ranks: each rank's own layers and tokens (a cp rank: its 1/cp share)
        return {TERM_PREFIX + name: float(value) for name, value in zip(AUX_LOSS_TERMS, local.tolist(), strict=True)}

    def update_bias(self, part: nn.Module, load: ExpertLoad) -> None:
        """After the optimizer step: move `part`'s router biases from the step's global `load` (no collective)."""
        from am_moe import update_expert_bias

        if self.balancing.bias_update_rate > 0 and any(part is p for p in self.parts):
            update_expert_bias(part, load)

    def reset(self) -> None:
        """Forget the terms of forwards that are not training (a validation pass)."""
        from am_moe import aux_loss_values

        for part in self.parts:
            aux_loss_values(part, reset=True)


__all__ = [
    "MoEBalance",
    "OPTION_FIELDS",
    "add_balancing_options",
    "balancing_json",
    "balancing_plan",
    "balancing_problems",
    "recipe_of",
]
