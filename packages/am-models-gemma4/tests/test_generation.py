"""Generation with `Gemma4HybridCache`, against full forwards and against transformers (fp32, same weights).

Every config mixes sliding and full layers with a sliding window (4) shorter than the prompts (9 and more tokens),
full layers with `global_head_dim`, K=V and proportional RoPE; the third has per-layer inputs and KV sharing (the
last two layers reuse the K/V of the first two). Checked: the logits of every cached step equal a full forward over
the same prefix (1e-5), with and without left padding, including a multi-token step after the prefill; greedy and
beam-search `generate` give transformers' tokens, and greedy gives its logits at every step; the VLM generates
from a prompt with an image as transformers does; training forwards create no cache; wrong inputs are refused.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from _g4_configs import IMAGE_TOKEN, VOCAB, image_inputs, perturb_, text_config, vlm_config
from transformers import DynamicCache
from transformers import Gemma4ForCausalLM as HFGemma4ForCausalLM
from transformers import Gemma4ForConditionalGeneration as HFGemma4ForConditionalGeneration

from am_models_gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4HybridCache

RTOL = 1e-5  # fp32, relative to the largest entry of the reference logits
CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {},
    "moe": {"moe": True},
    "ple-kv-sharing": {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True},
}


def _close(got: torch.Tensor, ref: torch.Tensor, *, rtol: float = RTOL) -> None:
    scale = ref.abs().max().clamp(min=1e-12)
    assert float((got - ref).abs().max() / scale) <= rtol, float((got - ref).abs().max() / scale)


def _prompt(batch: int, length: int, *, padded: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[B, L]` and attention mask; padded: row 1 starts with 3 pad tokens (left padding)."""
    ids = torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :3] = 0
        mask[1, :3] = 0
    return ids, mask


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Gemma4ForCausalLM]:
    torch.manual_seed(0)
    hf = HFGemma4ForCausalLM(text_config(**CONFIGS[request.param]))
    perturb_(hf)
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder)
    return hf.eval(), Gemma4ForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_each_cached_step_equals_a_full_forward_over_the_prefix(pair: Any, padded: bool) -> None:
    """Prefill 7 tokens, one step of 3 tokens, then one token per step up to 18: each step's logits equal those of
    a forward without cache over the tokens so far (positions counted from the first real token, as generate does)."""
    _, model = pair
    ids, mask = _prompt(2, 18, padded=padded, seed=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = Gemma4HybridCache(model.config)
    bounds = [0, 7, 10, *range(11, 19)]
    with torch.no_grad():
        for start, end in itertools.pairwise(bounds):
            out = model(
                ids[:, start:end],
                attention_mask=mask[:, :end],
                position_ids=positions[:, start:end],
                past_key_values=cache,
            )
            assert out.past_key_values is cache
            assert cache.get_seq_length() == end
            full = model(ids[:, :end], attention_mask=mask[:, :end], position_ids=positions[:, :end]).logits
            real = mask[:, start:end].bool()  # padded prompt positions have no meaningful logits
            _close(out.logits[real], full[:, start:end][real])


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_greedy_generate_equals_transformers(pair: Any, padded: bool) -> None:
    hf, ours = pair
    ids, mask = _prompt(2, 9, padded=padded, seed=2)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    expected = hf.generate(ids, **kwargs)
    actual = ours.generate(ids, **kwargs)
    assert torch.equal(actual.sequences, expected.sequences)
    assert actual.sequences.shape == (2, 9 + 12)
    for got, ref in zip(actual.logits, expected.logits, strict=True):
        _close(got, ref)


def test_beam_search_and_chunked_prefill_equal_transformers(pair: Any) -> None:
    """Beam search reorders the cache between steps; a chunked prefill continues the cache several tokens at once."""
    hf, ours = pair
    ids, mask = _prompt(2, 9, padded=True, seed=3)
    for kwargs in ({"num_beams": 3, "num_return_sequences": 2}, {"prefill_chunk_size": 4}):
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **kwargs)
        actual = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **kwargs)
        assert torch.equal(actual, expected), kwargs


