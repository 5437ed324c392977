"""`init_hf_model_buffers` after a meta-device build: every rotary buffer equals a normally built model's (RoPE
scaling and per-layer-type RoPE included, and on a stage that keeps the rotary embedding without layers); a
rotary buffer it cannot rebuild is an error naming the module."""

from __future__ import annotations

import _arch_models as A
import pytest
import torch
from torch import nn

from am_pipelining import build_stage_modules, init_hf_model_buffers


def _meta_then_init(name: str) -> nn.Module:
    with torch.device("meta"):
        model = A.build_uninitialised(name)
    model = model.to_empty(device="cpu")
    init_hf_model_buffers(model, "cpu")
    return model


def _rotary_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}


# llama: linear RoPE scaling; qwen2: yarn scaling; gemma3-text and olmo3: per-layer-type RoPE; stablelm: partial.
@pytest.mark.parametrize("name", ["llama", "qwen2-yarn", "gemma3-text", "olmo3", "stablelm"])
def test_meta_built_rotary_buffers_equal_a_normal_build(name):
    reference = _rotary_buffers(A.build_uninitialised(name))
    rebuilt = _rotary_buffers(_meta_then_init(name))
    assert reference, "the architecture has rotary buffers"
    assert rebuilt.keys() == reference.keys()
    for buffer_name, value in reference.items():
        assert rebuilt[buffer_name].device.type == "cpu"
        torch.testing.assert_close(rebuilt[buffer_name], value, rtol=0, atol=0, msg=buffer_name)


def test_a_stage_that_keeps_the_rotary_embedding_without_layers_is_initialised():
    with torch.device("meta"):
        model = A.build_uninitialised("gemma3-text")
    names = [
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.rotary_emb"],
        ["model.rotary_emb", "model.norm", "lm_head"],
    ]
    last = build_stage_modules(model, names, [1])[0].to_empty(device="cpu")
    assert len(last.model.layers) == 0
    init_hf_model_buffers(last, "cpu")
    reference = _rotary_buffers(A.build_uninitialised("gemma3-text"))
    for buffer_name, value in _rotary_buffers(last).items():
        torch.testing.assert_close(value, reference[buffer_name], rtol=0, atol=0)


class _HomeMadeRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)


def test_a_rotary_buffer_that_cannot_be_rebuilt_is_an_error_naming_the_module():
    model = A.build_uninitialised("llama")
    model.model.extra = _HomeMadeRotary()
    model.model.rotary_emb.rope_type = "not-a-rope-type"
    with pytest.raises(ValueError, match="cannot rebuild") as error:
        init_hf_model_buffers(model, "cpu")
    message = str(error.value)
    assert "model.extra (_HomeMadeRotary): it has no `config` and `rope_type`" in message
    assert "model.rotary_emb (LlamaRotaryEmbedding): no RoPE init function for rope_type='not-a-rope-type'" in message
