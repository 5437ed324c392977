"""Progress for the reference trainer: a rank-0 progress bar, a loss-curve PNG (training and validation loss) and the
run summary (summary.json's content, with the run plan).

What it must not do: print from ranks other than 0, or fail a run because matplotlib is missing (the curve is then
skipped with a note).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import RunConfig
    from trainer.loop import History
    from trainer.plan import RunPlan


class Progress:
    """Progress bar with step, loss, tokens/s and ETA on rank 0 (MoE models: the expert load imbalance, the worst
    layer's busiest expert over the mean; transformers MoE models: the router load-balancing loss apart); a no-op
    elsewhere."""

    def __init__(self, *, total_steps: int, start_step: int, tokens_per_step: int, enabled: bool) -> None:
        self.enabled = enabled
        self.tokens_per_step = tokens_per_step
        self.start_time = time.perf_counter()
        self.steps_done = 0
        self._bar = None
        self._val_loss: float | None = None
        if enabled:
            from tqdm import tqdm

            # A bar on a terminal; plain lines in CI logs (tqdm's mininterval keeps them few).
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=1.0 if sys.stderr.isatty() else 10.0,
            )

    def update(
        self,
        *,
        step: int,
        loss: float,
        lr: float,
        val_loss: float | None = None,
        expert_imbalance: float | None = None,
        aux_loss: float | None = None,
        skipped: int | None = None,
        moe_terms: dict[str, float] | None = None,
    ) -> None:
        """One optimizer step done; `val_loss` when this step validated (the bar keeps showing the latest);
        `expert_imbalance` for MoE models (max / mean tokens per expert, shown next to the loss); `aux_loss`: a
        transformers MoE model's router load-balancing loss (unscaled; `loss` includes its coef x it); `skipped`: the
        steps dropped so far for a non-finite loss or gradient norm (with `--skip-nonfinite-steps`; None: not shown);
        `moe_terms`: the am-moe balancing terms of the step (`moe_aux_loss`, `moe_seq_aux_loss`, `moe_z_loss`,
        coefficient-weighted; trainer/moe_balance.py), shown apart from `loss`."""
        self.steps_done += 1
        if val_loss is not None:
            self._val_loss = val_loss
        if self._bar is None:
            return
        # (value, format) in the bar's order; a value that is None is not shown
        shown: dict[str, tuple[Any, str]] = {"loss": (loss, ".4f"), "aux_loss": (aux_loss, ".4f")}
        shown |= {name: (value, ".3g") for name, value in (moe_terms or {}).items()}
        shown |= {"experts max/mean": (expert_imbalance, ".2f"), "val_loss": (self._val_loss, ".4f")}
        shown |= {"skipped": (skipped, "d"), "lr": (lr, ".2e"), "tok_s": (self.tokens_per_second(), ",.0f")}
        fields = {name: format(value, spec) for name, (value, spec) in shown.items() if value is not None}
        self._bar.set_postfix(fields, refresh=False)
        self._bar.update(1)

    def tokens_per_second(self) -> float:
        return self.steps_done * self.tokens_per_step / max(time.perf_counter() - self.start_time, 1e-9)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def save_loss_curve(
    losses: list[tuple[int, float]],
    path: Path,
    *,
    title: str,
    val_losses: list[tuple[int, float]] | None = None,
) -> Path | None:
    """Plot the training `(step, loss)` pairs, and the validation ones (`val_losses`, markers) when given, to a PNG;
    returns the path, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("loss curve skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    steps, values = zip(*losses, strict=True) if losses else ((), ())
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, values, lw=1.5, label="training")
    if val_losses:
        val_steps, val_values = zip(*val_losses, strict=True)
        ax.plot(val_steps, val_values, "o-", lw=1.5, label="validation (held out)")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def run_summary(
    cfg: RunConfig, plan: RunPlan, history: History, *, family: str, last_ckpt: Path | None
) -> dict[str, Any]:
    """summary.json's content (rank 0, after the last step): the model, the plan and its layout, the losses and
    histories, the feature options, throughput and the last checkpoint (the loss curve's path is added by the
    caller)."""
    from trainer.moe_balance import balancing_json
    from trainer.tb_logging import tensorboard_dir

    router = plan.router_aux
    losses, val_losses, aux = history.losses, history.val_losses, history.aux_losses
    balancing = plan.moe_balancing
    moe_terms = history.moe_terms if balancing is not None and balancing.has_loss_terms else None
    steps_run = cfg.steps - history.start_step
    return {
        "model": family,
        # tp joins the mesh (innermost) when > 1; the layout always records it
        "mesh": {"pp": plan.pp, "dp": plan.dp, "cp": plan.cp, "ep": plan.ep} | ({"tp": plan.tp} if plan.tp > 1 else {}),
        "layout": plan.layout(),
        "plan": plan.to_json(),  # every layout decision of the run, as validate() made it (trainer/plan.py)
        "schedule": plan.pipeline.schedule if plan.is_pipeline else None,
        "dtype": plan.dtype,
        # what --dtype meant: parameters / grads / AdamW state, forward-backward, FSDP2 reduction
        "precision": plan.precision.to_json(),
        "steps": cfg.steps,
        "resumed_from": history.start_step or None,
        "losses": [loss for _, loss, _ in losses],
        "grad_norms": [norm for _, _, norm in losses],
        "expert_imbalance": history.imbalances if plan.moe or router else None,
        # router models (pp = 1): the load-balancing loss per applied step, unscaled (as transformers' aux_loss);
        # `losses` include router_aux_loss_coef x it when the model's config adds it (`aux_loss_coef`)
        "aux_losses": aux if router else None,
        "final_aux_loss": aux[-1] if router and aux else None,
        "aux_loss_coef": router.coef if router else None,
        # am-moe routers (Nemotron-H, Gemma 4 MoE): the balancing the run applied (the model's recipe under the
        # --moe-* options) and its loss terms per applied step, coefficient-weighted, token-mean over the global
        # batch, apart from `losses` (whose gradient they add to)
        "moe_balancing": balancing_json(balancing),
        "moe_aux_losses": (
            {name: [terms[name] for terms in moe_terms] for name in moe_terms[0]} if moe_terms else None
        ),
        "first_loss": losses[0][1] if losses else None,
        "final_loss": losses[-1][1] if losses else None,
        "val_losses": [list(entry) for entry in val_losses],  # [step, validation loss]
        "final_val_loss": val_losses[-1][1] if val_losses else None,
        # steps whose update was dropped for a non-finite loss or gradient norm (--skip-nonfinite-steps)
        "skipped_steps": history.guard.skipped,
        "skip_nonfinite_steps": cfg.skip_nonfinite_steps,
        "optimizer": cfg.optimizer,
        "lr_schedule": cfg.lr_schedule,
        "activation_checkpointing": cfg.activation_checkpointing,
        "compile": cfg.compile,
        "attn_implementation": plan.attn_implementation,  # "sdpa" where the model supports it, else e.g. "eager"
        "fsdp_groups": plan.fsdp_grouping if plan.fsdp else None,
        "tensorboard": str(folder) if (folder := tensorboard_dir(cfg)) else None,
        "tokens_per_s": steps_run * plan.global_batch * plan.seq_len / max(history.wall_s, 1e-9),
        "wall_s": history.wall_s,
        "checkpoint": str(last_ckpt) if last_ckpt else None,
    }
