"""Upstream's TE class patching (`am_precision.upstream`), exercised on plain torch classes shaped like TE's (the
real TE needs CUDA). The core builds subclasses instead (test_te_modules.py).

Contract: unallocated inputs short-circuit to an empty output of the right shape unless torch.compile is tracing;
`is_first_microbatch=None` (positional, keyword or omitted) is replaced by the global flag; explicit values win;
every patch is installed once per class, also through subclasses.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from am_precision import flags, set_is_first_microbatch
from am_precision.te_modules import empty_like_input
from am_precision.upstream import (
    apply_te_patches,
    patch_first_microbatch_injection,
    patch_te_modules,
    patch_unallocated_short_circuit,
)


@pytest.fixture(autouse=True)
def _reset_flag():
    yield
    set_is_first_microbatch(None)


def make_linear_class():
    """A fresh nn.Linear subclass with TE Linear's forward signature that records its calls."""

    class RecordingLinear(nn.Linear):
        calls: list[bool | None]

        def forward(self, inp, is_first_microbatch=None, fp8_output=False):
            type(self).calls.append(is_first_microbatch)
            return super().forward(inp)

    RecordingLinear.calls = []
    return RecordingLinear


def make_norm_class():
    class RecordingRMSNorm(nn.RMSNorm):
        calls: list[torch.Size]

        def forward(self, inp):
            type(self).calls.append(inp.shape)
            return super().forward(inp)

    RecordingRMSNorm.calls = []
    return RecordingRMSNorm


def make_grouped_class():
    """GroupedLinear-like: forward(inp, m_splits, is_first_microbatch=None), one weight per group."""

    class RecordingGrouped(nn.Module):
        calls: list[bool | None]

        def __init__(self, groups, in_features, out_features):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(groups, out_features, in_features))

        def forward(self, inp, m_splits, is_first_microbatch=None):
            type(self).calls.append(is_first_microbatch)
            chunks = torch.split(inp, m_splits)
            return torch.cat([c @ w.T for c, w in zip(chunks, self.weight, strict=True)])

    RecordingGrouped.calls = []
    return RecordingGrouped


def test_linear_short_circuits_empty_and_meta_inputs():
    cls = make_linear_class()
    apply_te_patches(linear_classes=(cls,))
    layer = cls(6, 4)
    out = layer(torch.empty(0, 6))
    assert out.shape == (0, 4)
    out = layer(torch.empty(2, 3, 6, device="meta", dtype=torch.bfloat16))
    assert out.shape == (2, 3, 4)
    assert out.is_meta
    assert out.dtype == torch.bfloat16
    assert cls.calls == []  # the real forward never ran


def test_linear_runs_normally_on_real_inputs():
    cls = make_linear_class()
    apply_te_patches(linear_classes=(cls,))
    layer = cls(6, 4)
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert len(cls.calls) == 1


def test_short_circuit_is_skipped_while_compiling(monkeypatch):
    """Under torch.compile tracing, inputs are fake (unallocated); they must reach the real forward."""
    cls = make_norm_class()
    apply_te_patches(norm_classes=(cls,))
    norm = cls(5, device="meta")
    meta = torch.empty(2, 5, device="meta")
    norm(meta)
    assert cls.calls == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = norm(meta)
    assert cls.calls == [torch.Size([2, 5])]
    assert out.shape == (2, 5)


def test_patched_norm_compiles_and_matches_eager():
    """torch.compile traces the patched forward with fake tensors; the compiled result equals eager."""
    cls = make_norm_class()
    apply_te_patches(norm_classes=(cls,))
    norm = cls(8)
    x = torch.randn(3, 8)
    compiled = torch.compile(norm, backend="aot_eager", fullgraph=False)
    torch.testing.assert_close(compiled(x), nn.functional.rms_norm(x, (8,), norm.weight, norm.eps))


def test_norm_short_circuit_returns_empty_like():
    cls = make_norm_class()
    apply_te_patches(norm_classes=(cls,))
    out = cls(5)(torch.empty(0, 5, dtype=torch.bfloat16))
    assert out.shape == (0, 5)
    assert out.dtype == torch.bfloat16
    assert cls.calls == []


@pytest.mark.parametrize("flag", [True, False, None])
def test_linear_receives_global_flag_when_caller_passes_none(flag):
    cls = make_linear_class()
    apply_te_patches(linear_classes=(cls,))
    layer = cls(6, 4)
    set_is_first_microbatch(flag)
    x = torch.randn(2, 6)
    layer(x)  # omitted
    layer(x, None)  # positional None
    layer(x, is_first_microbatch=None)  # keyword None
    layer(inp=x)  # input by keyword
    assert cls.calls == [flag] * 4


def test_explicit_is_first_microbatch_wins_over_global_flag():
    cls = make_linear_class()
    apply_te_patches(linear_classes=(cls,))
    layer = cls(6, 4)
    set_is_first_microbatch(True)
    x = torch.randn(2, 6)
    layer(x, False)
    layer(x, is_first_microbatch=False)
    assert cls.calls == [False, False]


def test_grouped_linear_injection_positional_and_keyword():
    cls = make_grouped_class()
    apply_te_patches(grouped_linear_classes=(cls,))
    layer = cls(2, 3, 4)
    x = torch.randn(5, 3)
    set_is_first_microbatch(False)
    out = layer(x, [2, 3])
    layer(x, [2, 3], None)
    layer(x, m_splits=[2, 3], is_first_microbatch=None)
    layer(x, [2, 3], True)
    assert cls.calls == [False, False, False, True]
    expected = torch.cat([x[:2] @ layer.weight[0].T, x[2:] @ layer.weight[1].T])
    torch.testing.assert_close(out, expected)


def test_patches_are_idempotent_per_class_and_through_subclasses():
    cls = make_linear_class()
    assert patch_first_microbatch_injection(cls) is True
    assert patch_first_microbatch_injection(cls) is False
    first = cls.forward
    apply_te_patches(linear_classes=(cls,))
    second = cls.forward
    apply_te_patches(linear_classes=(cls,))
    assert cls.forward is second
    assert second.__wrapped__ is first  # short-circuit wrapped the injection exactly once

    class Child(cls):
        pass

    assert patch_unallocated_short_circuit(Child, output_for=empty_like_input) is False
    assert patch_first_microbatch_injection(Child) is False
    assert Child.forward is second


def test_injection_requires_an_is_first_microbatch_parameter():
    class Plain(nn.Linear):
        pass

    with pytest.raises(TypeError, match="has no 'is_first_microbatch' parameter"):
        patch_first_microbatch_injection(Plain)


@pytest.mark.skipif(flags.te_usable(), reason="Transformer Engine with CUDA is available; this checks its absence")
def test_patch_te_modules_without_te_says_how_to_install():
    with pytest.raises(ImportError, match=r"am-precision\[te\]"):
        patch_te_modules()


@pytest.mark.skipif(not flags.te_usable(), reason="Transformer Engine with CUDA is not available on this machine")
def test_patch_te_modules_patches_te_once():
    import transformer_engine.pytorch as te

    patch_te_modules()
    linear_forward = te.Linear.forward
    patch_te_modules()
    assert te.Linear.forward is linear_forward
    assert patch_first_microbatch_injection(te.GroupedLinear) is False
    assert patch_unallocated_short_circuit(te.RMSNorm, output_for=empty_like_input) is False
