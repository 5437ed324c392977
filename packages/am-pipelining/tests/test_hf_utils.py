"""Patched HF forwards reproduce HF's own forward (unsplit), the VLM vision path really runs, masks are built once
per stage, and validation lists every real blocker with its fix."""

from __future__ import annotations

import copy

import _models as M
import pytest
import torch
from torch import nn

from am_pipelining import (
    MULTIMODAL_SUFFIXES,
    TEXT_MODULE_ATTRS,
    get_text_module,
    init_hf_model_buffers,
    model_keeps_self_forward,
    patch_hf_model_for_pp,
    validate_hf_model_for_pipeline_support,
)
from am_pipelining.hf_utils import _build_or_reuse_pp_causal_mask

EXPECTED_FORWARDS = {
    "llama": ("pipeline_forward_causal_lm", "pipeline_forward"),
    "qwen3": ("pipeline_forward_causal_lm", "pipeline_forward"),
    "mistral": ("pipeline_forward_causal_lm", "pipeline_forward"),
    "gemma4": ("pipeline_forward_causal_lm", "pipeline_forward_gemma4_text"),
    "gemma4_vlm": ("pipeline_forward_gemma4_vlm", "pipeline_forward_gemma4_text"),
    "mistral3_vlm": ("pipeline_forward_mistral3_vlm", "pipeline_forward"),
}


@pytest.mark.parametrize("name", list(EXPECTED_FORWARDS))
def test_patched_forward_matches_hf_forward(name):
    model = M.FACTORIES[name](2)
    data = M.batch(name, 2)
    reference = M.reference_forward(model, name, data)
    patched = patch_hf_model_for_pp(copy.deepcopy(model))
    outer, inner = EXPECTED_FORWARDS[name]
    assert patched.forward.__name__ == outer
    text = patched.model.language_model if name.endswith("vlm") else patched.model
    assert text.forward.__name__ == inner
    out = patched(data["input_ids"], **M.media_kwargs(name, data))
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gemma4_vlm", "mistral3_vlm"])
def test_vlm_first_stage_runs_the_vision_path(name):
    model = patch_hf_model_for_pp(M.FACTORIES[name](2))
    data = M.batch(name, 1)
    media = M.media_kwargs(name, data)
    with_image = model(data["input_ids"], **media)
    other = dict(media, pixel_values=torch.rand_like(media["pixel_values"]))
    changed = model(data["input_ids"], **other)
    image_rows = data["input_ids"][0] == M.IMAGE_TOKEN
    assert not torch.allclose(with_image[0, image_rows], changed[0, image_rows]), "pixels did not reach the logits"
    # Text before the first image token cannot see the image (causal), so those logits are unchanged.
    torch.testing.assert_close(with_image[0, 0], changed[0, 0])


def test_vlm_media_chunks_are_taken_per_microbatch():
    model = patch_hf_model_for_pp(M.mistral3_vlm(2))
    data = M.batch("mistral3_vlm", 2)
    direct = model(data["input_ids"][:1], pixel_values=data["pixel_values"][:1], image_sizes=data["image_sizes"][:1])
    model._vlm_pixel_values_chunks = [data["pixel_values"][:1], data["pixel_values"][1:]]
    model._vlm_image_grid_hws_chunks = [data["image_sizes"][:1], data["image_sizes"][1:]]
    staged = model(data["input_ids"][:1])
    assert model._vlm_chunk_idx == 1
    torch.testing.assert_close(staged, direct)
    text_only = data["input_ids"][:1].clone()
    text_only[text_only == M.IMAGE_TOKEN] = 3
    model(text_only)
    assert model._vlm_chunk_idx == 1, "a micro-batch without image tokens must not consume a media chunk"


def test_gemma4_logits_are_soft_capped():
    model = patch_hf_model_for_pp(M.gemma4_text(2))
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    out = model(M.batch("gemma4", 1)["input_ids"])
    assert out.abs().max() <= 3.0
    assert out.abs().max() > 2.5


