"""What every model's `from_pretrained` / `save_pretrained` does before and after its own tensor mapping.

What it is for: turning transformers' loading keywords into one dtype (`resolve_dtype`) and one device
(`resolve_device`), or refusing them; resolving a folder or a hub id (`resolve_checkpoint_folder`:
`huggingface_hub.snapshot_download`, imported when a hub id is given); separating the hub keywords and the ones
`AutoModelForCausalLM` adds from a model's own (`split_pretrained_kwargs`); reading `config.json` (`load_hf_config`);
a model package's `save_pretrained`, built from its file layout (`pretrained_saver`: checking what it is asked to
write, then writing it).
What it must not do: know model names or layouts (each model package's state-dict adapter and `checkpoint.py` do),
or accept an option it does not honour.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypedDict, cast

import torch

from .safetensors_files import write_safetensors
from .shard_writer import FileLayout

__all__ = [
    "HubOptions",
    "load_hf_config",
    "pretrained_saver",
    "resolve_checkpoint_folder",
    "resolve_device",
    "resolve_dtype",
    "split_pretrained_kwargs",
]


class HubOptions(TypedDict, total=False):
    """huggingface_hub's download options, as transformers' `from_pretrained` takes them (a local folder uses none
    of them; `revision` for a folder is refused)."""

    revision: str | None
    cache_dir: str | os.PathLike[str] | None
    token: str | bool | None
    local_files_only: bool
    force_download: bool


# Keywords transformers' AutoModel passes on to a registered class: the first two change nothing here; the others
# would change what is loaded, so a value for them is refused.
_AUTO_KWARGS_IGNORED = ("_from_auto", "trust_remote_code")
_AUTO_KWARGS_REFUSED = ("adapter_kwargs", "subfolder", "proxies")


def split_pretrained_kwargs(kwargs: dict[str, Any]) -> HubOptions:
    """Pop from `kwargs` the hub options (returned) and the keywords `AutoModelForCausalLM.from_pretrained` adds;
    what is left are the model's own keywords.

    Raises:
        ValueError: `adapter_kwargs`, `subfolder` or `proxies` given a value (load adapters / subfolders apart).
    """
    hub = cast(HubOptions, {name: kwargs.pop(name) for name in HubOptions.__annotations__ if name in kwargs})
    for name in _AUTO_KWARGS_IGNORED:
        kwargs.pop(name, None)
    for name in _AUTO_KWARGS_REFUSED:
        value = kwargs.pop(name, None)
        if value:
            raise ValueError(f"{name}={value!r} is not supported by this loader (load adapters / subfolders apart)")
    return hub


def resolve_dtype(*, torch_dtype: Any, dtype: Any, config: Any) -> torch.dtype | None:
    """One dtype from transformers' two spellings (`torch_dtype`, `dtype`); "auto" reads the config's dtype.

    None keeps the checkpoint's dtypes. Raises ValueError when both are given and differ, or a string names no dtype.
    """
    if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
        raise ValueError(f"torch_dtype={torch_dtype!r} and dtype={dtype!r} disagree; pass one of them (same meaning)")
    chosen = dtype if dtype is not None else torch_dtype
    if chosen == "auto":
        chosen = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if chosen is None or isinstance(chosen, torch.dtype):
        return chosen
    resolved = getattr(torch, str(chosen).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype {chosen!r} is not a torch dtype (e.g. torch.bfloat16, 'bfloat16', 'auto')")
    return resolved


def resolve_device(*, device_map: Any, device: Any) -> torch.device:
    """The one device every tensor is loaded to: None / "cpu" / a single device (`"cuda:0"`, `0`, a
    `torch.device`, or `{"": device}`). Anything that spreads the model ("auto", "balanced", a per-module dict) is
    refused: this loader places the whole model on one device; shard it afterwards with the parallel wrappers."""
    if device_map is not None and device is not None:
        raise ValueError(f"device_map={device_map!r} and device={device!r} both given; pass one of them")
    chosen = device if device_map is None else device_map
    if isinstance(chosen, dict) and set(chosen) == {""}:
        chosen = chosen[""]
    if chosen is None:
        return torch.device("cpu")
    if isinstance(chosen, torch.device | int):
        return torch.device(chosen)
    if isinstance(chosen, str) and chosen not in ("auto", "balanced", "balanced_low_0", "sequential"):
        try:
            return torch.device(chosen)
        except RuntimeError:
            pass
    raise ValueError(
        f"device_map={chosen!r} cannot be honoured: only None, 'cpu', or one device ('cuda:0', 0, torch.device, "
        "{'': device}) are supported; the whole model is loaded on that device (no offloading or splitting across "
        "devices; use the am-* parallel wrappers to shard a loaded model)"
    )


def resolve_checkpoint_folder(
    path_or_hub_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
) -> Path:
    """A folder that exists is used as is; otherwise the string is a hub id, downloaded (config and safetensors
    only) with `huggingface_hub.snapshot_download` at `revision`. A path-like that does not exist is an error."""
    path = Path(path_or_hub_id)
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} given for the local folder {path}; revisions select hub commits")
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; pass the checkpoint folder (config.json + *.safetensors)")
    text = str(path_or_hub_id)
    if not isinstance(path_or_hub_id, str) or text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise FileNotFoundError(f"no checkpoint folder {text}, and it is not a hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download  # lazily: only hub ids need it

    return Path(
        snapshot_download(
            repo_id=text,
            revision=revision,
            cache_dir=None if cache_dir is None else Path(cache_dir),
            token=token,
            local_files_only=local_files_only,
            force_download=force_download,
            allow_patterns=["*.json", "*.safetensors"],
        )
    )


def load_hf_config(folder: Path) -> Any:
    """The folder's `config.json` read by transformers' `AutoConfig` (imported when called).

    Raises:
        FileNotFoundError: the folder has no config.json.
    """
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {folder}; save_pretrained writes one next to the weights")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def pretrained_saver(layout_of: Callable[[Any], FileLayout]) -> Callable[..., None]:
    """A model package's `save_pretrained(model, save_directory, *, max_shard_size="5GB", safe_serialization=True,
    state_dict=None)`, writing what `layout_of(model)` (the package's `hf_file_layout`: names, dtypes, config.json)
    says, so a whole save and a streaming export follow one rule."""

    def save_pretrained(
        model: Any,
        save_directory: str | os.PathLike[str],
        *,
        max_shard_size: int | str | None = "5GB",
        safe_serialization: bool = True,
        state_dict: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Write `config.json` and the weights as the model package's `hf_file_layout(model)` names, types and
        leaves them out (e.g. a tied LM head); see it for the package's naming.

        Args:
            max_shard_size: above it ("5GB", "200MB" or bytes) the weights are split into
                `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`; None: one file.
            safe_serialization: only True (safetensors) is supported; False is refused.
            state_dict: the full state dict to write instead of `model.state_dict()` (transformers'
                `save_pretrained` option). For an expert-parallel model every rank calls
                `full = {**model.state_dict(), **am_moe.gather_expert_state_dict(model)}` (collective: the experts
                are gathered back to `[E, out, in]`), then one rank calls `model.save_pretrained(folder,
                state_dict=full)`; the layout writes the file's expert keys.

        Raises:
            ValueError: sharded DTensors (expert parallel / FSDP2) in what would be written, or a state_dict whose
                keys differ from the model's (all listed); safe_serialization=False.
        """
        from torch.distributed.tensor import DTensor

        own = model.state_dict()
        tensors = dict(own if state_dict is None else state_dict)
        problems = []
        if state_dict is not None:
            missing = sorted(set(own) - set(tensors))
            unexpected = sorted(set(tensors) - set(own))
            if missing:
                problems.append(f"state_dict lacks {len(missing)} of the model's keys: {missing[:5]}")
            if unexpected:
                problems.append(f"state_dict has {len(unexpected)} keys the model does not: {unexpected[:5]}")
        sharded = sorted(k for k, v in tensors.items() if isinstance(v, DTensor))
        if sharded:
            problems.append(
                f"{len(sharded)} tensors are sharded DTensors (expert parallel / FSDP2), e.g. {sharded[:3]}: gather "
                "them on every rank first — `{**model.state_dict(), **am_moe.gather_expert_state_dict(model)}` for "
                "expert parallelism, `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))` "
                "with FSDP2 — and pass the result as state_dict= on one rank"
            )
        if problems:
            raise ValueError("save_pretrained needs the full state dict of the model:\n  - " + "\n  - ".join(problems))
        if not safe_serialization:
            raise ValueError(
                "safe_serialization=False (pickled pytorch_model.bin) is not supported: checkpoints are written as "
                "safetensors only, which transformers loads the same way; drop the argument"
            )
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        layout = layout_of(model)
        layout.write_metadata(folder)
        write_safetensors(layout.to_file(tensors), folder, max_shard_size=max_shard_size)

    return save_pretrained