def test_training_forward_keeps_no_cache(pair: Any) -> None:
    _, model = pair
    ids, _ = _prompt(2, 9, padded=False)
    assert model(ids).past_key_values is None
    cache = model(ids, use_cache=True).past_key_values
    assert isinstance(cache, Gemma4HybridCache)
    assert cache.get_seq_length() == 9


def test_inputs_a_cache_cannot_honour_are_refused() -> None:
    model = Gemma4ForCausalLM(text_config()).eval()
    ids, _ = _prompt(1, 6, padded=False)
    with pytest.raises(TypeError, match=r"DynamicCache.*Gemma4HybridCache"):
        model(ids, past_key_values=DynamicCache(config=model.config))
    with pytest.raises(TypeError, match=r"DynamicCache.*Gemma4HybridCache"):
        model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"_packed_seq_ids(.|\n)*attention_mask is a 4-D mask"):
        model(
            ids,
            attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool),
            _packed_seq_ids=torch.ones_like(ids),
            use_cache=True,
        )
    with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
        model.generate(ids, assistant_model=model, max_new_tokens=2)


@pytest.fixture(scope="module", params=[(False, None), (True, "vision")], ids=["dense", "moe-vision-bidirectional"])
def vlm_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    moe, bidirectional = request.param
    torch.manual_seed(0)
    hf = HFGemma4ForConditionalGeneration(vlm_config(moe=moe, use_bidirectional_attention=bidirectional))
    perturb_(hf)
    folder = tmp_path_factory.mktemp("hf_vlm")
    hf.save_pretrained(folder)
    return hf.eval(), Gemma4ForConditionalGeneration.from_pretrained(folder).eval()


def test_vlm_generates_from_an_image_prompt_as_transformers(vlm_pair: tuple[Any, Any]) -> None:
    """Two left-padded prompts, each with one image (4 soft tokens): tokens and step logits equal transformers'."""
    hf, ours = vlm_pair
    ids, mask = _prompt(2, 14, padded=True, seed=4)
    ids = ids.clamp(max=IMAGE_TOKEN - 5)
    ids[:, 5:9] = IMAGE_TOKEN
    pixel_values, positions = image_inputs(2)
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": pixel_values,
        "image_position_ids": positions,
        "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
    }
    kwargs = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)
    expected = hf.generate(**batch, **kwargs)
    actual = ours.generate(**batch, **kwargs)
    assert torch.equal(actual.sequences, expected.sequences)
    for got, ref in zip(actual.logits, expected.logits, strict=True):
        _close(got, ref)
    # guards the parity above: the image reaches the generated text
    other = ours.generate(**dict(batch, pixel_values=pixel_values + 1.0), **kwargs)
    assert not torch.allclose(other.logits[0], actual.logits[0])


def test_vlm_cached_steps_equal_full_forwards(vlm_pair: tuple[Any, Any]) -> None:
    """The VLM's decode steps (text tokens after an image prompt) against forwards over the whole sequence."""
    _, model = vlm_pair
    ids = torch.randint(2, IMAGE_TOKEN - 5, (1, 16), generator=torch.Generator().manual_seed(5))
    ids[0, 2:6] = IMAGE_TOKEN
    pixel_values, positions = image_inputs(1)
    types = (ids == IMAGE_TOKEN).long()
    images = {"pixel_values": pixel_values, "image_position_ids": positions}
    cache = Gemma4HybridCache(model.config)
    with torch.no_grad():
        steps = [model(ids[:, :9], mm_token_type_ids=types[:, :9], past_key_values=cache, **images).logits[:, -1]]
        steps += [model(ids[:, t : t + 1], past_key_values=cache).logits[:, -1] for t in range(9, 16)]
        full = model(ids, mm_token_type_ids=types, **images).logits[:, 8:]
    _close(torch.stack(steps, dim=1), full)
