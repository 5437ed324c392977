"""Tiny Gemma 4 configs shared by the tests (hidden 32, 4 layers: sliding, full, sliding, full; vocab 100)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Gemma4Config, Gemma4TextConfig
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

VOCAB = 100
IMAGE_TOKEN = 99
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def text_kwargs(*, moe: bool = False, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=4,
        layer_types=list(LAYER_TYPES),
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=30.0,
        pad_token_id=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
    )
    if moe:
        kwargs.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
    kwargs.update(overrides)
    return kwargs


def text_config(*, moe: bool = False, **overrides: Any) -> Gemma4TextConfig:
    return Gemma4TextConfig(**text_kwargs(moe=moe, **overrides))


def vlm_config(*, moe: bool = False, **overrides: Any) -> Gemma4Config:
    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=2,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    return Gemma4Config(
        text_config=text_kwargs(moe=moe, **overrides),
        vision_config=vision.to_dict(),
        image_token_id=IMAGE_TOKEN,
        boi_token_id=97,
        eoi_token_id=98,
        audio_token_id=96,
        video_token_id=95,
    )


def image_inputs(num_images: int = 1, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values `[N, 16, 12]` (4x4 patches of 2x2x3) and their (x, y) positions: 4 soft tokens per image."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
    return torch.randn(num_images, 16, 12, generator=gen), grid.expand(num_images, 16, 2).contiguous()


def perturb_(model: torch.nn.Module, *, seed: int = 0) -> None:
    """Move norms, scales and layer scalars away from their ones/zeros init so they matter in parity tests."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "scale" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.fill_(0.8)
