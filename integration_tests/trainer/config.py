"""Command-line options of the reference trainer and their validation, which runs before any collective.

What it must not do: touch torch.distributed, or re-derive a pipeline rule: schedule, stage, layer-split and
microbatch rules are am-pipelining's `plan_pipeline` (`pipeline_plan` below asks it, in CLI terms). Every rank
validates the same arguments the same way, so a bad run ends on every rank with the same message, listing every
problem at once, before a process group exists.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The published configurations (the model packages' presets, config only): built on the meta device, for the dry
# run and for GPU machines; never materialized by a test on the CPU.
REAL_SIZE_MODELS = ("nemotron-3-nano-30b-a3b", "gemma4-26b-a4b", "gemma4-31b")
MODELS = ("nemotron", "gemma4", "gemma4-moe", "llama", *REAL_SIZE_MODELS)
DTYPE_CHOICES = ("bf16", "bf16-pure", "fp32")  # their meaning: plan.PRECISIONS
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "runs" / "default"  # integration_tests/runs/ is git-ignored
# The presets' size when --hidden-size / --layers are not given (the options are None then, so that a --model-path
# run, whose size its config.json sets, can refuse them when they are given).
PRESET_HIDDEN_SIZE = 64
PRESET_LAYERS = 4


@dataclass(frozen=True)
class RunConfig:
    """Parsed options; see `build_parser` for their meaning."""

    model: str
    model_path: str | None
    pp: int
    dp: int
    cp: int
    ep: int
    schedule: str
    stages_per_rank: int
    global_batch: int
    microbatch_size: int
    seq_len: int
    steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    adam_eps: float
    grad_clip: float
    dtype: str
    seed: int
    data: str | None
    out: Path
    ckpt_every: int
    resume: str | None
    overwrite: bool
    tie_embeddings: bool
    mtp_depths: int
    hidden_size: int | None  # None: PRESET_HIDDEN_SIZE (presets only; refused with --model-path)
    layers: int | None  # None: PRESET_LAYERS (presets only; refused with --model-path)
    threads: int
    timeout: float
    progress: bool
    # --- training features (issue 16 §5): config file, tokenizer, data sources, validation, logging, layers, optim
    config: str | None = None
    tokenizer: str | None = None
    data_field: str | None = None
    data_split: str | None = None
    val_every: int = 0
    val_fraction: float | None = None
    val_data: str | None = None
    val_batches: int = 2
    tensorboard: str | None = None
    activation_checkpointing: bool = False
    compile: bool = False
    optimizer: str = "adamw"
    momentum: float | None = None
    lr_schedule: str = "cosine"
    hf_shard_size: str = "5GB"  # issue 23 (d): the HF export's safetensors file budget (trainer/export.py)
    skip_nonfinite_steps: int = 0  # issue 22: at most this many updates dropped for a non-finite loss / grad norm
    tp: int = 1  # issue 24: tensor-parallel size, innermost mesh axis (trainer/tensor_parallel.py)
    sequence_parallel: bool = False  # issue 24: the stream between TP regions on sequence shards (needs --tp > 1)
    loss_parallel: bool = False  # issue 24: the head keeps its vocabulary shard; vocab-parallel loss (needs --tp > 1)
    # --- expert load balancing (issue 25; trainer/moe_balance.py): None = the model's own recipe
    moe_bias_update_rate: float | None = None
    moe_aux_loss_coeff: float | None = None
    moe_seq_aux_loss_coeff: float | None = None
    moe_z_loss_coeff: float | None = None
    # issue 26: BackendConfig.enable_fsdp_optimizations of the preset (the model's FSDP hooks; trainer/batch_step.py)
    fsdp_optimizations: bool = False
    # --- the dry run (issue 23 §3-§4; trainer/dry_run.py): one fake step per rank position, no GPU
    dry_run: bool = False
    world_size_override: int | None = None  # --world-size: the job's ranks (default: the layout's product)
    gpu_memory: float | None = None  # GiB per GPU (default: the --gpu's memory)
    gpu: str = "h100-sxm"
    gpu_tflops: float | None = None
    nvlink_gbps: float | None = None
    network_gbps: float | None = None
    gpus_per_node: int | None = None

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def local_batch(self) -> int:
        """Sequences per data-parallel replica per step."""
        return self.global_batch // self.dp


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows the defaults of options that take a value; not of switches (`--no-progress` "(default: True)" would
    read as "no progress by default") nor where the help names the default itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Reference trainer composing the am-* packages: pp x dp x cp on one DeviceMesh, launched "
        "with torchrun (gloo on CPU, NCCL on GPU).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", choices=MODELS, default="nemotron", help="tiny preset to build (random init)")
    p.add_argument("--model-path", default=None, help="HF-format folder to load instead of the preset's random init")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP2) size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size, carved out of the dp x cp ranks (must divide dp x cp and every expert count); "
        "does not add processes",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size (the model's declared plan; innermost mesh axis: pp x dp x cp x tp processes)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: norms and the residual stream between the TP regions on sequence shards (reduce-scatter / "
        "all-gather instead of all-reduce); --seq-len must divide by --tp",
    )
    p.add_argument(
        "--loss-parallel",
        action="store_true",
        help="with --tp: the output head keeps its vocabulary shard and the loss is a vocabulary-parallel "
        "cross-entropy (the [B, S, V] logits are never gathered)",
    )
    p.add_argument("--schedule", default="1F1B", help="pipeline schedule name (GPipe, 1F1B, Interleaved1F1B, ...)")
    p.add_argument(
        "--stages-per-rank",
        type=int,
        default=1,
        help="pipeline stages per rank, run exactly (2+ for multi-stage schedules; layers split as evenly as possible)",
    )
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, all replicas")
    p.add_argument("--microbatch-size", type=int, default=1, help="sequences per pipeline microbatch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end of the decay (--lr-schedule)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0 disables)")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="bf16",
        help="bf16: mixed precision (fp32 master weights and AdamW state, bf16 compute); bf16-pure: bf16 storage "
        "too (half the memory, small updates round away); fp32: fp32 everywhere",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", default=None, help=".txt (bytes), .pt (int tensor) or .bin (uint16) corpus")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (checkpoints, loss curve, summary)")
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint every N steps (0: only at the end)")
    p.add_argument(
        "--hf-shard-size",
        default="5GB",
        help="the HF-format export of each checkpoint is written in safetensors files of at most this size "
        "(save_pretrained's max_shard_size: bytes, or e.g. 5GB, 200MB, 64KB); a writer holds at most this much",
    )
    p.add_argument("--resume", default=None, help="checkpoint folder, or 'latest' under --out")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="a fresh run into an --out that holds checkpoints deletes them (without it the run is refused)",
    )
    p.add_argument("--tie-embeddings", action="store_true", help="llama: tie lm_head to the input embeddings")
    p.add_argument("--mtp-depths", type=int, default=1, help="nemotron: multi-token-prediction depths")
    p.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help=f"preset width (default: {PRESET_HIDDEN_SIZE}; not with --model-path, whose config.json sets it)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"preset decoder layers (default: {PRESET_LAYERS}; not with --model-path, whose config.json sets it)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores / processes)")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a collective may wait before the run fails (no hangs)"
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar (default: a bar on rank 0)"
    )
    p.add_argument(
        "--skip-nonfinite-steps",
        type=int,
        default=0,
        metavar="N",
        help="drop the update of at most N steps whose loss or gradient norm is NaN or infinite (counted in the "
        "progress bar and summary.json); 0: the first such step stops the run with exit code 3",
    )
    _add_feature_options(p)
    _add_dry_run_options(p)
    from trainer.moe_balance import add_balancing_options

    add_balancing_options(p)
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The run's options: the command line over `--config FILE` (TOML) over the defaults (trainer/config_file.py)."""
    import sys

    from trainer.config_file import parse_with_config_file

    parser = build_parser()
    argv = _join_negative_numbers(parser, list(sys.argv[1:] if argv is None else argv))
    ns = parse_with_config_file(parser, argv)
    return RunConfig(**vars(ns))


