"""The `generate()` hooks a model with its own cache answers the same way, whatever its architecture.

What it is for: `OwnCacheGenerationHooks`, placed before transformers' `GenerationMixin` in a model's generation
mixin (`class MyGenerationMixin(OwnCacheGenerationHooks, GenerationMixin)`), so the answers below win over
transformers' defaults: the model can generate although it is a plain `nn.Module` (with the `device` and `dtype`
that transformers' `PreTrainedModel` would give it and `generate` reads), and its experts have one implementation
(nothing for transformers to switch while decoding).
What it must not do: import transformers (the model packages' mixins do), or know a cache class (each model's
`prepare_inputs_for_generation` builds its own).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OwnCacheGenerationHooks"]


class OwnCacheGenerationHooks:
    """transformers' `GenerationMixin` hooks with the answers of a model that brings its own cache and experts.

    Mixed into an `nn.Module` subclass: `device` and `dtype` read the module's parameters.
    """

    @property
    def device(self) -> torch.device:
        """Where the first parameter lives (transformers' `PreTrainedModel.device`)."""
        return next(self.parameters()).device  # type: ignore[attr-defined]

    @property
    def dtype(self) -> torch.dtype:
        """The first floating-point parameter's dtype (fp32 when there is none), as transformers answers it."""
        for param in self.parameters():  # type: ignore[attr-defined]
            if param.is_floating_point():
                return param.dtype
        return torch.float32

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def get_experts_implementation(self) -> dict[str, str]:
        """GenerationMixin hook: our experts have one implementation, nothing to switch while decoding."""
        return {}

    def set_experts_implementation(self, implementation: Any) -> None:
        """GenerationMixin hook (no-op, see `get_experts_implementation`)."""
