"""The core's TE modules are subclasses with the behaviours (`with_te_behaviours`), exercised on plain torch classes
shaped like TE's (the real TE needs CUDA).

Contract: the base class is never modified; the subclass keeps the base's parameters, state-dict keys and
`isinstance`; unallocated inputs short-circuit to an empty output of the right shape unless torch.compile is tracing;
`is_first_microbatch=None` (positional, keyword or omitted) is replaced by the global flag; explicit values win.
"""

from __future__ import annotations

import pytest
import torch
from test_upstream_te_patch import make_grouped_class, make_linear_class, make_norm_class
from torch import nn

from am_precision import flags, set_is_first_microbatch, te_module_classes, with_te_behaviours
from am_precision.te_modules import empty_like_input, empty_linear_output


@pytest.fixture(autouse=True)
def _reset_flag():
    yield
    set_is_first_microbatch(None)


def _te_linear(cls: type[nn.Module]) -> type[nn.Module]:
    return with_te_behaviours(cls, unallocated_output=empty_linear_output, inject_first_microbatch=True)


def test_the_base_class_is_untouched_and_the_subclass_is_a_drop_in() -> None:
    base = make_linear_class()
    forward = base.forward
    sub = _te_linear(base)
    assert base.forward is forward
    assert sub is _te_linear(base), "one class per arguments"
    assert issubclass(sub, base)
    assert sub.__name__ == base.__name__
    torch.manual_seed(0)
    layer = sub(6, 4)
    torch.manual_seed(0)
    plain = base(6, 4)
    assert isinstance(layer, base)
    assert layer.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), plain(x))


def test_linear_short_circuits_unallocated_inputs_and_injects_the_flag() -> None:
    cls = make_linear_class()
    layer = _te_linear(cls)(6, 4)
    out = layer(torch.empty(2, 3, 6, device="meta", dtype=torch.bfloat16))
    assert (out.shape, out.is_meta, out.dtype) == ((2, 3, 4), True, torch.bfloat16)
    assert cls.calls == []  # the real forward never ran
    set_is_first_microbatch(True)
    x = torch.randn(2, 6)
    layer(x)
    layer(x, None)
    layer(x, is_first_microbatch=None)
    layer(inp=x)
    layer(x, False)
    assert cls.calls == [True, True, True, True, False]
    plain = cls(6, 4)
    plain(x)
    assert cls.calls[-1] is None, "a base-class instance gets no flag: nothing was patched"


def test_norm_short_circuit_is_skipped_while_compiling(monkeypatch) -> None:
    cls = make_norm_class()
    norm = with_te_behaviours(cls, unallocated_output=empty_like_input)(5, device="meta")
    meta = torch.empty(2, 5, device="meta")
    assert norm(meta).shape == (2, 5)
    assert cls.calls == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    norm(meta)
    assert cls.calls == [torch.Size([2, 5])]


def test_grouped_linear_receives_the_flag() -> None:
    cls = make_grouped_class()
    layer = with_te_behaviours(cls, inject_first_microbatch=True)(2, 3, 4)
    set_is_first_microbatch(False)
    x = torch.randn(5, 3)
    layer(x, [2, 3])
    layer(x, m_splits=[2, 3], is_first_microbatch=None)
    layer(x, [2, 3], True)
    assert cls.calls == [False, False, True]


def test_injection_requires_an_is_first_microbatch_parameter() -> None:
    class Plain(nn.Linear):
        pass

    with pytest.raises(TypeError, match="has no 'is_first_microbatch' parameter"):
        with_te_behaviours(Plain, inject_first_microbatch=True)


@pytest.mark.skipif(flags.te_usable(), reason="Transformer Engine with CUDA is available; this checks its absence")
def test_te_module_classes_without_te_says_how_to_install() -> None:
    with pytest.raises(ImportError, match=r"am-precision\[te\]"):
        te_module_classes()


@pytest.mark.skipif(not flags.te_usable(), reason="Transformer Engine with CUDA is not available on this machine")
def test_te_module_classes_subclass_te_and_leave_it_unpatched() -> None:
    import transformer_engine.pytorch as te

    forward = te.Linear.forward
    classes = te_module_classes()
    assert te.Linear.forward is forward
    assert issubclass(classes.linear, te.Linear)
    assert issubclass(classes.rms_norm, te.RMSNorm)
    assert issubclass(classes.grouped_linear, te.GroupedLinear)
