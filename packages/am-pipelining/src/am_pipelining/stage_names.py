"""Which modules each pipeline stage keeps: generated from a plan's layer split, or given explicitly and checked.

Generated lists put the embeddings and multimodal encoders on the first stage, contiguous decoder layers on every
stage, the final norm and the LM head on the last, and the rotary embedding (buffers only) on every stage; the
model's `customize_pipeline_stage_modules` hook may edit them (e.g. Nemotron adds `mtp` to the last stage). Explicit
lists (`module_names_per_stage`) are validated: every name exists, every decoder layer is in exactly one stage and in
order (`plan_pipeline`), every parameter is kept by exactly one stage, and the embeddings / encoders / norm / head /
rotary embedding sit where the forwards need them. A wrong list is an error naming the fix, never a different model
or a hang.

What it must not do: decide stage counts or layer splits (that is `planning`), or need a process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from .hf_utils import MULTIMODAL_SUFFIXES, statically_defines
from .layers import DecoderLayers, find_layers, module_at
from .planning import PipelinePlan, PipelinePlanError, plan_pipeline, split_layers

__all__ = ["generate_hf_model_fqn_per_model_part", "module_names_problems", "plan_for_model"]


def generate_hf_model_fqn_per_model_part(
    num_stages: int,
    num_layers: int,
    include_embeddings: bool = True,
    include_lm_head: bool = True,
    include_rotary_emb: bool = True,
    include_multimodal_encoders: bool = True,
    extra_module_fqns: Sequence[str] | None = None,
    fqn_prefix: str = "model.",
    lm_head_fqn: str = "lm_head",
) -> list[list[str]]:
    """Module names kept by each stage: contiguous layer ranges, the first `L % n` stages one layer longer.

    Stage 0 adds the embeddings, multimodal encoders and `extra_module_fqns`; the last stage adds `norm` and
    the LM head; `rotary_emb` (buffers only) is replicated on every stage. Names absent from a model are harmless.

    Raises:
        ValueError: fewer than 1 stage or more stages than layers.
    """
    options = include_embeddings, include_lm_head, include_rotary_emb, include_multimodal_encoders
    return _module_names_for_layers(
        split_layers(num_layers, num_stages), *options, extra_module_fqns, fqn_prefix, lm_head_fqn
    )


def _module_names_for_layers(
    stage_layers: Sequence[Sequence[int]],
    include_embeddings: bool,
    include_lm_head: bool,
    include_rotary_emb: bool,
    include_multimodal_encoders: bool,
    extra_module_fqns: Sequence[str] | None,
    fqn_prefix: str,
    lm_head_fqn: str,
) -> list[list[str]]:
    names_per_stage: list[list[str]] = []
    last = len(stage_layers) - 1
    for stage, layers in enumerate(stage_layers):
        names: list[str] = []
        if stage == 0:
            if include_embeddings:
                names.append(f"{fqn_prefix}embed_tokens")
            if include_multimodal_encoders:
                names.extend(f"{fqn_prefix}{suffix}" for suffix in MULTIMODAL_SUFFIXES)
            names.extend(extra_module_fqns or ())
        names.extend(f"{fqn_prefix}layers.{i}" for i in layers)
        if stage == last:
            names.append(f"{fqn_prefix}norm")
            if include_lm_head:
                names.append(lm_head_fqn)
        if include_rotary_emb:
            names.append(f"{fqn_prefix}rotary_emb")
        names_per_stage.append(names)
    return names_per_stage


def _default_module_names(model: Any, stage_layers: Sequence[Sequence[int]], layout: DecoderLayers) -> list[list[str]]:
    """Module names per stage for a plan's layer split, passed through the model's
    `customize_pipeline_stage_modules` hook."""
    names = _module_names_for_layers(
        stage_layers,
        include_embeddings=True,
        include_lm_head=layout.lm_head_fqn is not None,
        include_rotary_emb=layout.has_rotary_emb,
        include_multimodal_encoders=not layout.nested,
        extra_module_fqns=layout.extra_module_fqns,
        fqn_prefix=layout.layers_prefix,
        lm_head_fqn=layout.lm_head_fqn or "lm_head",
    )
    if statically_defines(model, "customize_pipeline_stage_modules"):
        customized = model.customize_pipeline_stage_modules(
            names, layers_prefix=layout.layers_prefix, text_model=layout.text_model
        )
        if customized is not None:
            names = [list(stage) for stage in customized]
    return names


def _stage_layers_from_names(names_per_stage: Sequence[Sequence[str]], layout: DecoderLayers) -> list[list[int]]:
    """The decoder layer indices each explicit stage list keeps (`<prefix>layers` keeps them all)."""
    container = layout.container_fqn
    all_layers = list(range(layout.num_layers))
    stage_layers = []
    for names in names_per_stage:
        layers: list[int] = []
        for name in names:
            if name == container:
                layers.extend(all_layers)
            elif _is_layer_name(name, container):
                layers.append(int(name[len(container) + 1 :]))
        stage_layers.append(layers)
    return stage_layers


def _is_layer_name(name: str, container: str) -> bool:
    return name.startswith(container + ".") and name[len(container) + 1 :].isdigit()


def _attribute_path_exists(model: nn.Module, fqn: str) -> bool:
    """True when every part of `fqn` is an attribute (the last may be None, e.g. an absent audio tower)."""
    obj: Any = model
    for part in fqn.split("."):
        if obj is None:
            return False
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return False
    return True


def _keeps(names: set[str], fqn: str) -> bool:
    """A stage keeps `fqn` when it names it or one of its ancestors (a kept module is kept whole)."""
    parts = fqn.split(".")
    return any(".".join(parts[:k]) in names for k in range(1, len(parts) + 1))


def _stages_keeping(stage_names: list[set[str]], fqn: str) -> list[int]:
    return [stage for stage, names in enumerate(stage_names) if _keeps(names, fqn)]


def _unkept_owner(fqn: str, stage_names: list[set[str]]) -> str:
    """The outermost module around `fqn` of which no stage keeps anything (what the user left out)."""
    everything = set().union(*stage_names)

    def anything_kept_inside(prefix: str) -> bool:
        return any(name == prefix or name.startswith(prefix + ".") for name in everything)

    module = fqn.rsplit(".", 1)[0] if "." in fqn else fqn
    while "." in module and not anything_kept_inside(module.rsplit(".", 1)[0]):
        module = module.rsplit(".", 1)[0]
    return module


def module_names_problems(
    model: nn.Module,
    layout: DecoderLayers,
    names_per_stage: Sequence[Sequence[str]],
    *,
    explicit: bool = True,
) -> list[str]:
    """Why `names_per_stage` would not run the model as one model (empty when it would).

    Decoder-layer coverage and order are `plan_pipeline`'s (see `plan_for_model`); this checks the rest:
    unknown names and partial layers (explicit lists only: generated lists name absent encoders on purpose), every
    parameter kept by exactly one stage, and the modules the forwards need on a given stage.
    """
    problems = []
    container = layout.container_fqn
    if explicit:
        unknown, partial = [], []
        for stage, names in enumerate(names_per_stage):
            for name in names:
                if name == container or _is_layer_name(name, container):
                    continue
                if name.startswith(container + "."):
                    partial.append(f"{name!r} (stage {stage})")
                elif not _attribute_path_exists(model, name):
                    unknown.append(f"{name!r} (stage {stage})")
        if unknown:
            problems.append(
                f"module_names_per_stage names modules that {type(model).__name__} does not have: "
                f"{', '.join(unknown)}. Fix the names (fully qualified, e.g. {layout.layer_fqn(0)!r}, "
                f"{layout.layers_prefix}norm, {layout.lm_head_fqn or 'lm_head'!r})."
            )
        if partial:
            problems.append(
                f"module_names_per_stage keeps part of a decoder layer: {', '.join(partial)}. A stage keeps whole "
                f"layers: name {container}.<index>."
            )
    stage_names = [set(names) for names in names_per_stage]
    missing: dict[str, None] = {}
    repeated: dict[str, list[int]] = {}
    for fqn, _ in model.named_parameters(remove_duplicate=False):
        if fqn.startswith(container + "."):
            continue  # decoder layers: plan_pipeline reports missing / repeated ones
        owners = _stages_keeping(stage_names, fqn)
        if not owners:
            missing[_unkept_owner(fqn, stage_names)] = None
        elif len(owners) > 1:
            repeated[fqn.rsplit(".", 1)[0]] = owners
    if missing:
        problems.append(
            f"module_names_per_stage leaves out {', '.join(repr(m) for m in missing)}: no stage keeps them, so they "
            "would not run and not train. Add each to the stage that runs it (embeddings and encoders: the first "
            "stage; final norm, LM head and extra heads such as MTP: the last stage)."
        )
    if repeated:
        shown = ", ".join(f"{module} (stages {owners})" for module, owners in repeated.items())
        problems.append(f"module_names_per_stage keeps modules in more than one stage: {shown}. Keep each in one.")
    problems += _placement_problems(model, layout, stage_names)
    return problems


def _placement_problems(model: nn.Module, layout: DecoderLayers, stage_names: list[set[str]]) -> list[str]:
    prefix, last = layout.layers_prefix, len(stage_names) - 1
    first_only = [f"{prefix}embed_tokens", *layout.extra_module_fqns]
    if not layout.nested:
        first_only += [f"{prefix}{suffix}" for suffix in MULTIMODAL_SUFFIXES]
    last_only = [f"{prefix}norm", *([layout.lm_head_fqn] if layout.lm_head_fqn else [])]
    problems = []
    for fqn, stage, where in [(f, 0, "first") for f in first_only] + [(f, last, "last") for f in last_only]:
        if module_at(model, fqn) is None:
            continue
        owners = _stages_keeping(stage_names, fqn)
        if owners and owners != [stage]:
            problems.append(
                f"{fqn!r} is in stage {owners} but the pipeline forwards run it on the {where} stage ({stage}): "
                "move it there."
            )
    rotary = f"{prefix}rotary_emb"
    if layout.has_rotary_emb and module_at(model, rotary) is not None:
        without = [s for s, names in enumerate(stage_names) if not _keeps(names, rotary)]
        if without:
            problems.append(
                f"stages {without} do not keep {rotary!r}: every stage computes its own rotary embeddings (buffers "
                "only, replicated). Add it to every stage."
            )
    return problems


def plan_for_model(
    model: nn.Module,
    pp_size: int,
    schedule: Any,
    module_names_per_stage: Sequence[Sequence[str]] | None = None,
    *,
    option_label: str = "module_names_per_stage",
    **plan_options: Any,
) -> PipelinePlan:
    """`plan_pipeline` for `model`'s decoder layers; with explicit stage lists, for the layers they hold, and the
    lists' own problems in the same single error.

    Raises:
        PipelinePlanError: every problem of the plan and of the lists.
    """
    layout = find_layers(model)
    if module_names_per_stage is None:
        return plan_pipeline(layout.num_layers, pp_size, schedule, **plan_options)
    problems = module_names_problems(model, layout, module_names_per_stage)
    try:
        plan = plan_pipeline(
            layout.num_layers,
            pp_size,
            schedule,
            stage_layers=_stage_layers_from_names(module_names_per_stage, layout),
            option_labels={"stage_layers": option_label},
            **plan_options,
        )
    except PipelinePlanError as exc:
        raise PipelinePlanError([*exc.problems, *problems]) from None
    if problems:
        raise PipelinePlanError(problems)
    return plan
