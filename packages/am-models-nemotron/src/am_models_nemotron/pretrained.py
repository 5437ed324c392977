"""Loading and saving `NemotronHForCausalLM` like transformers: the `from_pretrained` / `save_pretrained` methods.

What it is for: the model-class entry points of `checkpoint` (transformers' keywords, hub ids, lazy loading).
What it must not do: hold any checkpoint logic itself (`checkpoint` does), or import the model module (a cycle).
"""

from __future__ import annotations

from typing import Any, Self

import torch

from am_precision import BackendConfig

__all__ = ["NemotronPretrainedMixin"]


class NemotronPretrainedMixin:
    """`from_pretrained` / `save_pretrained` of the causal LM."""

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: Any,
        backend: BackendConfig | None = None,
        *,
        torch_dtype: Any = None,
        dtype: Any = None,
        device_map: Any = None,
        device: torch.device | str | None = None,
        revision: str | None = None,
        **kwargs: Any,
    ) -> Self:
        """Load an HF-format folder or hub id (config.json + safetensors, single or sharded) tensor by tensor.

        transformers' keywords: `torch_dtype` / `dtype` (fp32-pinned tensors stay fp32), `device_map` (None, "cpu"
        or one device; splitting is refused), `revision`, `config`, `cache_dir`, `token`, `local_files_only`,
        `force_download`; other keywords are the constructor's. See `checkpoint.load_pretrained`.
        """
        from .checkpoint import load_pretrained

        return load_pretrained(
            cls,
            pretrained_model_name_or_path,
            backend=backend,
            torch_dtype=torch_dtype,
            dtype=dtype,
            device_map=device_map,
            device=device,
            revision=revision,
            **kwargs,
        )

    def save_pretrained(
        self,
        save_directory: Any,
        *,
        max_shard_size: int | str | None = "5GB",
        safe_serialization: bool = True,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write config.json + safetensors in NVIDIA's naming (shards + index above `max_shard_size`; only
        `safe_serialization=True`); `state_dict` (full tensors) replaces the model's own, e.g. the gathered experts
        of an expert-parallel model. See `checkpoint.save_pretrained`."""
        from .checkpoint import save_pretrained

        save_pretrained(
            self,
            save_directory,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            state_dict=state_dict,
        )
