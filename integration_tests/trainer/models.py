"""Models of the reference trainer: tiny presets of every model family we train, or an HF-format folder.

What it is for: building the model the same way on every rank (fp32, seeded), and knowing how to write it back as an
HF-format folder. Presets: `nemotron` (am-models-nemotron, hybrid Mamba2 / attention / MLP / MoE with multi-token
prediction), `gemma4` and `gemma4-moe` (am-models-gemma4, sliding + full attention, tied head), `llama` (transformers'
LlamaForCausalLM, optionally with tied embeddings).
What it must not do: touch torch.distributed, or special-case a model anywhere else in the trainer; everything
model-specific the trainer needs lives here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.config import MODELS, REAL_SIZE_MODELS
from trainer.data import ByteTokenizer


@dataclass(frozen=True)
class ModelSpec:
    """How to build one model, give a rank its blocks, and save it in HF format.

    `build()` returns the model's structure on the meta device (no storage: a preset from its config, a folder from
    its config.json, whose names and shapes are checked against the files' headers); `materialize(part, seed,
    device)` gives one part of it (the whole model, or a pipeline stage, possibly ep-sharded and FSDP2-wrapped) this
    rank's blocks on `device`: the seeded per-unit init of a preset, the folder's weights of a `--model-path`
    (trainer/build.py) and returns what it read from the files (`am_model_io.ShardedLoad`; None: nothing read);
    `save(model, folder)` writes config.json + safetensors; `family` names the preset (or the folder's
    architecture). `loads_weights`: `materialize` reads a folder's weights. `file_layout(part)`: how `save` writes
    a part tensor by tensor (`am_model_io.FileLayout`), which the streamed HF export follows.
    """

    family: str
    build: Callable[[], nn.Module]
    save: Callable[[nn.Module, Path], None]
    vocab_size: int
    file_layout: Callable[[nn.Module], Any]
    materialize: Callable[[nn.Module, int, torch.device], Any]
    loads_weights: bool = False


def _nemotron_pattern(num_layers: int) -> str:
    # Every block kind in the first four layers (Mamba2, attention, MLP, MoE), then repeated.
    return ("M*-E" * math.ceil(num_layers / 4))[:num_layers]


def nemotron_config(*, hidden_size: int, num_layers: int, mtp_depths: int, vocab_size: int) -> Any:
    from transformers import NemotronHConfig

    head_dim = 8 if hidden_size <= 64 else 16
    # The pattern fields are accepted through NemotronHConfig's **kwargs (invisible to type checkers).
    return NemotronHConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        hybrid_override_pattern=_nemotron_pattern(num_layers),
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=max(1, hidden_size // head_dim // 2),
        head_dim=head_dim,
        intermediate_size=2 * hidden_size,
        mamba_num_heads=hidden_size // head_dim,
        mamba_head_dim=head_dim,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
        conv_kernel=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=hidden_size,
        moe_shared_expert_intermediate_size=hidden_size,
        num_nextn_predict_layers=mtp_depths,
        mtp_hybrid_override_pattern="*-",
        # transformers (5.23) clamps Mamba2's dt at time_step_min from below whatever time_step_limit says; spelling
        # that limit here makes our model and transformers compute the same thing, so an exported run loads into
        # transformers with equal logits (with the default (0, inf) they differ by ~5e-5 per Mamba2 layer).
        time_step_limit=(0.001, math.inf),
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def gemma4_config(*, hidden_size: int, num_layers: int, moe: bool, vocab_size: int) -> Any:
    from transformers import Gemma4TextConfig

    head_dim = 8 if hidden_size <= 64 else 16
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=max(1, hidden_size // head_dim // 2),
        head_dim=head_dim,
        global_head_dim=2 * head_dim,
        num_global_key_value_heads=max(1, hidden_size // head_dim // 2),  # as the sliding layers: tp 2 divides it
        attention_k_eq_v=True,
        sliding_window=8,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)],
        hidden_size_per_layer_input=0,  # no per-layer inputs: a pipeline stage needs only hidden states
        vocab_size_per_layer_input=vocab_size,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
    )
    if moe:
        kwargs.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=hidden_size)
    return Gemma4TextConfig(**kwargs)


def llama_config(*, hidden_size: int, num_layers: int, tie_embeddings: bool, vocab_size: int) -> Any:
    from transformers import LlamaConfig

    head_dim = 8 if hidden_size <= 64 else 16
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=max(1, hidden_size // head_dim // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "sdpa"  # the ring attention of am-context-parallel routes "sdpa" under CP
    return config


def preset_backend(name: str, *, fsdp_optimizations: bool) -> Any:
    """The `am_precision.BackendConfig` an am-models preset is built with: None (the model's own defaults) unless an
    option asks for a field, i.e. `--fsdp-optimizations` (`enable_fsdp_optimizations=True`, on the plain-PyTorch
    kernels: Nemotron-H's `default_backend()`; Gemma 4's SDPA / torch / fp32-norm defaults with am-moe's grouped
    GEMM experts, `experts="torch_mm"`, where its default is the measured "auto")."""
    if not fsdp_optimizations:
        return None
    if name.startswith("nemotron"):
        from am_models_nemotron import default_backend

        return default_backend().replace(enable_fsdp_optimizations=True)
    from am_precision import BackendConfig

    return BackendConfig(
        attn="sdpa",
        linear="torch",
        rms_norm="torch_fp32",
        experts="torch_mm",
        dispatcher="torch",
        enable_fsdp_optimizations=True,
    )


def _am_models_spec(name: str, config: Any, backend: Any) -> ModelSpec:
    """The spec of an am-models model from `config` (Nemotron-H for a `nemotron*` name, else Gemma 4's text model):
    built on the meta device, materialized with its package's seeded per-unit init, saved with its package's
    `save_pretrained` and file layout. Its vocabulary is the config's."""
    import importlib

    from trainer.build import SeededInit

    nemotron = name.startswith("nemotron")
    package: Any = importlib.import_module("am_models_nemotron" if nemotron else "am_models_gemma4")

    def build() -> nn.Module:
        with torch.device("meta"):
            if nemotron:
                # fp32 master weights whatever the config's torch_dtype says (the published configs say bfloat16,
                # which the model would otherwise be built in); the precision policy decides the storage dtype later
                # (trainer/loop.py's `build`).
                return package.NemotronHForCausalLM(config, backend, dtype=torch.float32)
            return package.Gemma4ForCausalLM(config, backend=backend)

    init = SeededInit(meta_twin=package.meta_twin, init_units=package.init_units)
    vocab = int(config.vocab_size)
    return ModelSpec(name, build, _save_own, vocab, package.hf_file_layout, materialize=_seeded(init))


def _seeded(init: Any) -> Callable[[nn.Module, int, torch.device], None]:
    """The seeded per-unit init of a model family (`init`: trainer/build.py's `SeededInit`) as a spec's
    `materialize`."""
    from trainer.build import materialize_seeded

    def materialize(part: nn.Module, seed: int, device: torch.device) -> None:
        materialize_seeded(part, init=init, seed=seed, device=device)

    return materialize


def _save_own(model: nn.Module, folder: Path) -> None:
    model.save_pretrained(folder)  # type: ignore[operator]


def _save_hf(model: nn.Module, folder: Path) -> None:
    model.save_pretrained(str(folder), safe_serialization=True)  # type: ignore[operator]


def _transformers_layout(model: nn.Module) -> Any:
    from trainer.export import transformers_file_layout

    return transformers_file_layout(model)


def preset_spec(
    name: str,
    *,
    hidden_size: int,
    num_layers: int,
    mtp_depths: int,
    tie_embeddings: bool,
    vocab_size: int | None,
    fsdp_optimizations: bool = False,
) -> ModelSpec:
    """The spec of a tiny preset (random init). `vocab_size` defaults to the byte tokenizer's 256;
    `fsdp_optimizations`: an am-models preset's `BackendConfig.enable_fsdp_optimizations` (`preset_backend`)."""
    vocab = vocab_size or ByteTokenizer.vocab_size
    backend = preset_backend(name, fsdp_optimizations=fsdp_optimizations) if name != "llama" else None
    sizes = {"hidden_size": hidden_size, "num_layers": num_layers, "vocab_size": vocab}
    if name == "nemotron":
        return _am_models_spec(name, nemotron_config(**sizes, mtp_depths=mtp_depths), backend)
    if name in ("gemma4", "gemma4-moe"):
        return _am_models_spec(name, gemma4_config(**sizes, moe=name == "gemma4-moe"), backend)
    if name in REAL_SIZE_MODELS:
        return real_size_spec(name, backend=backend)
    if name == "llama":
        from trainer.build import TRANSFORMERS_INIT

        config = llama_config(**sizes, tie_embeddings=tie_embeddings)

        def build_llama() -> nn.Module:
            from transformers import LlamaForCausalLM

            with torch.device("meta"):
                return LlamaForCausalLM(config)

        return ModelSpec(
            name, build_llama, _save_hf, vocab, _transformers_layout, materialize=_seeded(TRANSFORMERS_INIT)
        )
    raise ValueError(f"--model {name!r} is unknown; choose one of {', '.join(MODELS)}")


def real_size_spec(name: str, *, backend: Any = None) -> ModelSpec:
    """The spec of a published configuration (the model packages' presets: Nemotron 3 Nano 30B-A3B, Gemma 4 26B-A4B
    and 31B, config only): built on the meta device like every model, then each rank materializes its own blocks with
    the seeded init. Its vocabulary is the published one (the byte tokenizer's ids fit in it)."""
    if name.startswith("nemotron"):
        from am_models_nemotron.presets import preset_config

        return _am_models_spec(name, preset_config(name), backend)
    from am_models_gemma4.presets import preset_config as gemma4_preset

    # the text model: what Gemma4ForCausalLM trains
    return _am_models_spec(name, gemma4_preset(name, text_only=True), backend)


def hf_attention_implementation(folder: str | Path) -> str:
    """The attention a transformers causal LM in `folder` is loaded with: "sdpa" where its class supports it (its
    contract's `cp.sdpa_attention`; the ring attention of am-context-parallel routes it under CP), else "eager"
    (Gemma2, XGLM, Bloom, GPT-J, ... : every transformers model implements eager). A folder whose class transformers
    does not know gets "sdpa" here; `AutoModelForCausalLM` then refuses it in its own words."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from am_model_contract import conventional_contract

    config = AutoConfig.from_pretrained(str(folder))
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    # A transformers class (no instance yet, no `am_contract`): its class flags are read by the one translator.
    if model_class is None or conventional_contract(model_class).cp.sdpa_attention:
        return "sdpa"
    return "eager"


def attn_implementation(model: nn.Module) -> str | None:
    """The attention implementation `model` runs (its config's `_attn_implementation`; None when it has none)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def model_path_weight_problems(folder: str | Path) -> list[str]:
    """A `--model-path` folder without safetensors weights (`model.safetensors` or its index), said in plain words:
    PyTorch `.bin` files are not read (each rank reads only its own slices, which safetensors' `get_slice` offers and
    a pickled `.bin` does not without loading its whole file), so the way out is a one-time conversion. [] when the
    folder has safetensors weights (or is not a folder: `folder_spec` names that)."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / "model.safetensors").is_file() or (folder / INDEX_FILE).is_file():
        return []
    bins = sorted(path.name for path in folder.glob("*.bin"))
    convert = (
        'convert it once, e.g. python -c "from transformers import AutoModelForCausalLM as M; '
        f"M.from_pretrained('{folder}').save_pretrained('{folder}-safetensors')\", and pass that folder"
    )
    if bins:
        shown = ", ".join(bins[:3]) + (f" (+{len(bins) - 3} more)" if len(bins) > 3 else "")
        return [
            f"--model-path {folder} holds PyTorch .bin weights ({shown}) and no safetensors (model.safetensors or "
            f"{INDEX_FILE}): the trainer reads safetensors only, each rank just its own slices; {convert}"
        ]
    return [f"--model-path {folder} holds no weights (no model.safetensors, no {INDEX_FILE}, no .bin files)"]


INDEX_FILE = "model.safetensors.index.json"


def folder_spec(folder: str | Path, *, config_only: bool = False) -> ModelSpec:
    """The spec of an HF-format folder: the model class registered for its `architectures` / `model_type` in the
    am-capabilities registry (our model packages register theirs through the `am_capabilities.models` entry
    points), else any transformers causal LM (`AutoModelForCausalLM`, with SDPA where the class supports it, else
    eager: `hf_attention_implementation`). `family` is the config's `model_type`.

    `config_only` (the dry run of a folder with only config.json): the same class built from the config alone on the
    meta device. It has no weights to load, so a real run refuses it (its `materialize` raises); the dry run
    materializes fake storage. An architecture unknown to both raises transformers' own message, naming the model
    type."""
    from transformers import AutoConfig

    from am_capabilities import find_model_class

    folder = Path(folder)
    config_dict = json.loads((folder / "config.json").read_text())
    model_type = config_dict.get("model_type") or None
    registered = find_model_class(config_dict.get("architectures"), model_type)
    if config_only:  # an unknown model_type raises here, in transformers' words
        config = AutoConfig.from_pretrained(str(folder))
        vocab_size = int((getattr(config, "text_config", None) or config).vocab_size)
    else:  # a composite (e.g. vision-language) config keeps the text settings in `text_config`
        vocab_size = int(config_dict.get("vocab_size") or config_dict.get("text_config", {})["vocab_size"])

    def no_weights(part: nn.Module, seed: int, device: torch.device) -> None:
        raise ValueError(f"--model-path {folder} holds only config.json: no weights to train (--dry-run only)")

    if registered is not None:
        model_class: Any = registered

        def build_registered() -> nn.Module:
            if config_only:
                with torch.device("meta"):
                    return model_class.from_config(config)
            # names and shapes checked against the files' headers by the class's own loader; no data is read
            return model_class.from_pretrained(folder, dtype=torch.float32, device_map="meta")

        def load_registered(part: nn.Module, seed: int, device: torch.device) -> Any:
            del seed  # every value comes from the folder
            part.to_empty(device=device)
            return _package_function(model_class, "load_sharded_checkpoint")(part, folder)

        return ModelSpec(
            model_type or registered.__name__,
            build_registered,
            _save_own,
            vocab_size,
            lambda part: _package_function(model_class, "hf_file_layout")(part),  # looked up when exporting
            no_weights if config_only else load_registered,
            loads_weights=True,
        )

    def build_hf() -> nn.Module:
        from transformers import AutoModelForCausalLM

        from trainer.build import header_sources

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(str(folder)),
                dtype=torch.float32,
                attn_implementation=hf_attention_implementation(folder),
            )
        if config_only:
            return model
        info = header_sources(folder, model)[1]  # the headers only: no data is read
        # Tensors transformers converts on load in a way `header_sources` cannot read by blocks: other than stacking
        # per-expert files (and fusing their patterns along the rows: Mixtral, Qwen2-MoE, OLMoE) or re-indexing the
        # rows of a fused tensor along one dim (`Chunk`, `Interleave`: HRM-Text, Inkling 2), e.g. a `Transpose` or
        # `PermuteForRope`: such a folder is loaded whole.
        if info["converted_keys"]:
            return _load_hf_whole(folder)
        check_loaded_keys(folder, info)
        return model

    def load_hf(part: nn.Module, seed: int, device: torch.device) -> Any:
        from trainer.build import load_transformers_blocks

        if not any(p.is_meta for p in part.parameters()):  # loaded whole by `build` (files transformers converts)
            part.to(device)  # FSDP2 moved its shards already; an unwrapped part is still on the CPU
            return None
        return load_transformers_blocks(part, folder, seed=seed, device=device)

    materialize = no_weights if config_only else load_hf
    return ModelSpec(
        model_type or "hf", build_hf, _save_hf, vocab_size, _transformers_layout, materialize, loads_weights=True
    )


def _load_hf_whole(folder: Path) -> nn.Module:
    """The whole model, every weight read by transformers (strict check through its loading info). Still whole on
    every rank: only for folders whose tensors transformers converts on load other than by stacking experts or
    re-indexing a fused tensor's rows (`folder_spec`'s `build_hf`)."""
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(
        str(folder),
        dtype=torch.float32,
        attn_implementation=hf_attention_implementation(folder),
        output_loading_info=True,
        ignore_mismatched_sizes=True,
    )
    model, info = loaded
    check_loaded_keys(folder, info)
    return model


def _package_function(model_class: Any, name: str) -> Callable[..., Any]:
    """The function `name` of the package that defines `model_class` (our model packages export
    `load_sharded_checkpoint(model, folder)`: each rank reads only the blocks it holds, and `hf_file_layout(model)`:
    how their save writes a model tensor by tensor)."""
    import importlib

    package = importlib.import_module(model_class.__module__.split(".")[0])
    found = getattr(package, name, None)
    if not callable(found):
        raise ValueError(
            f"{model_class.__name__} is registered for --model-path, but its package {package.__name__} exports no "
            f"{name}(...) to load or export a sharded model; register a class whose package does"
        )
    return found


# Keys a folder may lack, or hold in excess, without being refused (regular expressions on the file's key names).
# Tied heads are not listed: transformers neither expects nor reports the output copy of a tied embedding.
ALLOWED_MISSING: tuple[str, ...] = ()
ALLOWED_UNEXPECTED: tuple[str, ...] = (r"(^|\.)rotary_emb\.inv_freq$",)  # a buffer old checkpoints saved


def check_loaded_keys(folder: Path, info: dict[str, Any]) -> None:
    """Refuse a transformers load that was not complete: every tensor the model needs must come from `folder`.

    `info` is `from_pretrained(..., output_loading_info=True)`'s report; its key names are the file's own. (Our
    registered model classes load strictly themselves and raise the same way.)

    Raises:
        ValueError: listing every missing, unexpected and shape-mismatched key.
    """
    import re

    def allowed(key: str, patterns: tuple[str, ...]) -> bool:
        return any(re.search(pattern, key) for pattern in patterns)

    missing = sorted(k for k in info.get("missing_keys", ()) if not allowed(k, ALLOWED_MISSING))
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not allowed(k, ALLOWED_UNEXPECTED))
    mismatched = sorted(_mismatch_text(entry) for entry in info.get("mismatched_keys", ()))
    parts = [
        f"{label} ({len(keys)}): {keys}"
        for label, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches", mismatched),
        )
        if keys
    ]
    if parts:
        raise ValueError(
            f"--model-path {folder} does not hold exactly the tensors of the model its config.json describes (a "
            "missing tensor would train from a random init): " + "; ".join(parts)
        )


def _mismatch_text(entry: Any) -> str:
    """One of transformers' `mismatched_keys` entries, `(key, file shape, model shape)`, as `key: checkpoint (..) vs
    model (..)`, the form our model packages' strict loaders use (any other form as it prints)."""
    if isinstance(entry, tuple) and len(entry) == 3:
        key, file_shape, model_shape = entry
        return f"{key}: checkpoint {tuple(file_shape)} vs model {tuple(model_shape)}"
    return str(entry)


def build_meta_model(spec: ModelSpec) -> nn.Module:
    """The model's structure on the meta device, fp32, in training mode: every parameter and buffer with its shape
    and dtype and no storage, so validation reads the model's declarations (layers, CP layout, capabilities, router)
    and the run shards it before any rank holds a weight (a folder's names and shapes are checked on its headers)."""
    model = spec.build()
    model.float()
    model.train()
    return model


def build_model(spec: ModelSpec, *, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model with real weights in ONE process (the single-process reference, tests and export): the same
    meta build and the same `materialize` a sharded run uses, so every layout holds exactly these values."""
    from trainer.build import materialize_parts

    model = build_meta_model(spec)
    materialize_parts([model], materialize=spec.materialize, seed=seed, device=torch.device(device))
    return model


def is_meta_model(model: nn.Module) -> bool:
    """Whether `model` holds no weights (built by `build_meta_model`)."""
    return any(p.is_meta for p in model.parameters())
