"""Everything the reference trainer checks before any process group exists: one message, exit code 2; then the plan.

What it is for: `validate(cfg, world_size=...)` runs on every rank before `init_process_group`, so a run that
cannot go ends on every rank with the same message listing every problem: the arguments (`config.find_problems`),
the `--out` folder (writable; holds no checkpoints unless `--resume` or `--overwrite`), the model (a preset built on
the meta device, without weights; an HF folder loaded, and it must supply every tensor), the pipeline plan against
its layers (am-pipelining; a model whose decoder layers cannot be found is refused only for the features that need
them: --pp > 1, --activation-checkpointing, --compile), the expert-parallel plan (am-moe), the mesh against its
capabilities (am-capabilities), what the model cannot honour under `--cp` (its `cp_problems` hook, through
am-context-parallel), a NaN / inf tensor in a `--model-path` folder (tensor and file named; one process here, an
N-rank job right after its process group, each rank reading 1 / N of the files), the data and the
checkpoint to resume (sha256 manifest; the layout, model and data options must match, while the optimizer's numbers
and `--steps` may change: `resume_changes` words the warnings the loop prints); and for the training features: the
tokenizer against the model's vocabulary, the held-out data, activation checkpointing against the model's
capabilities, and a pipeline schedule that can evaluate. Then it makes the run plan (trainer/plan.py), once.
What it must not do: touch torch.distributed, or decide a rule that another module owns (it asks them).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from trainer import checkpoint as ckpt
from trainer.config import (
    PRESET_HIDDEN_SIZE,
    PRESET_LAYERS,
    REAL_SIZE_MODELS,
    RunConfig,
    cp_problems,
    expert_parallel_plan,
    find_problems,
    mesh_context,
    pipeline_plan,
)
from trainer.data import Corpus, load_tokens
from trainer.guards import model_path_nonfinite_problems
from trainer.models import ModelSpec, build_meta_model, folder_spec, model_path_weight_problems, preset_spec
from trainer.moe_balance import balancing_plan, balancing_problems
from trainer.parallel import decoder_layers, layer_feature_problems, model_cp_layout
from trainer.plan import ValidatedRun, make_plan
from trainer.tensor_parallel import tensor_parallel_plan, tensor_parallel_problems

EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """Raised before any collective when the run cannot start; its message lists every problem."""


def model_spec(cfg: RunConfig, *, vocab_size: int | None = None) -> ModelSpec:
    if cfg.model_path is not None:
        from trainer.dry_run import has_weights

        # config.json alone: the dry run needs no weights
        return folder_spec(cfg.model_path, config_only=cfg.dry_run and not has_weights(cfg.model_path))
    return preset_spec(
        cfg.model,
        hidden_size=cfg.hidden_size if cfg.hidden_size is not None else PRESET_HIDDEN_SIZE,
        num_layers=cfg.layers if cfg.layers is not None else PRESET_LAYERS,
        mtp_depths=cfg.mtp_depths,
        tie_embeddings=cfg.tie_embeddings,
        vocab_size=vocab_size,
        fsdp_optimizations=cfg.fsdp_optimizations,
    )


def out_problems(cfg: RunConfig) -> list[str]:
    """`--out` must be writable now (not only at the first checkpoint), and a fresh run must not overwrite the
    checkpoints of another run unless `--overwrite` says so."""
    problems = ckpt.out_dir_problems(cfg.out)
    found = ckpt.existing_checkpoints(cfg.out)
    if found and cfg.resume is None and not cfg.overwrite:
        problems.append(
            f"--out {cfg.out} already holds checkpoints ({', '.join(found)}): continue that run with "
            "--resume latest, choose another --out, or pass --overwrite to delete them"
        )
    return problems


def _read_tokens(
    cfg: RunConfig, source: str | None, *, label: str, vocab_size: int, tokenizer: Any
) -> tuple[torch.Tensor | None, list[str]]:
    try:
        tokens = load_tokens(
            source,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            data_field=cfg.data_field,
            data_split=cfg.data_split,
            label=label,
        )
    except (FileNotFoundError, ValueError) as exc:
        return None, [str(exc)]
    except OSError as exc:
        return None, [f"{label} {source}: cannot read it ({exc.strerror or exc})"]
    return tokens, []


def data_problems(cfg: RunConfig, *, vocab_size: int, tokenizer: Any = None) -> tuple[Corpus | None, list[str]]:
    """(corpus, problems) of `--data` (and the held-out `--val-fraction` / `--val-data`): readable, decodable,
    non-empty, in the vocabulary, long enough for training windows and for `--val-batches` validation batches."""
    from trainer.evaluation import split_validation, validation_windows_needed

    tokens, problems = _read_tokens(cfg, cfg.data, label="--data", vocab_size=vocab_size, tokenizer=tokenizer)
    if tokens is None:
        return None, problems
    val = None
    if cfg.val_every > 0 and cfg.val_data is not None:
        val, problems = _read_tokens(cfg, cfg.val_data, label="--val-data", vocab_size=vocab_size, tokenizer=tokenizer)
    elif cfg.val_every > 0 and cfg.val_fraction is not None and 0 < cfg.val_fraction < 1:
        tokens, val = split_validation(tokens, fraction=cfg.val_fraction)
    if tokens.numel() < cfg.seq_len + 2:
        held = " after holding out --val-fraction" if cfg.val_fraction is not None and val is not None else ""
        problems.append(
            f"--data has {tokens.numel()} tokens{held}, too few for --seq-len {cfg.seq_len} (needs seq-len + 2)"
        )
    if val is not None and val.numel() < validation_windows_needed(cfg):
        source = f"--val-data {cfg.val_data}" if cfg.val_data is not None else f"--val-fraction {cfg.val_fraction}"
        problems.append(
            f"{source} holds {val.numel()} validation tokens, but --val-batches {cfg.val_batches} x --global-batch "
            f"{cfg.global_batch} windows of --seq-len {cfg.seq_len} need {validation_windows_needed(cfg)}; hold out "
            "more data or lower --val-batches"
        )
    return Corpus(train=tokens, val=val), problems


def tokenizer_problems(cfg: RunConfig) -> tuple[Any, list[str]]:
    """(tokenizer or None for the byte tokenizer, problems) of `--tokenizer`."""
    from trainer.text_sources import load_tokenizer

    if cfg.tokenizer is None:
        return None, []
    try:
        return load_tokenizer(cfg.tokenizer), []
    except ValueError as exc:
        return None, [str(exc)]


def vocab_problems(cfg: RunConfig, *, tokenizer: Any, spec: ModelSpec | None) -> list[str]:
    """The tokenizer's ids must fit the model's embedding (presets are built with the tokenizer's size). An HF
    tokenizer's `len` counts the ids it can produce: its base vocabulary plus added tokens."""
    if tokenizer is None or spec is None or len(tokenizer) <= spec.vocab_size:
        return []
    return [
        f"--tokenizer {cfg.tokenizer} has {len(tokenizer)} tokens but the model's vocabulary has "
        f"{spec.vocab_size} entries: give a tokenizer of at most {spec.vocab_size} tokens or a model that matches it"
    ]


def model_cp_limits(cfg: RunConfig, model: nn.Module) -> list[str]:
    """What the model declares it cannot honour under `--cp` with `--seq-len` (am-context-parallel's
    `model_cp_problems`: the model's `cp_problems` hook, e.g. a shard shorter than a Mamba conv halo, attention
    dropout under the ring). The model's forward checks the same again, as the last line of defence."""
    from am_context_parallel import cp_attention_problems, model_cp_problems

    try:
        found = model_cp_problems(model, seq_len=cfg.seq_len, cp_size=cfg.cp)
    except (TypeError, ValueError) as exc:  # a malformed hook or CP declaration on the model
        return [str(exc)]
    limits = [f"--cp {cfg.cp} with --seq-len {cfg.seq_len}: {type(model).__name__}: {problem}" for problem in found]
    # What keeps the ring from some attention of the model (am-context-parallel's structural rule: a block that
    # calls attention itself, an unroutable attn_implementation, soft-capping, attention dropout), known up front.
    return limits + [f"--cp {cfg.cp}: {problem}" for problem in cp_attention_problems(model)]


def model_pp_limits(cfg: RunConfig, model: nn.Module) -> list[str]:
    """What keeps am-pipelining's stage forwards from reproducing the model's own forward (its
    `forward_reproduction_problems`, which the stage split would raise after the process group exists)."""
    from am_pipelining import forward_reproduction_problems

    return [f"--pp {cfg.pp}: {type(model).__name__}: {problem}" for problem in forward_reproduction_problems(model)]


def validate(cfg: RunConfig, *, world_size: int) -> ValidatedRun:
    """Everything checkable without a process group, and the run plan made from it (trainer/plan.py).

    Returns:
        ValidatedRun: the frozen `RunPlan` (the only layout the build and step functions read), the model spec, the
        model the checks ran on (a preset: on the meta device, no weights; a `--model-path` folder: loaded, fp32),
        the corpus (training and held-out tokens), and the resume folder or None.

    Raises:
        BadInput: listing every problem found (arguments, --out, the model and its folder, the pipeline plan
            against the model's layers, mesh vs model capabilities, data, checkpoint).
    """
    from am_capabilities import validate_for_mesh
    from trainer.step_parts import router_aux_spec

    problems = find_problems(cfg, world_size=world_size)
    problems += out_problems(cfg)
    tokenizer, found = tokenizer_problems(cfg)
    problems += found
    tokenizer_vocab = len(tokenizer) if tokenizer is not None else None  # its base vocabulary plus added tokens
    spec = model = None
    # a --model-path folder without safetensors weights: said once, in its own words, and nothing to build from
    # (the dry run reads only config.json: it needs no weights)
    weights = model_path_weight_problems(cfg.model_path) if cfg.model_path is not None and not cfg.dry_run else []
    problems += weights
    try:
        if not weights:
            spec = model_spec(cfg, vocab_size=tokenizer_vocab)
            # On the meta device (no weights: a rank never holds a whole model); a folder's names and shapes are
            # checked strictly on its safetensors headers (every tensor present, none unexpected), no data read.
            model = build_meta_model(spec)
    except Exception as exc:  # a broken --model-path folder or preset: report it with the rest
        problems.append(f"cannot build the model: {type(exc).__name__}: {exc}")
    # NaN / inf in a --model-path folder's tensors: one process checks every tensor here; N ranks share the check
    # right after the process group (the loop's `refuse_nonfinite_weights`), each reading 1 / N of the files
    if model is not None and world_size == 1 and cfg.model_path is not None:
        problems += model_path_nonfinite_problems(cfg.model_path)
    num_layers = None
    if model is not None:  # only the per-layer features need the layers (pp > 1, checkpointing, compile)
        layers = decoder_layers(model)
        num_layers = layers.num_layers if layers is not None else None
        problems += layer_feature_problems(model, cfg)
    pipeline, found = pipeline_plan(cfg, num_layers=num_layers)
    problems += found
    expert_parallel, found = expert_parallel_plan(cfg)
    problems += found
    cp_layout, pad_multiple = None, 2
    if model is not None and cfg.cp > 1:
        try:
            cp_layout, pad_multiple = model_cp_layout(model)
        except (TypeError, ValueError) as exc:  # a malformed CP declaration on the model
            problems.append(str(exc))
    problems += cp_problems(cfg, cp_layout=cp_layout, pad_multiple=pad_multiple)
    if model is not None and cfg.cp > 1:
        problems += model_cp_limits(cfg, model)
    if model is not None and cfg.pp > 1 and num_layers is not None:
        problems += model_pp_limits(cfg, model)
    if model is not None and min(cfg.pp, cfg.dp, cfg.cp, cfg.ep) >= 1:
        try:  # ep > 1: the model must implement EP and its expert counts must split over ep (am-capabilities' rule)
            validate_for_mesh(model, mesh_context(cfg))
        except ValueError as exc:
            problems.extend(line.strip().removeprefix("- ") for line in str(exc).splitlines()[1:] if line.strip())
    if model is not None and min(cfg.tp, cfg.cp) >= 1:  # --tp: the plan, its sizes, what TP does not compose with
        problems += tensor_parallel_problems(cfg, model)
    problems += vocab_problems(cfg, tokenizer=tokenizer, spec=spec)
    router_aux = router_aux_spec(model) if model is not None else None
    problems += _feature_model_problems(cfg, model=model, plan=pipeline)
    problems += balancing_problems(cfg, model)  # the --moe-* options: numbers, and against the model's routers
    problems += fsdp_optimization_problems(cfg, model)
    vocab = spec.vocab_size if spec is not None else (tokenizer_vocab or 256)
    tokens, found = data_problems(cfg, vocab_size=vocab, tokenizer=tokenizer)
    problems += found
    resume_dir = None
    if cfg.resume is not None:
        try:
            resume_dir = ckpt.resolve_resume_dir(cfg.resume, cfg.out)
            found = ckpt.verify_checkpoint(resume_dir)
            problems += found
            if not found:
                problems += _resume_mismatches(cfg, ckpt.read_trainer_state(resume_dir))
        except FileNotFoundError as exc:
            problems.append(str(exc))
    if problems:
        raise refusal(problems)
    assert spec is not None
    assert model is not None
    assert tokens is not None
    plan = make_plan(
        cfg,
        model,
        pipeline=pipeline,
        expert_parallel=expert_parallel,
        cp_layout=cp_layout,
        pad_multiple=pad_multiple,
        num_layers=num_layers,
        router_aux=router_aux,
        tensor_parallel=tensor_parallel_plan(cfg, model),
        moe_balancing=balancing_plan(cfg, model),
    )
    return ValidatedRun(plan=plan, spec=spec, model=model, corpus=tokens, resume_dir=resume_dir)


_MUST_MATCH_ON_RESUME = (
    "model", "model_path", "pp", "dp", "cp", "schedule", "stages_per_rank", "global_batch", "microbatch_size",
    "seq_len", "dtype", "seed", "data", "tie_embeddings", "mtp_depths", "hidden_size", "layers",
)  # fmt: skip
# The options added later that change the layout, the token stream, the optimizer state or the schedule (checkpoints
# written before these options existed hold none of them, which reads as their defaults).
_FEATURES_MUST_MATCH_ON_RESUME = {
    "ep": 1, "tp": 1, "sequence_parallel": False, "tokenizer": None, "data_field": None, "data_split": None,
    "val_fraction": None, "optimizer": "adamw", "lr_schedule": "cosine", "moe_bias_update_rate": None,
    "moe_aux_loss_coeff": None, "moe_seq_aux_loss_coeff": None, "moe_z_loss_coeff": None,
}  # fmt: skip


# Options a resumed run may change: each change is recorded (the new checkpoints hold the new values) and named in a
# warning on rank 0, since it changes the run from the resumed step on (the LR schedule, clipping, decay, length).
_MAY_CHANGE_ON_RESUME = (
    "steps", "lr", "min_lr", "warmup_steps", "weight_decay", "adam_eps", "grad_clip", "momentum",
    "skip_nonfinite_steps",
)  # fmt: skip
# Saved before --hidden-size / --layers defaulted to None: the presets' sizes.
_SIZE_DEFAULTS = {"hidden_size": PRESET_HIDDEN_SIZE, "layers": PRESET_LAYERS}


def fsdp_optimization_problems(cfg: RunConfig, model: nn.Module | None) -> list[str]:
    """`--fsdp-optimizations` (BackendConfig.enable_fsdp_optimizations) where it has something to do: an am-models
    preset (its backend carries the field; its hooks defer the sync), pp 1 (the pipeline schedules already reduce
    once per step, and the hooks are no-ops there) and FSDP2 (dp x cp > 1, or mixed precision)."""
    from trainer.plan import PRECISIONS, uses_fsdp

    if not cfg.fsdp_optimizations:
        return []
    problems = []
    if cfg.model_path is not None or cfg.model not in ("nemotron", "gemma4", "gemma4-moe", *REAL_SIZE_MODELS):
        problems.append(
            "--fsdp-optimizations sets BackendConfig.enable_fsdp_optimizations of an am-models preset (nemotron, "
            f"gemma4, gemma4-moe, the published configurations), not of {cfg.model_path or cfg.model!r}; drop it"
        )
    elif model is not None and not callable(getattr(model, "prepare_for_grad_accumulation", None)):
        problems.append(f"--fsdp-optimizations: {type(model).__name__} has no prepare_for_grad_accumulation hook")
    if cfg.pp > 1:
        problems.append(
            "--fsdp-optimizations defers FSDP2's reduce-scatter to the last microbatch, which the pipeline schedules "
            f"already do at --pp {cfg.pp} (upstream's hooks are no-ops there); drop it or use --pp 1"
        )
    if cfg.dtype in PRECISIONS and not uses_fsdp(PRECISIONS[cfg.dtype], dp=cfg.dp, cp=cfg.cp):
        problems.append(
            f"--fsdp-optimizations defers FSDP2's reduce-scatter, but this run has no FSDP2 (dp x cp = "
            f"{cfg.dp * cfg.cp}, --dtype {cfg.dtype}); drop it or shard over --dp / --cp"
        )
    return problems


def refusal(problems: list[str]) -> BadInput:
    """The one message of a refused run: every problem, listed."""
    listed = "\n".join(f"  - {p}" for p in problems)
    return BadInput(f"refusing to start ({len(problems)} problem{'s' * (len(problems) > 1)}):\n{listed}")


def resume_changes(cfg: RunConfig, state: dict[str, Any]) -> list[str]:
    """Warnings for the options in `_MAY_CHANGE_ON_RESUME` that differ from the checkpoint's (an empty list: none)."""
    saved = state.get("args", {})
    now = json.loads(json.dumps(asdict(cfg), default=str))
    return [
        f"--resume {cfg.resume}: {key} changes from {saved[key]!r} (the checkpoint's run) to {now[key]!r}; the run "
        f"continues with {now[key]!r} from step {int(state.get('step', 0)) + 1} on, and its checkpoints record it"
        for key in _MAY_CHANGE_ON_RESUME
        if key in saved and saved[key] != now[key]
    ]


def _feature_model_problems(cfg: RunConfig, *, model: nn.Module | None, plan: Any) -> list[str]:
    """Feature options against the model and the pipeline: activation checkpointing (am-capabilities' rule), a
    schedule that can evaluate (`--val-every` at pp > 1), and a transformers MoE model whose training objective
    includes a router loss the trainer cannot reproduce (`router_aux_problems`): refused rather than dropping the
    term. (Transformers' own load-balancing loss runs in every layout: step_parts.RouterAuxLoss at pp 1,
    trainer/router_aux_pipeline.py at pp > 1.)"""
    from trainer.evaluation import pipeline_eval_problems
    from trainer.layer_wrappers import activation_checkpointing_problems
    from trainer.step_parts import router_aux_problems

    problems = pipeline_eval_problems(cfg, plan) + (router_aux_problems(model) if model is not None else [])
    if cfg.activation_checkpointing and model is not None and min(cfg.pp, cfg.dp, cfg.cp, cfg.ep) >= 1:
        problems += activation_checkpointing_problems(model, mesh=mesh_context(cfg), compile=cfg.compile)
    return problems


def _resume_mismatches(cfg: RunConfig, state: dict[str, Any]) -> list[str]:
    saved = state.get("args", {})
    now = json.loads(json.dumps(asdict(cfg), default=str))
    expected = {key: saved.get(key) for key in _MUST_MATCH_ON_RESUME}
    expected |= {key: saved.get(key, default) for key, default in _FEATURES_MUST_MATCH_ON_RESUME.items()}
    if cfg.model_path is None:  # a preset's size given or defaulted is the same size
        for key, default in _SIZE_DEFAULTS.items():
            expected[key] = default if expected[key] is None else expected[key]
            now[key] = default if now[key] is None else now[key]
    else:  # a --model-path run has no preset size (older checkpoints recorded the unused defaults)
        for key in _SIZE_DEFAULTS:
            expected[key] = now[key] = None
    return [
        f"--resume {cfg.resume}: the checkpoint was written with {key}={value!r}, this run has "
        f"{key}={now[key]!r}; resume with the same value"
        for key, value in expected.items()
        if value != now[key]
    ]


__all__ = [
    "EXIT_BAD_INPUT",
    "BadInput",
    "data_problems",
    "model_spec",
    "out_problems",
    "resume_changes",
    "validate",
]
