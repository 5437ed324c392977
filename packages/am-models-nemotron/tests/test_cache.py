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
