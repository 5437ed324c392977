"""Rebuild the non-persistent rotary buffers of an HF model materialised from the meta device.

A model built on the meta device and materialised with `to_empty` holds garbage in its non-persistent buffers
(checkpoints do not carry them). `init_hf_model_buffers` recomputes every rotary `inv_freq` the way transformers
defines it: the module's `rope_type` picks the init function (`compute_default_rope_parameters` or another
`compute_*_rope_parameters` of the module for "default"/"axial"/..., `ROPE_INIT_FUNCTIONS[rope_type]` otherwise)
and `fn(config, device)` (per `layer_type` for modules with per-layer-type RoPE, e.g. Gemma 3) gives the values.
Every module holding an `inv_freq` buffer is covered, including a stage that keeps the rotary embedding without
layers; one that cannot be rebuilt is an error naming it, never skipped.

Never imports a model package of this repository; transformers is imported lazily.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["init_hf_model_buffers"]


def _rope_fn(module: nn.Module, rope_type: str) -> Any:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    own = getattr(module, f"compute_{rope_type}_rope_parameters", None)
    return own if callable(own) else ROPE_INIT_FUNCTIONS.get(rope_type)


def _inv_freq_buffers(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_buffers(recurse=False) if name.endswith("inv_freq")]


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor, device: torch.device | str) -> None:
    old = module._buffers.get(name)
    dtype = old.dtype if old is not None and old.dtype.is_floating_point else value.dtype
    module._buffers[name] = value.detach().to(device=device, dtype=dtype).clone()


def _rebuild(module: nn.Module, device: torch.device | str) -> str | None:
    """Recompute `module`'s rotary buffers on `device`; returns why it cannot, or None when done."""
    config = getattr(module, "config", None)
    rope_type = getattr(module, "rope_type", None)
    if config is None or rope_type is None:
        return "it has no `config` and `rope_type` to recompute its RoPE frequencies from"
    per_type = rope_type if isinstance(rope_type, dict) else {None: rope_type}
    written: set[str] = set()
    for layer_type, kind in per_type.items():
        fn = _rope_fn(module, str(kind))
        if fn is None:
            return f"no RoPE init function for rope_type={kind!r} (not in transformers' ROPE_INIT_FUNCTIONS)"
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        with torch.device("cpu"):  # the module may sit under a meta-device context
            inv_freq, _ = fn(config, device=torch.device("cpu"), **kwargs)
        prefix = "" if layer_type is None else f"{layer_type}_"
        for name in (f"{prefix}inv_freq", f"{prefix}original_inv_freq"):
            if name in module._buffers:
                _set_buffer(module, name, inv_freq, device)
                written.add(name)
    left = [name for name in _inv_freq_buffers(module) if name not in written]
    if left:
        return f"buffers {left} do not match its rope_type {rope_type!r}"
    return None


def init_hf_model_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Recompute every rotary `inv_freq` buffer (and `original_inv_freq`, per-layer-type variants) on `device`.

    Needed after building a model on the meta device and materialising it with `to_empty`: non-persistent buffers
    are not in checkpoints. The values equal those of a model built normally (same dtype as the buffer).

    Raises:
        ValueError: naming every module with an `inv_freq` buffer that cannot be rebuilt (no `config`/`rope_type`,
            an unknown rope type, or buffers that do not follow transformers' naming).
    """
    problems = []
    for name, module in model.named_modules():
        if not _inv_freq_buffers(module):
            continue  # no frequency buffers (also a rotary module that computes them on the fly): nothing to rebuild
        why = _rebuild(module, device)
        if why is not None:
            problems.append(f"{name or '<root>'} ({type(module).__name__}): {why}")
    if problems:
        raise ValueError(
            "init_hf_model_buffers cannot rebuild these rotary buffers, which would stay uninitialised:\n"
            + "\n".join(f"- {p}" for p in problems)
            + "\nFix: give the module `config` and `rope_type` as transformers' rotary embeddings do, or "
            "initialise its buffers yourself after `to_empty`."
        )
