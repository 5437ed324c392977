"""compute_lm_head_logits: passthrough, position slicing on [T, H] and [B, S, H], THD layout, dtype handling."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from am_precision import compute_lm_head_logits

modeling_outputs = pytest.importorskip(
    "transformers.modeling_outputs", reason="transformers (the 'hf' extra) is not installed"
)

BF16 = torch.bfloat16
H, V = 8, 11


class RecordingHead(nn.Linear):
    """nn.Linear that remembers the exact input object it received."""

    def forward(self, x):
        self.last_input = x
        return super().forward(x)


@pytest.fixture
def head():
    torch.manual_seed(0)
    return RecordingHead(H, V, bias=False)


def test_returns_causal_lm_output(head):
    out = compute_lm_head_logits(head, torch.randn(2, 3, H))
    assert isinstance(out, modeling_outputs.CausalLMOutputWithPast)
    assert out.hidden_states is None


def test_no_head_passes_hidden_states_through_unchanged():
    hidden = torch.randn(2, 5, H)
    assert compute_lm_head_logits(None, hidden, logits_to_keep=3).logits is hidden


def test_no_head_thd_unsqueezes_2d_and_never_makes_4d():
    packed = torch.randn(7, H)
    logits = compute_lm_head_logits(None, packed, is_thd=True).logits
    assert logits.shape == (1, 7, H)
    assert logits.data_ptr() == packed.data_ptr()
    batched = torch.randn(1, 7, H)
    assert compute_lm_head_logits(None, batched, is_thd=True).logits is batched


def test_keep_zero_uses_every_position_without_slicing(head):
    hidden = torch.randn(2, 5, H)
    logits = compute_lm_head_logits(head, hidden, logits_to_keep=0).logits
    assert head.last_input is hidden  # no slice(0, None) view: DTensor under TP+SP cannot take it
    torch.testing.assert_close(logits, hidden @ head.weight.T)


@pytest.mark.parametrize("shape", [(2, 6, H), (6, H)])
def test_positive_int_keeps_last_positions(head, shape):
    hidden = torch.randn(*shape)
    logits = compute_lm_head_logits(head, hidden, logits_to_keep=2).logits
    last = hidden[..., -2:, :]
    assert logits.shape == (*shape[:-2], 2, V)
    torch.testing.assert_close(logits, last @ head.weight.T)


@pytest.mark.parametrize("shape", [(2, 6, H), (6, H)])
def test_index_tensor_selects_positions(head, shape):
    hidden = torch.randn(*shape)
    index = torch.tensor([0, 3, 5])
    logits = compute_lm_head_logits(head, hidden, logits_to_keep=index).logits
    selected = hidden.index_select(len(shape) - 2, index)
    assert logits.shape == (*shape[:-2], 3, V)
    torch.testing.assert_close(logits, selected @ head.weight.T)


def test_thd_with_head_unsqueezes_2d_logits_and_hidden_states(head):
    packed = torch.randn(9, H)
    out = compute_lm_head_logits(head, packed, logits_to_keep=4, is_thd=True, output_hidden_states=True)
    assert out.logits.shape == (1, 4, V)
    assert out.hidden_states.shape == (1, 9, H)
    torch.testing.assert_close(out.hidden_states[0], packed)
    batched = compute_lm_head_logits(head, torch.randn(1, 9, H), is_thd=True, output_hidden_states=True)
    assert batched.logits.shape == (1, 9, V)
    assert batched.hidden_states.shape == (1, 9, H)


def test_output_hidden_states_returns_the_input(head):
    hidden = torch.randn(2, 3, H)
    assert compute_lm_head_logits(head, hidden, output_hidden_states=True).hidden_states is hidden


def test_input_is_cast_to_the_head_weight_dtype_after_slicing(head):
    head.to(BF16)
    hidden = torch.randn(2, 6, H)
    logits = compute_lm_head_logits(head, hidden, logits_to_keep=3).logits
    assert head.last_input.dtype == BF16
    assert head.last_input.shape == (2, 3, H)
    assert logits.dtype == BF16
    assert torch.equal(logits, nn.functional.linear(hidden[:, -3:].to(BF16), head.weight))


def test_fp32_head_runs_in_fp32_and_returns_hidden_dtype(head):
    hidden = torch.randn(2, 4, H).to(BF16)
    logits = compute_lm_head_logits(head, hidden, fp32_lm_head=True).logits
    assert head.last_input.dtype == torch.float32
    assert logits.dtype == BF16
    assert torch.equal(logits, (hidden.float() @ head.weight.T).to(BF16))


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_invalid_logits_to_keep(head, bad):
    with pytest.raises(ValueError, match="logits_to_keep must be"):
        compute_lm_head_logits(head, torch.randn(2, 3, H), logits_to_keep=bad)


def test_4d_hidden_states_are_rejected(head):
    with pytest.raises(ValueError, match=r"\[T, H\] \(packed\) or \[B, S, H\]"):
        compute_lm_head_logits(head, torch.randn(1, 2, 3, H), logits_to_keep=1)


def test_missing_transformers_names_the_hf_extra(monkeypatch, head):
    monkeypatch.setitem(sys.modules, "transformers.modeling_outputs", None)
    with pytest.raises(ImportError, match=r"pip install am-precision\[hf\]"):
        compute_lm_head_logits(head, torch.randn(2, 3, H))
