"""Pipeline parallelism for HuggingFace-style models on torch.distributed.pipelining.

Plan once (`plan_pipeline` / `plan_for_model` -> `PipelinePlan`), then build this rank's stages (`build_stages`) and
their schedule (`build_schedule`) from the plan: stages by construction (no tracing, no full copy per stage), loop
or V placement, any torch schedule, the pipeline loss (with multi-token prediction), tied embeddings kept correct,
and a picture of the schedule with its bubble fraction. The names NeMo AutoModel documents (`AutoPipeline`,
`pipeline_model`, `split_model_into_stages`, `build_pipeline_schedule`, ...) are here too, as thin layers over that
core; upstream's private helper names are in `am_pipelining.upstream`.
"""

from ._version import __version__
from .autopipeline import AutoPipeline, PipelineConfig, PipelineInfo
from .hf_transforms import (
    FORWARD_TRANSFORMS,
    LAYER_LEVEL_CONFIG_KEYS,
    UNSUPPORTED_FORWARD_FEATURES,
    ForwardTransform,
)
from .hf_utils import (
    MULTIMODAL_SUFFIXES,
    PIPELINE_FORWARDS,
    TEXT_MODULE_ATTRS,
    check_forward_reproduction,
    create_pipeline_forward_causal_lm,
    create_pipeline_forward_gemma4_text,
    create_pipeline_forward_gemma4_vlm,
    create_pipeline_forward_inner,
    create_pipeline_forward_mistral3_vlm,
    forward_reproduction_problems,
    get_text_module,
    init_hf_model_buffers,
    model_keeps_self_forward,
    patch_hf_model_for_pp,
    register_pipeline_forward,
    validate_hf_model_for_pipeline_support,
)
from .layers import DecoderLayers, find_layers
from .loss import (
    MTPLossConfig,
    MTPLossOutput,
    PipelineCausalLMLoss,
    calculate_mtp_loss,
    get_mtp_loss_scaling_factor,
    roll_tensor,
    shift_packed_tensor,
)
from .outputs import StageOutput, read_stage_output
from .planning import (
    PipelinePlan,
    PipelinePlanError,
    calculate_virtual_stages,
    plan_pipeline,
    stage_ids_this_rank,
)
from .schedule_picture import (
    ScheduleTimeline,
    render_svg,
    render_text,
    save_schedule_picture,
    schedule_timeline,
    textbook_bubble_fraction,
)
from .schedules import (
    ParallelizeFnProtocol,
    build_pipeline_schedule,
    build_schedule,
    pipeline_model,
    reset_pp_stage_shapes,
    scale_grads_by_divisor,
)
from .stage_modules import build_stage_modules, stage_metas
from .stage_names import generate_hf_model_fqn_per_model_part, plan_for_model
from .stages import build_stages, split_model_into_stages
from .tied import sync_tied_embedding_grads, sync_tied_embedding_weights

__all__ = [
    # the core: plan once, then stages and schedule from the plan
    "plan_pipeline",
    "plan_for_model",
    "PipelinePlan",
    "PipelinePlanError",
    "build_stages",
    "build_schedule",
    "build_stage_modules",
    "stage_metas",
    # upstream's documented spellings, built on the core
    "AutoPipeline",
    "PipelineConfig",
    "PipelineInfo",
    "pipeline_model",
    "ParallelizeFnProtocol",
    "split_model_into_stages",
    "build_pipeline_schedule",
    "reset_pp_stage_shapes",
    "scale_grads_by_divisor",
    "stage_ids_this_rank",
    "generate_hf_model_fqn_per_model_part",
    "calculate_virtual_stages",
    # where the layers live
    "find_layers",
    "DecoderLayers",
    # HF forwards
    "TEXT_MODULE_ATTRS",
    "MULTIMODAL_SUFFIXES",
    "get_text_module",
    "create_pipeline_forward_inner",
    "create_pipeline_forward_causal_lm",
    "create_pipeline_forward_gemma4_text",
    "create_pipeline_forward_gemma4_vlm",
    "create_pipeline_forward_mistral3_vlm",
    "patch_hf_model_for_pp",
    "PIPELINE_FORWARDS",
    "register_pipeline_forward",
    "init_hf_model_buffers",
    "model_keeps_self_forward",
    "validate_hf_model_for_pipeline_support",
    "forward_reproduction_problems",
    "check_forward_reproduction",
    # what the model's own forward does around its layers
    "ForwardTransform",
    "FORWARD_TRANSFORMS",
    "LAYER_LEVEL_CONFIG_KEYS",
    "UNSUPPORTED_FORWARD_FEATURES",
    # loss
    "PipelineCausalLMLoss",
    "MTPLossConfig",
    "MTPLossOutput",
    "calculate_mtp_loss",
    "get_mtp_loss_scaling_factor",
    "roll_tensor",
    "shift_packed_tensor",
    # what the last stage returns
    "StageOutput",
    "read_stage_output",
    # tied embeddings
    "sync_tied_embedding_grads",
    "sync_tied_embedding_weights",
    # schedule picture
    "ScheduleTimeline",
    "schedule_timeline",
    "textbook_bubble_fraction",
    "render_text",
    "render_svg",
    "save_schedule_picture",
    "__version__",
]
