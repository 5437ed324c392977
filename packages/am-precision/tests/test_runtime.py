"""backend_runtime_problems: every value this machine cannot run is named with what is missing; nothing is imported.

Availability is faked through `am_precision.flags`, the module finder and `torch.cuda`."""

from __future__ import annotations

import pytest
import torch

from am_precision import BackendConfig, backend_runtime_problems, flags
from am_precision import runtime as runtime_module


@pytest.fixture
def bare_cpu(monkeypatch):
    """No CUDA, no Transformer Engine, none of the optional kernel packages."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(flags, "HAVE_TE", False)
    monkeypatch.setattr(runtime_module, "_installed", lambda module: False)


@pytest.mark.usefixtures("bare_cpu")
def test_every_missing_piece_is_named_once() -> None:
    backend = BackendConfig(
        attn="te",
        linear="te",
        rms_norm="quack",
        experts="gmm",
        dispatcher="deepep",
        te_fp8={"recipe": "current"},
    )
    problems = backend_runtime_problems(backend)
    expected = [
        "attn='te' needs Transformer Engine",
        "linear='te' needs Transformer Engine",
        "rms_norm='quack' needs the `quack` package",
        "experts='gmm' needs the `grouped_gemm` package",
        "dispatcher='deepep' needs the `deep_ep` package",
        "te_fp8 (TE FP8 autocast) needs Transformer Engine",
    ]
    assert len(problems) == len(expected)
    for problem, start in zip(problems, expected, strict=True):
        assert problem.startswith(start), problem
    assert not any("not implemented" in p for p in problems)


@pytest.mark.usefixtures("bare_cpu")
def test_mxfp8_experts_name_blackwell_and_plain_values_run() -> None:
    (problem,) = backend_runtime_problems(BackendConfig(experts="torch_mm_mxfp8"))
    assert "Blackwell" in problem
    plain = BackendConfig(attn="eager", linear="torch", rms_norm="torch", experts="torch_mm", dispatcher="torch")
    assert backend_runtime_problems(plain) == []


def test_installed_packages_still_need_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime_module, "_installed", lambda module: True)
    (problem,) = backend_runtime_problems(BackendConfig(experts="gmm", dispatcher="uccl_ep"), fields=["experts"])
    assert problem == "experts='gmm' needs a CUDA GPU (torch.cuda.is_available() is False)"
    with pytest.raises(ValueError, match="unknown field 'nope'"):
        backend_runtime_problems(BackendConfig(), fields=["nope"])
