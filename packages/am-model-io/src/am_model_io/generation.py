"""The `generate()` hooks a model with its own cache answers the same way, whatever its architecture.

What it is for: `OwnCacheGenerationHooks`, placed before transformers' `GenerationMixin` in a model's generation
mixin (`class MyGenerationMixin(OwnCacheGenerationHooks, GenerationMixin)`), so the answers below win over
transformers' defaults: the model can generate although it is a plain `nn.Module`, and its experts have one
implementation (nothing for transformers to switch while decoding).
What it must not do: import transformers (the model packages' mixins do), or know a cache class (each model's
`prepare_inputs_for_generation` builds its own).
"""

from __future__ import annotations

from typing import Any

__all__ = ["OwnCacheGenerationHooks"]


class OwnCacheGenerationHooks:
    """transformers' `GenerationMixin` hooks with the answers of a model that brings its own cache and experts."""

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def get_experts_implementation(self) -> dict[str, str]:
        """GenerationMixin hook: our experts have one implementation, nothing to switch while decoding."""
        return {}

    def set_experts_implementation(self, implementation: Any) -> None:
        """GenerationMixin hook (no-op, see `get_experts_implementation`)."""
