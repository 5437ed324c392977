"""Generation state: a prefill plus one-token steps through `NemotronHybridCache` equals the full forward at every
position; greedy `generate` equals transformers' token for token; cache bookkeeping."""

from __future__ import annotations

import pytest
import torch
from am_nemotron_helpers import assert_close_rel, hf_model, save_hf, tiny_hf_config, tokens

from am_models_nemotron import NemotronConfig, NemotronHForCausalLM, NemotronHybridCache

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    hf = hf_model(tiny_hf_config("M*EM-*"), seed=7)
    ours = NemotronHForCausalLM.from_pretrained(save_hf(hf, tmp_path_factory.mktemp("gen"))).eval()
    return hf, ours


def test_prefill_and_decode_equal_the_full_forward_at_every_position(pair) -> None:
    _, model = pair
    ids = tokens(2, 18, seed=1)
    with torch.no_grad():
        full = model(ids).logits
        cache = NemotronHybridCache(model.config, 2)
        step_logits = [model(ids[:, :7], past_key_values=cache, use_cache=True).logits]
        for t in range(7, 18):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            step_logits.append(out.logits)
    assert_close_rel(torch.cat(step_logits, dim=1), full, rtol=FP32_TOL, what="incremental logits")
    assert cache.get_seq_length() == 18


def test_greedy_generate_equals_transformers(pair) -> None:
    hf, ours = pair
    prompt = tokens(2, 9, seed=2)
    expected = hf.generate(prompt, max_new_tokens=10, do_sample=False)
    actual = ours.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(actual, expected)


def test_greedy_generate_with_left_padding_equals_transformers(pair) -> None:
    hf, ours = pair
    prompt = tokens(2, 9, seed=3)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    prompt[1, :3] = 0
    expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False)
    actual = ours.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(actual, expected)


def test_cache_shapes_dtypes_and_reorder() -> None:
    cfg = NemotronConfig.from_any(tiny_hf_config("M*M"))
    cache = NemotronHybridCache(cfg, 3, dtype=torch.bfloat16)
    assert set(cache.conv_states) == set(cache.ssm_states) == {0, 1, 2}  # every layer has its slot (upstream)
    assert cache.conv_states[0].shape == (3, 32 + 2 * 2 * 8, 4)
    assert cache.ssm_states[0].shape == (3, 4, 8, 8)
    assert cache.ssm_states[0].dtype == torch.float32
    assert cache.conv_states[0].dtype == torch.bfloat16
    assert cache.get_seq_length() == 0
    k = torch.randn(3, 2, 4, 8)
    cache.update(k, k, 1)
    full_k, _ = cache.update(k[:, :, :1], k[:, :, :1], 1)
    assert full_k.shape[2] == 5
    assert cache.get_seq_length() == 5
    cache.ssm_states[0][:, 0, 0, 0] = torch.tensor([0.0, 1.0, 2.0])
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert cache.ssm_states[0][:, 0, 0, 0].tolist() == [2.0, 0.0, 1.0]
    assert torch.equal(cache.key_cache[1][0], full_k[2])


def test_prepare_inputs_for_generation_returns_what_generate_and_the_seed_expect(pair) -> None:
    """Prefill: the prompt, a fresh hybrid cache (replacing a transformers cache), cache_position = arange(P), an
    additive causal mask [B, 1, P, P]; decode: the last token, cache_position [kv] (a longer one trimmed to its last
    element), a zero mask [B, 1, 1, kv]. With inputs_embeds the prompt length comes from the embeddings."""
    from transformers import DynamicCache

    _, model = pair
    ids = tokens(2, 7, seed=4)
    first = model.prepare_inputs_for_generation(
        ids, past_key_values=DynamicCache(), attention_mask=torch.ones_like(ids)
    )
    assert isinstance(first["past_key_values"], NemotronHybridCache)
    assert torch.equal(first["input_ids"], ids)
    assert first["use_cache"] is True
    assert torch.equal(first["cache_position"], torch.arange(7))
    mask = first["causal_mask_mapping"]["full_attention"]
    assert mask.shape == (2, 1, 7, 7)
    assert mask.dtype == model.dtype
    assert torch.equal(mask[0, 0] == 0, torch.ones(7, 7, dtype=torch.bool).tril())
    with torch.no_grad():
        out = model(**first)
    assert out.logits.shape == (2, 1, model.config.vocab_size)

    grown = torch.cat([ids, out.logits.argmax(-1)], dim=1)
    step = model.prepare_inputs_for_generation(
        grown, past_key_values=out.past_key_values, cache_position=torch.arange(8), attention_mask=None
    )
    assert torch.equal(step["input_ids"], grown[:, -1:])
    assert step["cache_position"].tolist() == [7]
    assert torch.equal(step["causal_mask_mapping"]["full_attention"], torch.zeros(2, 1, 1, 8))
    with torch.no_grad():
        model(**step)  # the backbone accepts the position: it is the cache's next one
    embeds = model.get_input_embeddings()(ids[:, :5])
    from_embeds = model.prepare_inputs_for_generation(ids[:, :0], inputs_embeds=embeds)
    assert "input_ids" not in from_embeds
    assert from_embeds["inputs_embeds"] is embeds
    assert from_embeds["causal_mask_mapping"]["full_attention"].shape == (2, 1, 5, 5)
    assert torch.equal(from_embeds["cache_position"], torch.arange(5))


@pytest.mark.parametrize("pattern", ["M-M", "M*EM-*"])
def test_greedy_generate_from_inputs_embeds_equals_transformers(pattern: str, tmp_path) -> None:
    """With and without attention layers (the sequence length then comes from the cache's token count): greedy
    generate equals transformers' token for token, and so do the new tokens of a prompt given as embeddings
    (transformers' Nemotron-H generates neither from embeddings nor without attention layers: the reference is its
    full forward, one greedy token at a time, without a cache)."""
    hf = hf_model(tiny_hf_config(pattern), seed=11)
    ours = NemotronHForCausalLM.from_pretrained(save_hf(hf, tmp_path)).eval()
    prompt = tokens(2, 6, seed=5)
    embeds = hf.get_input_embeddings()(prompt).detach()
    expected = _greedy_without_cache(hf, prompt, 6)
    assert torch.equal(ours.generate(prompt, max_new_tokens=6, do_sample=False), expected)
    from_embeds = ours.generate(inputs_embeds=embeds, max_new_tokens=6, do_sample=False)
    assert torch.equal(from_embeds, expected[:, prompt.shape[1] :])


@torch.no_grad()
def _greedy_without_cache(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    ids = prompt
    for _ in range(new_tokens):
        ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids


def test_cache_of_a_model_without_attention_counts_its_tokens() -> None:
    cfg = tiny_hf_config("M-M")
    model = NemotronHForCausalLM(cfg).eval()
    cache = NemotronHybridCache(cfg, 1)
    with torch.no_grad():
        model(tokens(1, 5), past_key_values=cache, use_cache=True)
        model(tokens(1, 1), past_key_values=cache, use_cache=True, cache_position=torch.tensor([5]))
    assert cache.get_seq_length() == cache.seen_tokens == 6
