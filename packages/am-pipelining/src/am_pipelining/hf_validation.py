"""Whether an HF model can run under pipeline parallelism: one error listing every blocker with its fix.

`validate_hf_model_for_pipeline_support` (the upstream entry point, also importable from `hf_utils`) and
`check_forward_reproduction` (called by `split_model_into_stages` and `build_stage_modules` before any stage is
built) share `forward_reproduction_problems`: the forwards `patch_hf_model_for_pp` would bind are resolved the same
way as for patching, and `hf_transforms` says what they cannot reproduce.

Never imports a model package of this repository; never builds stages or touches a process group.
"""

from __future__ import annotations

from torch import nn

from ._compat import is_reentrant_checkpoint_wrapper
from .hf_transforms import _text_config, pipeline_forward_problems
from .hf_utils import (
    PIPELINE_FORWARDS,
    _config_of,
    _forward_plan,
    _is_vlm,
    _model_type,
    _pipeline_forward_for,
    model_keeps_self_forward,
)

__all__ = ["forward_reproduction_problems", "check_forward_reproduction", "validate_hf_model_for_pipeline_support"]


def forward_reproduction_problems(model: nn.Module) -> list[str]:
    """Every reason the pipeline forwards `patch_hf_model_for_pp` would bind cannot reproduce `model`'s own forward
    (unsupported forward-level config features, modules the generic forwards would skip); empty when they can or
    when the model keeps its own forward (`model_keeps_self_forward`). See `hf_transforms`."""
    if model_keeps_self_forward(model):
        return []
    plan = _forward_plan(model)
    return pipeline_forward_problems(
        model,
        text_module=plan.text_module,
        text_name=plan.text_name,
        generic_text=plan.text_factory is None,
        generic_outer=plan.has_outer and plan.outer_factory is None,
    )


def _reentrant_checkpointing_problem(model: nn.Module) -> str | None:
    """Why `model`'s activation checkpointing breaks the stage backward: the modules that run reentrant
    checkpointing (torch wrapper or HF's setting) and the fix; None when none does."""
    found = []
    for name, module in model.named_modules():
        # HF's setting: `gradient_checkpointing` with a `functools.partial(checkpoint, use_reentrant=True)`
        hf_keywords = getattr(module.__dict__.get("_gradient_checkpointing_func"), "keywords", None) or {}
        hf_reentrant = getattr(module, "gradient_checkpointing", False) is True and hf_keywords.get("use_reentrant")
        if is_reentrant_checkpoint_wrapper(module) or hf_reentrant is True:
            found.append(name or "<root>")
    if not found:
        return None
    shown = ", ".join(found[:4]) + (" ..." if len(found) > 4 else "")
    return (
        f"Reentrant activation checkpointing is enabled on {shown}: the stage backward calls torch.autograd.grad on "
        "stage inputs, which reentrant checkpointing does not support (the backward of stages 1..N-1 fails or "
        "hangs). Fix: use `use_reentrant=False` (HF: activation_checkpointing_enable(activation_checkpointing_kwargs="
        "{'use_reentrant': False}); torch: checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.NO_REENTRANT))."
    )


def check_forward_reproduction(model: nn.Module) -> None:
    """Raise one ValueError listing `forward_reproduction_problems(model)`, if any (before any stage is built)."""
    problems = forward_reproduction_problems(model)
    if problems:
        listed = "\n".join(f"{i}. {problem}" for i, problem in enumerate(problems, start=1))
        raise ValueError(f"The pipeline forwards cannot reproduce {type(model).__name__}'s own forward:\n{listed}")


def validate_hf_model_for_pipeline_support(model: nn.Module) -> None:
    """Raise one ValueError listing every reason `model` cannot run under pipeline parallelism, with the fix.

    Tied input/output embeddings are supported (the last stage keeps a copy whose gradient is summed with the
    first stage's, see `am_pipelining.tied`), so they are not rejected. Rejected: encoder-decoder models; VLMs
    without a pipeline-aware forward; Gemma 4 per-layer inputs (PLE) and cross-layer KV sharing, which need data
    no stage receives; forward-level features the pipeline forwards do not reproduce and modules they would skip
    (`forward_reproduction_problems`, naming each); reentrant activation checkpointing, which breaks the stage
    backward.
    """
    issues: list[str] = []
    config = _config_of(model)
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None) or type(model).__name__
    if config is not None:
        if getattr(config, "is_encoder_decoder", False):
            issues.append(
                "Encoder-Decoder models with cross-attention are not supported yet for pipeline parallelism: the "
                "decoder stages would need the encoder output. Train it with FSDP2/TP instead."
            )
        entry = _pipeline_forward_for(model)
        if _is_vlm(model) and not model_keeps_self_forward(model) and not (entry is not None and entry.multimodal):
            aware = ", ".join(sorted(t for t, e in PIPELINE_FORWARDS.items() if e.multimodal))
            issues.append(
                f"{type(model).__name__} (model_type={_model_type(config)!r}) is a multimodal model that is not on the "
                f"pipeline-aware list ({aware}): images would never reach its vision tower. Fix: register its "
                "forwards with `register_pipeline_forward(model_type, outer_forward=..., multimodal=True)`, or give "
                "the class a PP-aware forward and declare it (`am_contract()` with "
                "`PipelineContract(keeps_own_forward=True)`), or train it without PP."
            )
        text_config = _text_config(config)
        if getattr(text_config, "hidden_size_per_layer_input", 0):
            issues.append(
                "Gemma 4 per-layer inputs (hidden_size_per_layer_input="
                f"{text_config.hidden_size_per_layer_input}) need the token ids on every stage, but only hidden "
                "states travel between stages. Fix: use a variant without per-layer inputs (not the E-series) or pp=1."
            )
        if getattr(text_config, "num_kv_shared_layers", 0):
            issues.append(
                f"num_kv_shared_layers={text_config.num_kv_shared_layers}: layers that reuse another layer's keys and "
                "values cannot be placed on a different stage from it. Fix: use a variant without KV sharing or pp=1."
            )
        issues.extend(forward_reproduction_problems(model))
    reentrant = _reentrant_checkpointing_problem(model)
    if reentrant is not None:
        issues.append(reentrant)
    if issues:
        numbered = "\n".join(f"{i}. {issue}" for i, issue in enumerate(issues, start=1))
        raise ValueError(f"Model '{name}' is not compatible with pipeline parallelism:\n\n{numbered}")