def _join_negative_numbers(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--lr -1e-3` -> `--lr=-1e-3`: argparse takes `-1e-3` for an option (it knows negative numbers only without
    an exponent), so the value would never reach validation, which says what is wrong with it."""
    valued = {flag for action in parser._actions if action.nargs is None for flag in action.option_strings}
    joined: list[str] = []
    for token in argv:
        if joined and joined[-1] in valued and token.startswith("-") and _is_number(token):
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------------------------------
# Training features (issue 16 §5): each option's rule lives in the module that implements it
# ------------------------------------------------------------------------------------------------------------------


def _add_feature_options(p: argparse.ArgumentParser) -> None:
    from trainer.optim import LR_SCHEDULES, OPTIMIZERS

    p.add_argument(
        "--config",
        default=None,
        help="TOML file of options (keys: the option names, e.g. global_batch = 8); command-line flags override it",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer folder (AutoTokenizer) for text data; default: the byte tokenizer (one token per byte)",
    )
    p.add_argument("--data-field", default=None, help="the text field of .jsonl records / HF dataset rows [text]")
    p.add_argument("--data-split", default=None, help="the split of an HF dataset [train]")
    p.add_argument("--val-every", type=int, default=0, help="validation loss every N steps (0: no validation)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="hold out the last FRACTION of the --data tokens for validation (never trained on)",
    )
    p.add_argument("--val-data", default=None, help="validation corpus (any --data format) instead of --val-fraction")
    p.add_argument("--val-batches", type=int, default=2, help="global batches per validation")
    p.add_argument(
        "--tensorboard",
        default=None,
        help="TensorBoard log folder (default: <out>/tb when tensorboard is installed; 'off' disables)",
    )
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_const", const="off", help="no TensorBoard")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each decoder layer's activations in backward (torch.utils.checkpoint): less memory, more time",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument(
        "--fsdp-optimizations",
        action="store_true",
        help="build the am-models preset with BackendConfig(enable_fsdp_optimizations=True): its "
        "prepare_for_grad_accumulation / prepare_for_final_backward hooks defer FSDP2's reduce-scatter and "
        "resharding to the last microbatch of each step (pp 1 with FSDP2)",
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--momentum", type=float, default=None, help="SGD momentum [0.9]")
    p.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default="cosine",
        help="after the linear warm-up: cosine or linear decay to --min-lr, or constant --lr",
    )


def _add_dry_run_options(p: argparse.ArgumentParser) -> None:
    from trainer.step_time import DEFAULT_GPU, GPUS

    g = p.add_argument_group("dry run (one process, no GPU: does the layout fit, how fast might it be)")
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="run one fake training step per rank position of a --world-size job on the CPU (fake tensors, fake "
        "process group); write <out>/dry_run.json and a table; exit 0 if it fits --gpu-memory, 2 if not",
    )
    g.add_argument(
        "--world-size", dest="world_size_override", type=int, default=None, help="ranks of the job (default: the "
        "product of the layout's sizes, which it must equal)"
    )  # fmt: skip
    g.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU (default: the --gpu's memory)")
    g.add_argument("--gpu", choices=sorted(GPUS), default=DEFAULT_GPU, help="the hardware of the predicted time")
    g.add_argument("--gpu-tflops", type=float, default=None, help="dense bf16 TFLOP/s instead of the --gpu's")
    g.add_argument("--nvlink-gbps", type=float, default=None, help="GB/s per GPU and direction inside a node")
    g.add_argument("--network-gbps", type=float, default=None, help="GB/s per GPU across nodes (400 Gb/s IB: 50)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs sharing NVLink (default: the --gpu's node)")


_DRY_RUN_ONLY = ("world_size_override", "gpu_memory", "gpu_tflops", "nvlink_gbps", "network_gbps", "gpus_per_node")
_DRY_RUN_FLAG = {"world_size_override": "--world-size"}


def dry_run_problems(cfg: RunConfig) -> list[str]:
    """The dry-run options: positive finite numbers, and only with --dry-run (no option accepted and ignored)."""
    problems = []
    given = [name for name in _DRY_RUN_ONLY if getattr(cfg, name) is not None]
    flags = [_DRY_RUN_FLAG.get(name, "--" + name.replace("_", "-")) for name in given]
    if not cfg.dry_run:
        if given or cfg.gpu != "h100-sxm":
            flags += ["--gpu"] if cfg.gpu != "h100-sxm" else []
            problems.append(f"{', '.join(flags)} only apply with --dry-run: add --dry-run or drop them")
        return problems
    for name, flag in zip(given, flags, strict=True):
        value = getattr(cfg, name)
        if not math.isfinite(value) or value <= 0:
            problems.append(f"{flag} {value}: must be a positive finite number")
    return problems


def feature_problems(cfg: RunConfig) -> list[str]:
    """Every problem of the feature options, each asked of the module that owns the rule."""
    from trainer.evaluation import validation_option_problems
    from trainer.optim import optimizer_option_problems
    from trainer.tb_logging import tensorboard_problems
    from trainer.text_sources import data_option_problems

    problems = optimizer_option_problems(cfg) + validation_option_problems(cfg) + data_option_problems(cfg)
    return problems + tensorboard_problems(cfg) + dry_run_problems(cfg)


_FLOAT_OPTIONS = ("lr", "min_lr", "weight_decay", "adam_eps", "grad_clip", "timeout")
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def find_problems(cfg: RunConfig, *, world_size: int) -> list[str]:
    """Every problem with `cfg` that can be seen without a process group (an empty list means go).

    Each entry names the wrong value, why it is wrong and the fix. Problems that need the model (am-capabilities),
    the data or a checkpoint are added by the caller, so the user sees them all in one message.
    """
    problems = []
    for name in ("pp", "dp", "cp", "ep", "tp", "global_batch", "microbatch_size", "seq_len", "steps", "layers"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')}={getattr(cfg, name)}: must be >= 1")
    sizes = {"--hidden-size": cfg.hidden_size, "--layers": cfg.layers}
    preset_sizes = [f"{flag} {value}" for flag, value in sizes.items() if value is not None]
    if cfg.model_path is not None and preset_sizes:
        problems.append(
            f"{' and '.join(preset_sizes)} size the presets (--model), not a --model-path model, whose config.json "
            "sets its size: drop them"
        )
    if cfg.skip_nonfinite_steps < 0:
        problems.append(f"--skip-nonfinite-steps {cfg.skip_nonfinite_steps}: must be >= 0 (0: stop at the first)")
    sizes_ok = min(cfg.pp, cfg.dp, cfg.cp, cfg.tp) >= 1
    if sizes_ok and world_size != cfg.world_size:
        product = f"pp x dp x cp = {cfg.pp} x {cfg.dp} x {cfg.cp}"
        if cfg.tp > 1:  # ep adds no ranks (carved out of dp x cp); tp does
            product = f"pp x dp x cp x tp = {cfg.pp} x {cfg.dp} x {cfg.cp} x {cfg.tp}"
        problems.append(
            f"the world size is {world_size} but {product} = {cfg.world_size}: "
            f"launch {cfg.world_size} processes (torchrun --nproc-per-node {cfg.world_size}) or change the sizes"
        )
    if cfg.dp >= 1 and cfg.global_batch % cfg.dp:
        problems.append(
            f"--global-batch {cfg.global_batch} is not divisible by --dp {cfg.dp}: every data-parallel replica needs "
            "the same number of sequences"
        )
    elif cfg.pp == 1 and cfg.dp >= 1 and cfg.microbatch_size >= 1 and cfg.local_batch % cfg.microbatch_size:
        # pp = 1 accumulates microbatches itself; with pp > 1 the pipeline plan owns this rule.
        problems.append(
            f"{_batch_label(cfg)} is not divisible by --microbatch-size {cfg.microbatch_size}: change either"
        )
    if cfg.pp == 1:
        unused = [f"--stages-per-rank {cfg.stages_per_rank}"] if cfg.stages_per_rank != 1 else []
        unused += [f"--schedule {cfg.schedule}"] if cfg.schedule.lower() != "1f1b" else []
        if unused:
            problems.append(f"{' and '.join(unused)} only apply with --pp > 1: drop them or raise --pp")
    floats = {name: getattr(cfg, name) for name in _FLOAT_OPTIONS}
    not_finite = [name for name, value in floats.items() if not math.isfinite(value)]
    problems += [f"--{name.replace('_', '-')} {floats[name]}: must be a finite number" for name in not_finite]
    # Each rule is checked on the values that are finite, so a NaN in one option hides no problem of another.
    finite = {name: value for name, value in floats.items() if name not in not_finite}
    lr, min_lr = finite.get("lr"), finite.get("min_lr")
    if (
        cfg.warmup_steps < 0
        or (lr is not None and lr <= 0)
        or (min_lr is not None and min_lr < 0)
        or (lr is not None and min_lr is not None and min_lr > lr and cfg.lr_schedule != "constant")
    ):
        problems.append(
            f"--lr {cfg.lr}, --min-lr {cfg.min_lr}, --warmup-steps {cfg.warmup_steps}: need lr > 0, "
            "0 <= min-lr <= lr and warmup-steps >= 0"
        )
    if finite.get("grad_clip", 0.0) < 0 or finite.get("weight_decay", 0.0) < 0 or finite.get("adam_eps", 1.0) <= 0:
        problems.append(
            f"--grad-clip {cfg.grad_clip}, --weight-decay {cfg.weight_decay}, --adam-eps {cfg.adam_eps}: need "
            "grad-clip >= 0, weight-decay >= 0 and adam-eps > 0"
        )
    if cfg.ckpt_every < 0:
        problems.append(f"--ckpt-every {cfg.ckpt_every}: must be >= 0 (0 writes a checkpoint at the end only)")
    from trainer.export import shard_bytes

    try:
        shard_bytes(cfg.hf_shard_size)
    except ValueError as err:
        problems.append(f"--hf-shard-size {cfg.hf_shard_size}: {err}")
    if cfg.mtp_depths < 0:
        problems.append(f"--mtp-depths {cfg.mtp_depths}: must be >= 0 (0 disables multi-token prediction)")
    if "timeout" not in not_finite and not 0 < cfg.timeout <= MAX_TIMEOUT_S:
        problems.append(f"--timeout {cfg.timeout}: must be > 0 and at most {MAX_TIMEOUT_S:.0f} seconds (a week)")
    if cfg.threads < 0:
        problems.append(f"--threads {cfg.threads}: must be >= 0 (0: the cores divided by the processes)")
    if cfg.overwrite and cfg.resume is not None:
        problems.append(
            f"--overwrite with --resume {cfg.resume}: a resumed run keeps its checkpoints; drop one of the two"
        )
    if cfg.model_path is not None and not (Path(cfg.model_path) / "config.json").is_file():
        problems.append(f"--model-path {cfg.model_path}: no config.json there (expected an HF-format folder)")
    if cfg.model_path is None and cfg.model in REAL_SIZE_MODELS:
        sized = list(preset_sizes)
        if cfg.model.startswith("nemotron") and cfg.mtp_depths != 1:
            sized.append(f"--mtp-depths {cfg.mtp_depths}")
        if sized:
            problems.append(
                f"{', '.join(sized)}: --model {cfg.model} is the published configuration at its published size; "
                "these options size the tiny presets only: drop them"
            )
    if cfg.tie_embeddings and cfg.model != "llama":
        problems.append(f"--tie-embeddings applies to --model llama only, not {cfg.model}")
    problems += feature_problems(cfg)
    return problems


def cp_problems(cfg: RunConfig, *, cp_layout: str | None, pad_multiple: int) -> list[str]:
    """Every problem of `--cp` with this run (an empty list means go), seen before any collective.

    cp_layout: the model's CP layout ("contiguous" or "load_balanced"; None when the model could not be built), and
    pad_multiple: sequences are padded to a multiple of pad_multiple x cp before sharding. Whether the model supports
    CP at all is am-capabilities' rule (the caller adds its lines).
    """
    if cfg.cp <= 1:
        return []
    problems = []
    unit = pad_multiple * cfg.cp
    if cfg.seq_len >= 1 and cfg.seq_len % unit:
        problems.append(
            f"--seq-len {cfg.seq_len} is not divisible by {unit} ({pad_multiple} x --cp {cfg.cp}), the length the CP "
            "sharder pads every sequence to; this trainer runs unpadded sequences only, so use --seq-len "
            f"{-(-cfg.seq_len // unit) * unit} or another --cp"
        )
    if cfg.pp > 1 and cp_layout not in (None, "contiguous"):
        problems.append(
            f"--pp {cfg.pp} with --cp {cfg.cp}: pipeline stages run context parallelism only for models that declare "
            f'the contiguous CP layout (contract `cp.layout="contiguous"`), and {model_label(cfg)} uses the '
            f"{cp_layout} layout; drop --pp or --cp"
        )
    return problems


def expert_parallel_plan(cfg: RunConfig) -> tuple[Any, list[str]]:
    """(plan, problems) of `--ep` with the mesh, seen before any collective: am-moe's `plan_expert_parallel` (ep
    divides dp x cp: expert parallelism is carved out of the data-parallel ranks), asked here in CLI terms, once
    (validation puts the plan into the run plan). Whether the model implements EP and whether its expert counts split
    over ep are am-capabilities' rules (`validate_for_mesh` with `ep_size`; the caller adds their lines).

    ep = 1 plans nothing: (None, []); so does ep < 1 or dp / cp < 1 (`find_problems` reports them).
    """
    if cfg.ep <= 1 or min(cfg.dp, cfg.cp) < 1:
        return None, []
    from am_moe import plan_expert_parallel

    try:
        return plan_expert_parallel(data_parallel_size=cfg.dp * cfg.cp, ep=cfg.ep), []
    except ValueError as exc:
        return None, [
            f"--ep {cfg.ep} with --dp {cfg.dp} x --cp {cfg.cp}: {line.strip().removeprefix('- ')}; choose an --ep "
            f"that divides {cfg.dp * cfg.cp}"
            for line in str(exc).splitlines()[1:]
            if line.strip()
        ]


def mesh_context(cfg: RunConfig) -> Any:
    """The mesh this run asks of the model, as am-capabilities reads it (validation and the capability attach use
    this one description): pp, dp, cp and ep sizes (ep is carved out of dp x cp, so it adds no ranks)."""
    from am_capabilities import MeshContext

    return MeshContext(pp_size=cfg.pp, dp_size=cfg.dp, cp_size=cfg.cp, ep_size=cfg.ep)


def model_label(cfg: RunConfig) -> str:
    """The option that chose the model, as the user wrote it: `--model-path DIR` or `--model NAME`."""
    return f"--model-path {cfg.model_path}" if cfg.model_path is not None else f"--model {cfg.model}"


def _batch_label(cfg: RunConfig) -> str:
    return f"the batch per replica (--global-batch {cfg.global_batch} / --dp {cfg.dp} = {cfg.local_batch})"


def pipeline_plan(cfg: RunConfig, *, num_layers: int | None) -> tuple[Any, list[str]]:
    """(plan, problems) of this run's pipeline: am-pipelining's `plan_pipeline` for `--pp`, `--schedule`,
    `--stages-per-rank` (run exactly), the batch per replica and `--microbatch-size`, with its messages naming
    these options. `num_layers` comes from the model (None when it could not be built: layer rules are skipped).

    pp = 1 plans nothing: (None, []); so does pp < 1 (`find_problems` reports it).
    """
    from am_pipelining import PipelinePlanError, plan_pipeline

    if cfg.pp <= 1:
        return None, []
    batch_known = cfg.dp >= 1 and cfg.global_batch % cfg.dp == 0  # else find_problems reports the dp split
    labels = {
        "pp_size": f"--pp {cfg.pp}",
        "schedule": f"--schedule {cfg.schedule!r}",
        "stages_per_rank": f"--stages-per-rank {cfg.stages_per_rank}",
        "local_batch_size": _batch_label(cfg),
        "microbatch_size": f"--microbatch-size {cfg.microbatch_size}",
        "num_layers": f"the model's {num_layers} decoder layers",
    }
    try:
        plan = plan_pipeline(
            num_layers,
            cfg.pp,
            cfg.schedule,
            stages_per_rank=cfg.stages_per_rank,
            local_batch_size=cfg.local_batch if batch_known else None,
            microbatch_size=cfg.microbatch_size if batch_known else None,
            option_labels=labels,
        )
    except PipelinePlanError as exc:
        return None, list(exc.problems)
    return plan, []