def test_non_first_stage_takes_hidden_states_in_input_ids_slot():
    model = M.llama(2)
    hidden = torch.randn(1, M.SEQ, 16)
    inner = patch_hf_model_for_pp(copy.deepcopy(model)).model
    inner.embed_tokens = None
    out = inner(hidden)
    assert out.shape == (1, M.SEQ, 16)
    with pytest.raises(ValueError, match="inputs_embeds must be provided for pipeline stages without embed_tokens"):
        inner(torch.zeros(1, M.SEQ, dtype=torch.long))
    outer = patch_hf_model_for_pp(copy.deepcopy(model))
    outer.model = None
    with pytest.raises(ValueError, match="Expected hidden states as input for pipeline stage without inner model"):
        outer(torch.zeros(1, 4, dtype=torch.long))
    assert outer(hidden, logits_to_keep=3).shape == (1, 3, M.VOCAB)
    outer._pp_return_hidden_states = True
    torch.testing.assert_close(outer(hidden), hidden)


def test_mask_cache_builds_once_without_mask_and_every_call_with_one():
    model = patch_hf_model_for_pp(M.qwen3(2))
    ids = M.batch("qwen3", 2)["input_ids"]
    for _ in range(3):
        model(ids)
    assert model.model._pp_mask_builds == 1
    for _ in range(3):
        model(ids, attention_mask=torch.ones_like(ids))
    assert model.model._pp_mask_builds == 4
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    model(ids, position_ids=packed)
    assert model.model._pp_mask_builds == 5, "packed positions must rebuild (the mask depends on them)"
    model(ids[:, :4])
    assert model.model._pp_mask_builds == 6, "a new sequence length is a new cache entry"


def test_mask_cache_is_keyed_by_batch_size():
    """A forward with another batch size (evaluation, a smaller last batch) must not reuse a mask built for the
    training microbatch: eager masks are [B, 1, S, S] and would broadcast the batch."""
    model = patch_hf_model_for_pp(M.llama(2))
    reference = M.llama(2)
    ids = M.batch("llama", 2)["input_ids"]
    model(ids)
    single = model(ids[:1])
    assert single.shape == (1, M.SEQ, M.VOCAB)
    torch.testing.assert_close(single, M.reference_forward(reference, "llama", {"input_ids": ids[:1]}))
    model(ids)
    assert model.model._pp_mask_builds == 2, "one build per batch size, then reuse"


def test_mask_mapping_holds_sliding_mask_for_sliding_layers():
    model = M.gemma4_text(2)
    text = model.model
    mapping = _build_or_reuse_pp_causal_mask(
        text, torch.zeros(1, M.SEQ, 16), None, mask_types={"full_attention", "sliding_attention"}
    )
    full, sliding = mapping["full_attention"], mapping["sliding_attention"]
    assert full is not None
    assert sliding is not None
    assert not torch.equal(full, sliding)
    passthrough = {"full_attention": None}
    assert _build_or_reuse_pp_causal_mask(text, torch.zeros(1, 4, 16), passthrough) is passthrough


def test_get_text_module_and_constants():
    assert TEXT_MODULE_ATTRS[0] == "language_model"
    assert "vision_tower" in MULTIMODAL_SUFFIXES
    assert len(MULTIMODAL_SUFFIXES) == 15
    holder = nn.Module()
    holder.language_model = None
    holder.text_model = nn.Linear(1, 1)
    assert get_text_module(holder) is holder.text_model
    assert get_text_module(nn.Linear(1, 1)).__class__ is nn.Linear
    assert get_text_module(None) is None


def test_init_buffers_recomputes_inv_freq_after_meta_construction():
    with torch.device("meta"):
        model = M.llama(2)
    model = model.to_empty(device="cpu")
    init_hf_model_buffers(model, "cpu")
    reference = M.llama(2).model.rotary_emb.inv_freq
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference)


def test_keep_self_forward_flag():
    assert model_keeps_self_forward(M.HookedMTPModel(2))
    assert not model_keeps_self_forward(M.llama(2))


