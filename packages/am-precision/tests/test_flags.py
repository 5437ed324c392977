"""Flags and probes: the FP8 weight-cache flag lifecycle, `is_tensor_unallocated`, and import isolation."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import am_precision
from am_precision import flags


@pytest.fixture(autouse=True)
def _reset_flags():
    yield
    flags.set_is_first_microbatch(None)
    flags.set_is_optim_step(False)


def test_first_microbatch_lifecycle_over_gradient_accumulation():
    """Default None (caching off); a training loop sets True on the first micro-batch, False after, True again."""
    assert am_precision.get_is_first_microbatch() is None
    seen = []
    for step in range(2):
        for micro in range(3):
            am_precision.set_is_first_microbatch(micro == 0)
            seen.append((step, am_precision.get_is_first_microbatch()))
    assert [v for _, v in seen] == [True, False, False, True, False, False]
    am_precision.set_is_first_microbatch(None)
    assert am_precision.get_is_first_microbatch() is None


def test_optim_step_flag_defaults_false_and_round_trips():
    assert am_precision.get_is_optim_step() is False
    am_precision.set_is_optim_step(True)
    assert am_precision.get_is_optim_step() is True
    am_precision.set_is_optim_step(False)
    assert am_precision.get_is_optim_step() is False


@pytest.mark.parametrize("bad", [1, "yes", 0.0])
def test_flag_setters_reject_non_bools(bad):
    with pytest.raises(TypeError, match="is_first_microbatch"):
        am_precision.set_is_first_microbatch(bad)
    with pytest.raises(TypeError, match="is_optim_step"):
        am_precision.set_is_optim_step(bad)


def test_is_tensor_unallocated():
    assert am_precision.is_tensor_unallocated(torch.empty(0, 4))
    assert am_precision.is_tensor_unallocated(torch.empty(3, 4, device="meta"))
    assert not am_precision.is_tensor_unallocated(torch.zeros(3, 4))
    assert not am_precision.is_tensor_unallocated(torch.zeros(()))


def test_is_tensor_unallocated_without_storage():
    """A sparse tensor has no storage (its `data_ptr()` raises RuntimeError): unallocated, as upstream counts it."""
    assert am_precision.is_tensor_unallocated(torch.zeros(3, 3).to_sparse())


def test_is_tensor_unallocated_lets_other_errors_through(monkeypatch):
    """Only torch's "no storage" RuntimeError means unallocated; any other error is a bug and is not swallowed."""

    def broken(self):
        raise TypeError("broken data_ptr")

    monkeypatch.setattr(torch.Tensor, "data_ptr", broken)
    with pytest.raises(TypeError, match="broken data_ptr"):
        am_precision.is_tensor_unallocated(torch.zeros(3))


def test_is_tensor_unallocated_on_fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2, 3)
    assert am_precision.is_tensor_unallocated(fake)


def test_te_usable_needs_te_and_cuda(monkeypatch):
    monkeypatch.setattr(flags, "HAVE_TE", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not flags.te_usable()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert flags.te_usable()
    monkeypatch.setattr(flags, "HAVE_TE", False)
    assert not flags.te_usable()


def test_have_te_matches_find_spec_without_importing_it():
    import importlib.util

    assert importlib.util.find_spec("transformer_engine") is not None or not am_precision.HAVE_TE
    assert "transformer_engine" not in sys.modules or am_precision.HAVE_TE


def test_import_never_loads_transformer_engine_or_transformers():
    """A fresh interpreter imports am_precision (all public names) without pulling in the optional extras."""
    code = textwrap.dedent(
        """
        import sys
        import am_precision
        for name in am_precision.__all__:
            getattr(am_precision, name)
        am_precision.BackendConfig()
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("transformer_engine", "transformers", "quack"))
        print("HEAVY", heavy)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout
