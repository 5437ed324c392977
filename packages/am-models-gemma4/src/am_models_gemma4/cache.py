"""`Gemma4HybridCache`: the keys and values a Gemma 4 text decoder keeps between generation steps.

What it is for: generation (a prefill, then one token per step). Every layer that computes its own K/V keeps them in a
buffer `[B, kv_heads, capacity, head_dim]` (the layer's own head dim and KV heads: full layers may use
`global_head_dim` and `num_global_key_value_heads`):
  - full-attention layers keep every token: the buffer is allocated for `max_length` tokens when given (`generate`
    passes prompt + new tokens) and otherwise grows by at least an eighth at a time, so appending a token costs one
    write, not a copy of the whole cache;
  - sliding-window layers keep only the last `sliding_window - 1` tokens, which is all the next query's window
    reaches (transformers' `DynamicSlidingWindowLayer` keeps the same); their buffer has room for an eighth of
    the window more (at least one token), so it holds at most `9/8 · sliding_window` tokens whatever the generation
    length, and the kept tokens move to its front once every `window / 8` steps (about 8 token copies per step,
    where concatenating would copy the whole window at every step);
  - KV-shared ("reuse") layers keep nothing: within each forward they read what their "store" layer returned (the
    store layer's cached plus new K/V, through `SharedKVStates`), as transformers does.
It also records which of the tokens seen so far are padding (`step_mask`), so that a later step still masks a
left-padded prompt even when it passes no `attention_mask`.
What it must not do: take part in training (the training forward passes no cache and never touches this module),
build attention masks (`attention.py` does), or roll back (no `crop`: assisted decoding is refused by transformers
because the models declare `_is_stateful = True`).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import SLIDING, kv_sharing_modes, text_config_of

__all__ = ["Gemma4HybridCache"]

# Room a full-attention buffer gains when it grows: at least this many tokens, or an eighth of its length.
_MIN_GROWTH = 256
# Room of a sliding-window buffer beyond the tokens it keeps: this fraction of them (at least one token).
_SLIDING_ROOM_FRACTION = 8


class _LayerKV:
    """K/V of one layer: tokens `[start, end)` of a `[B, H, capacity, d]` buffer pair; `keep=None` keeps all."""

    def __init__(self, keep: int | None, *, max_length: int | None = None) -> None:
        self.keep = keep
        self.max_length = max_length
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.start = 0
        self.end = 0
        self.seen = 0  # tokens this layer has been given since the cache was created

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[B, H, S, d]` keys/values; return the cached ones followed by the new ones, `[B, H, kept + S, d]`."""
        new = keys.shape[2]
        self.seen += new
        if self.keys is not None and self.values is not None and new == 1 and self.end < self.keys.shape[2]:
            # One decode step with room left: one write, no copy; the returned views stay valid (later writes go past
            # `end`, and a rebuild allocates new buffers).
            self.keys[:, :, self.end] = keys[:, :, 0]
            self.values[:, :, self.end] = values[:, :, 0]
            self.end += 1
            visible = (self.keys[:, :, self.start : self.end], self.values[:, :, self.start : self.end])
            if self.keep is not None:
                self.start = max(self.start, self.end - self.keep)
            return visible
        if self.keys is not None and self.values is not None:
            keys = torch.cat([self.keys[:, :, self.start : self.end], keys], dim=2)
            values = torch.cat([self.values[:, :, self.start : self.end], values], dim=2)
        self._rebuild(keys, values)
        return keys, values

    def _rebuild(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New buffers holding the tokens to keep of `keys`/`values` `[B, H, T, d]`, with room to append."""
        if self.keep is not None:
            drop = keys.shape[2] - min(self.keep, keys.shape[2])
            keys, values = keys[:, :, drop:], values[:, :, drop:]
            room = max(1, self.keep // _SLIDING_ROOM_FRACTION)
        elif self.max_length is not None and self.max_length > keys.shape[2]:
            room = self.max_length - keys.shape[2]
        else:
            room = max(_MIN_GROWTH, keys.shape[2] // 8)
        length = keys.shape[2]
        batch, heads, _, dim = keys.shape
        self.keys = keys.new_empty(batch, heads, length + room, dim)
        self.values = values.new_empty(batch, values.shape[1], length + room, values.shape[3])
        self.keys[:, :, :length] = keys
        self.values[:, :, :length] = values
        self.start, self.end = 0, length

    def reorder(self, index: torch.Tensor) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = self.keys.index_select(0, index.to(self.keys.device))
            self.values = self.values.index_select(0, index.to(self.values.device))

    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class Gemma4HybridCache:
    """Generation state of a Gemma 4 text decoder: per-layer K/V (see the module docstring) and the padding seen.

    Buffers are allocated at the first update, in the dtype and on the device of the K/V the layers compute, with
    the batch size of the first forward.

    Args:
        config: a `Gemma4TextConfig`, or a `Gemma4Config` (its text config is used).
        max_length: tokens (prompt + generated) the full-attention layers allocate for at their first update; they
            grow past it when needed. None: grow as tokens arrive.
    """

    is_compileable = False

    def __init__(self, config: Any, *, max_length: int | None = None) -> None:
        text = text_config_of(config)
        modes = kv_sharing_modes(text)
        self.sliding_window = int(text.sliding_window) if SLIDING in text.layer_types else None
        self.layers: dict[int, _LayerKV] = {}
        for index, layer_type in enumerate(text.layer_types):
            if modes[index] == "reuse":
                continue  # reads its store layer's K/V within each forward
            keep = int(text.sliding_window) - 1 if layer_type == SLIDING else None
            self.layers[index] = _LayerKV(keep, max_length=max_length)
        self._first_layer = min(self.layers) if self.layers else None
        self._real: torch.Tensor | None = None  # [B, T] bool, True = real token; None while no token was padding

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append layer `layer_idx`'s new key/value `[B, kv_heads, S, d]`; return what its attention sees: the cached
        tokens followed by the new ones, `[B, kv_heads, kept + S, d]` (kept = all tokens, or at most
        `sliding_window - 1` on sliding layers)."""
        if layer_idx not in self.layers:
            raise KeyError(
                f"layer {layer_idx} keeps no K/V in this cache (a KV-shared 'reuse' layer, or no such layer); it reads "
                "the K/V of its store layer from shared_kv_states"
            )
        return self.layers[layer_idx].update(key, value)

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        """Tokens processed so far (also for sliding layers, which keep fewer); 0 before the first forward."""
        index = self._first_layer if layer_idx is None else layer_idx
        return 0 if index is None else self.layers[index].seen

    def step_mask(self, attention_mask: torch.Tensor | None, new_tokens: int) -> torch.Tensor | None:
        """Record the padding of this step's tokens and return the mask of every token so far.

        attention_mask: `[B, past + S]` (1 = token, 0 = padding; transformers' `generate` passes this), `[B, S]`
        (this step's tokens only; the recorded padding of the past is prepended), or None (every new token is real).

        Returns:
            `[B, past + S]` bool (True = real token), or None when no token seen so far is padding.

        Raises:
            ValueError: a mask whose length is neither past + S nor S.
        """
        past = self.get_seq_length()
        # The record covers the cached tokens (sliced: a forward that failed after this call recorded more).
        recorded = None if self._real is None else self._real[:, :past]
        if attention_mask is None:
            if recorded is not None:
                self._real = torch.cat([recorded, recorded.new_ones(recorded.shape[0], new_tokens)], dim=1)
            return self._real
        real = attention_mask.bool()
        if real.shape[1] == new_tokens and past:
            previous = recorded if recorded is not None else real.new_ones(real.shape[0], past)
            real = torch.cat([previous, real], dim=1)
        elif real.shape[1] != past + new_tokens:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[1]} columns, but the cache holds {past} tokens and "
                f"{new_tokens} arrive: pass a [B, {past + new_tokens}] mask over the cached and new tokens (or "
                f"[B, {new_tokens}] for the new tokens only)"
            )
        self._real = None if bool(real.all()) else real
        return self._real

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Reorder every layer's K/V and the recorded padding along the batch dim (beam search)."""
        for layer in self.layers.values():
            layer.reorder(beam_idx)
        if self._real is not None:
            self._real = self._real.index_select(0, beam_idx.to(self._real.device))

    def memory_bytes(self) -> int:
        """Bytes held by the K/V buffers (what the cache costs; sliding layers stay bounded by their window)."""
        return sum(layer.nbytes() for layer in self.layers.values())
