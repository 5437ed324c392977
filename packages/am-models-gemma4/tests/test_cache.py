"""`Gemma4HybridCache` bookkeeping: what each layer keeps and returns (against concatenating everything), bounded
sliding-layer memory, no K/V for KV-shared layers, the recorded padding, beam reordering."""

from __future__ import annotations

import pytest
import torch
from _g4_configs import text_config

from am_models_gemma4 import Gemma4HybridCache, layer_head_dim, layer_num_kv_heads
from am_models_gemma4.config import kv_sharing_modes

WINDOW = 4  # text_config's sliding window


def _kv(config, layer: int, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (2, layer_num_kv_heads(config, layer), tokens, layer_head_dim(config, layer))
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def test_full_layers_return_every_token_and_sliding_layers_their_window() -> None:
    """A 9-token prefill, a 3-token chunk, then 300 single tokens (past the first buffer of a full layer, so it
    grows): every update returns exactly the reference K/V, and sliding buffers stay within their window (3 kept
    tokens and room for 1 at this window of 4)."""
    config = text_config()
    cache = Gemma4HybridCache(config)
    gen = torch.Generator().manual_seed(0)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for step, tokens in enumerate([9, 3] + [1] * 300):
        for layer in range(4):
            keys, values = _kv(config, layer, tokens, gen)
            past_keys, past_values = seen.get(layer, (keys[:, :, :0], values[:, :, :0]))
            got_keys, got_values = cache.update(keys, values, layer)
            all_keys, all_values = torch.cat([past_keys, keys], 2), torch.cat([past_values, values], 2)
            seen[layer] = (all_keys, all_values)
            if config.layer_types[layer] == "sliding_attention":
                visible = min(past_keys.shape[2], WINDOW - 1) + tokens
                all_keys, all_values = all_keys[:, :, -visible:], all_values[:, :, -visible:]
                assert cache.layers[layer].keys.shape[2] <= WINDOW, step
            assert torch.equal(got_keys, all_keys), (step, layer)
            assert torch.equal(got_values, all_values), (step, layer)
    assert cache.get_seq_length() == 312
    assert cache.get_seq_length(1) == 312
    full_bytes = sum(cache.layers[i].nbytes() for i in (1, 3))
    sliding_bound = 2 * 2 * (2 * 2 * WINDOW * 8) * 4  # layers x (K, V) x [B, H, window, d] x fp32 bytes
    assert cache.memory_bytes() - full_bytes <= sliding_bound
    assert cache.layers[1].keys.shape[2] <= 312 + 256  # a full layer's room: max(256 tokens, an eighth)


def test_max_length_sizes_full_layers_once() -> None:
    """With max_length (what generate passes), a full layer allocates prompt + new tokens at the prefill and does
    not grow up to it (one more token makes it grow); sliding layers are unaffected."""
    config = text_config()
    cache = Gemma4HybridCache(config, max_length=20)
    gen = torch.Generator().manual_seed(3)
    for tokens in [9] + [1] * 11:
        for layer in range(4):
            cache.update(*_kv(config, layer, tokens, gen), layer)
        assert cache.layers[1].keys.shape[2] == 20
        assert cache.layers[0].keys.shape[2] <= WINDOW
    assert cache.layers[1].end == 20
    # past max_length the full layer grows and still returns every token
    before = cache.layers[1].keys[:, :, :20].clone()
    keys, values = _kv(config, 1, 1, gen)
    got_keys, _ = cache.update(keys, values, 1)
    assert cache.layers[1].keys.shape[2] > 21
    assert torch.equal(got_keys, torch.cat([before, keys], dim=2))


def test_kv_shared_layers_keep_nothing() -> None:
    config = text_config(num_kv_shared_layers=2)
    assert kv_sharing_modes(config) == ["store", "store", "reuse", "reuse"]
    cache = Gemma4HybridCache(config)
    assert sorted(cache.layers) == [0, 1]
    with pytest.raises(KeyError, match="reuse"):
        cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 2)


def test_step_mask_records_padding_for_later_steps() -> None:
    config = text_config()
    cache = Gemma4HybridCache(config)
    gen = torch.Generator().manual_seed(1)

    def step(mask: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
        """What the text model does per forward: record the mask, then the layers append their K/V."""
        real = cache.step_mask(mask, tokens)
        cache.update(*_kv(config, 0, tokens, gen), 0)
        return real

    assert step(None, 3) is None
    prompt = torch.tensor([[1, 1], [0, 1]])
    cache = Gemma4HybridCache(config)
    assert torch.equal(step(prompt, 2), prompt.bool())
    # later steps: nothing, this step's columns only, or the full mask — the padded first token stays masked
    assert torch.equal(step(None, 1), torch.tensor([[1, 1, 1], [0, 1, 1]]).bool())
    assert torch.equal(step(torch.ones(2, 1), 1), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]).bool())
    assert torch.equal(step(torch.tensor([[1] * 5, [0] + [1] * 4]), 1), torch.tensor([[1] * 5, [0] + [1] * 4]).bool())
    with pytest.raises(ValueError, match=r"\[B, 6\] mask over the cached and new tokens"):
        cache.step_mask(torch.ones(2, 2), 1)
    assert step(torch.ones(2, 6), 1) is None  # a full mask without padding clears the record


def test_reorder_cache_permutes_every_layer_and_the_padding() -> None:
    config = text_config()
    cache = Gemma4HybridCache(config)
    gen = torch.Generator().manual_seed(2)
    cache.step_mask(torch.tensor([[1, 1], [0, 1]]), 2)
    before = {}
    for layer in range(4):
        keys, values = _kv(config, layer, 2, gen)
        before[layer] = cache.update(keys, values, layer)
    cache.reorder_cache(torch.tensor([1, 0]))
    for layer in range(4):
        keys, values = _kv(config, layer, 1, gen)
        got_keys, _ = cache.update(keys, values, layer)
        assert torch.equal(got_keys[:, :, :2], before[layer][0].flip(0))
    assert torch.equal(cache.step_mask(None, 1), torch.tensor([[0, 1, 1], [1, 1, 1]]).bool())