def test_validation_accepts_supported_models_including_tied_embeddings():
    for name in ("llama_tied", "qwen3", "gemma4", "gemma4_vlm", "mistral3_vlm"):
        validate_hf_model_for_pipeline_support(M.FACTORIES[name](2))
    validate_hf_model_for_pipeline_support(nn.Linear(2, 2))


def test_validation_lists_every_blocker_with_its_fix():
    from transformers import Gemma4ForCausalLM

    config = M._gemma4_text_config(4, tied=True)
    config.hidden_size_per_layer_input = 4
    config.num_kv_shared_layers = 2
    config.is_encoder_decoder = True
    model = Gemma4ForCausalLM(config)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="not compatible with pipeline parallelism") as error:
        validate_hf_model_for_pipeline_support(model)
    message = str(error.value)
    for expected in (
        "1. Encoder-Decoder",
        "2. Gemma 4 per-layer inputs",
        "3. num_kv_shared_layers=2",
        "4. Reentrant activation checkpointing",
        "Fix:",
    ):
        assert expected in message


def _tiny_llava():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        text_config={
            "model_type": "llama",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 64,
        },
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 8,
            "patch_size": 4,
        },
    )
    return LlavaForConditionalGeneration(config)


def test_validation_rejects_vlms_without_a_pipeline_aware_forward():
    model = _tiny_llava()
    with pytest.raises(ValueError, match=r"not on the pipeline-aware list \(gemma4, mistral3\)"):
        validate_hf_model_for_pipeline_support(model)
    type(model)._pp_keep_self_forward = True
    try:
        validate_hf_model_for_pipeline_support(model)
    finally:
        del type(model)._pp_keep_self_forward


def test_a_vlm_is_supported_by_adding_a_table_entry():
    """Registering an architecture's forwards makes validation accept it and patching use them (no code branch)."""
    from am_pipelining.hf_utils import PIPELINE_FORWARDS, register_pipeline_forward

    def outer_forward_factory():
        def pipeline_forward_llava(self, input_ids=None, **kwargs):
            return input_ids

        return pipeline_forward_llava

    model = _tiny_llava()
    assert "llava" not in PIPELINE_FORWARDS
    with pytest.raises(ValueError, match="needs an outer_forward"):
        register_pipeline_forward("llava", multimodal=True)
    register_pipeline_forward("llava", outer_forward=outer_forward_factory, multimodal=True)
    try:
        validate_hf_model_for_pipeline_support(model)
        patch_hf_model_for_pp(model)
        assert model.forward.__name__ == "pipeline_forward_llava"
        assert model.model.language_model.forward.__name__ == "pipeline_forward"  # the generic text forward
        with pytest.raises(ValueError, match=r"pipeline-aware list \(gemma4, llava, mistral3\)"):
            validate_hf_model_for_pipeline_support(_tiny_vlm_of_another_kind())
    finally:
        del PIPELINE_FORWARDS["llava"]


def _tiny_vlm_of_another_kind():
    model = _tiny_llava()
    model.config.model_type = "not_registered_vlm"
    return model


@pytest.mark.parametrize("name", ["llama", "gemma4"])
def test_a_stage_without_positions_asks_the_models_position_hook(name):
    """A non-first stage receives hidden states only: its positions come from the text module's
    `pipeline_default_position_ids(hidden)` hook (e.g. a CP shard's global positions) when it returns some, else
    arange(S). Checked against the same stage given those positions explicitly."""
    model = patch_hf_model_for_pp(copy.deepcopy(M.FACTORIES[name](2)))
    inner = model.model
    inner.embed_tokens = None
    hidden = torch.randn(1, M.SEQ, inner.config.hidden_size)
    shifted = torch.arange(M.SEQ, 2 * M.SEQ).unsqueeze(0)
    plain = inner(hidden)
    explicit = inner(hidden, position_ids=shifted)
    assert not torch.allclose(plain, explicit), "positions matter to this stage"
    inner.pipeline_default_position_ids = lambda h: shifted
    torch.testing.assert_close(inner(hidden), explicit)
    inner.pipeline_default_position_ids = lambda h: None
    torch.testing.assert_close(inner(hidden), plain)
