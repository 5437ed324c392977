"""Loading and saving the Gemma 4 models like transformers: `from_pretrained` / `save_pretrained` of both classes.

What it is for: the model-class entry points of `checkpoint` (transformers' keywords, hub ids, lazy loading).
What it must not do: hold checkpoint logic itself (`checkpoint` does), or import the model modules (a cycle).
"""

from __future__ import annotations

import os
from typing import Any, Self, cast

import torch
from torch import nn

__all__ = ["Gemma4PretrainedMixin"]


class Gemma4PretrainedMixin:
    """`from_pretrained` / `save_pretrained` of `Gemma4ForCausalLM` and `Gemma4ForConditionalGeneration`."""

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        *,
        torch_dtype: Any = None,
        dtype: Any = None,
        device_map: Any = None,
        device: Any = None,
        revision: str | None = None,
        **kwargs: Any,
    ) -> Self:
        """Load a transformers-format folder or hub id (config.json + safetensors, single or sharded) tensor by
        tensor; every parameter must be present.

        transformers' keywords: `torch_dtype` / `dtype` (fp32-pinned tensors stay fp32), `device_map` (None, "cpu"
        or one device; splitting is refused), `revision`, `config`, `cache_dir`, `token`, `local_files_only`,
        `force_download`. See `checkpoint.load_pretrained`.
        """
        from .checkpoint import load_pretrained

        return cast(  # the concrete model class this mixin is part of
            Self,
            load_pretrained(
                cast(type[nn.Module], cls),
                pretrained_model_name_or_path,
                torch_dtype=torch_dtype,
                dtype=dtype,
                device_map=device_map,
                device=device,
                revision=revision,
                **kwargs,
            ),
        )

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        *,
        max_shard_size: int | str | None = "5GB",
        safe_serialization: bool = True,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write a folder the same transformers class's `from_pretrained` loads.

        The tied head is saved once; shards + index above `max_shard_size`; only `safe_serialization=True`;
        `state_dict` (full tensors) replaces the model's own, e.g. the gathered experts of an expert-parallel model
        (see `checkpoint.save_pretrained`).
        """
        from .checkpoint import save_pretrained

        save_pretrained(
            cast(nn.Module, self),
            save_directory,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            state_dict=state_dict,
        )
