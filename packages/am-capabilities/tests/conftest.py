"""Shared fixtures: tiny real HuggingFace models (hidden 16-32, 1-2 layers) and registry hygiene.

transformers is a test-only dependency; tests that need it skip when it is absent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.nn as nn

import am_capabilities


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    """Each test starts and ends with a rescanned entry-point registry."""
    am_capabilities.clear_registry_cache()
    yield
    am_capabilities.clear_registry_cache()


@pytest.fixture(scope="session")
def hf() -> Any:
    return pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def tiny_llama(hf: Any) -> Callable[..., nn.Module]:
    """Factory: a tiny ``LlamaForCausalLM`` (or ``LlamaModel`` with ``base=True``)."""

    def build(*, base: bool = False) -> nn.Module:
        config = hf.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,  # tp=2 divides the KV heads (test_validation refuses 1 at tp=2)
        )
        return hf.LlamaModel(config) if base else hf.LlamaForCausalLM(config)

    return build


@pytest.fixture(scope="session")
def tiny_nemotron_h(hf: Any) -> Callable[..., nn.Module]:
    """Factory: a tiny HF ``NemotronHForCausalLM``; pass ``layers_block_type=[...]`` or
    ``hybrid_override_pattern="M*"`` to choose the layer kinds."""

    def build(**layer_spec: Any) -> nn.Module:
        config = hf.NemotronHConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=8,
            n_groups=1,
            chunk_size=8,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            **layer_spec,
        )
        return hf.NemotronHForCausalLM(config)

    return build


def gemma4_text_config(hf: Any, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size_per_layer_input=64,
        hidden_size_per_layer_input=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    kwargs.update(overrides)
    return hf.Gemma4TextConfig(**kwargs)


_GEMMA4_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8
)


@pytest.fixture(scope="session")
def tiny_gemma4(hf: Any) -> Callable[..., nn.Module]:
    """Factory: tiny ``Gemma4ForCausalLM`` (``vlm=False``) or ``Gemma4ForConditionalGeneration`` (``vlm=True``)."""

    def build(*, vlm: bool = False) -> nn.Module:
        text = gemma4_text_config(hf)
        if not vlm:
            return hf.Gemma4ForCausalLM(text)
        config = hf.Gemma4Config(text_config=text.to_dict(), vision_config=dict(_GEMMA4_VISION), audio_config=None)
        return hf.Gemma4ForConditionalGeneration(config)

    return build


@pytest.fixture(scope="session")
def gemma4_config(hf: Any) -> Callable[..., Any]:
    """Factory for ``Gemma4Config`` objects (no model built): ``moe=True`` and/or ``audio=True`` variants."""

    def build(*, moe: bool = False, audio: bool = False) -> Any:
        moe_kwargs: dict[str, Any] = (
            dict(enable_moe_block=True, num_experts=2, top_k_experts=1, moe_intermediate_size=16) if moe else {}
        )
        text = gemma4_text_config(hf, **moe_kwargs)
        audio_config = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2) if audio else None
        return hf.Gemma4Config(
            text_config=text.to_dict(), vision_config=dict(_GEMMA4_VISION), audio_config=audio_config
        )

    return build


@pytest.fixture(scope="session")
def tiny_mistral3(hf: Any) -> Callable[[], nn.Module]:
    """Factory: a tiny ``Mistral3ForConditionalGeneration`` (Mistral text + Pixtral vision)."""

    def build() -> nn.Module:
        config = hf.Mistral3Config(
            text_config=dict(
                model_type="mistral",
                vocab_size=64,
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
            ),
            vision_config=dict(
                model_type="pixtral",
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                head_dim=8,
                image_size=32,
                patch_size=8,
            ),
        )
        return hf.Mistral3ForConditionalGeneration(config)

    return build
