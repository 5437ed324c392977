"""AttentionKernel: every backend that runs here equals SDPA within fp32 tolerance (boolean and additive masks,
causal, GQA, rows that see no key), and the ones that cannot run are refused naming the missing CUDA / library.
Availability is faked through `am_precision.flags` and `torch.cuda.is_available`; nothing imports
transformer_engine."""

from __future__ import annotations

import pytest
import torch

from am_precision import AttentionKernel, attention_backend_problem, eager_attention, flags
from am_precision import attention as attention_module

# fp32 attention of 16 keys: the kernels differ only in summation order.
FP32_TOL = 1e-5


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 12, 8, generator=gen)
    k = torch.randn(2, 2, 16, 8, generator=gen)
    v = torch.randn(2, 2, 16, 8, generator=gen)
    mask = torch.rand(2, 1, 12, 16, generator=gen) > 0.4
    mask[1, :, 5] = False  # a row that sees no key: 0 on every backend, as SDPA
    return q, k, v, mask


def _cases(mask: torch.Tensor) -> list[dict]:
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    return [
        {"attn_mask": mask},
        {"attn_mask": mask[:1]},  # one mask broadcast over the batch
        {"attn_mask": additive},
        {"is_causal": True},
        {},
    ]


@pytest.mark.parametrize("attn", ["eager", "flex"])
def test_runnable_backends_equal_sdpa(attn: str) -> None:
    q, k, v, mask = _inputs()
    sdpa = AttentionKernel("sdpa", num_heads=4, num_kv_heads=2, head_dim=8)
    kernel = AttentionKernel(attn, num_heads=4, num_kv_heads=2, head_dim=8)
    for case in _cases(mask):
        if case.get("is_causal"):  # SDPA's is_causal aligns the square top-left block
            qc, kc, vc = q, k[:, :, :12], v[:, :, :12]
        else:
            qc, kc, vc = q, k, v
        with torch.no_grad():
            got = kernel(qc, kc, vc, scale=0.3, enable_gqa=True, **case)
            want = sdpa(qc, kc, vc, scale=0.3, enable_gqa=True, **case)
        torch.testing.assert_close(got, want, rtol=FP32_TOL, atol=FP32_TOL, msg=lambda m, c=case: f"{c}: {m}")


def test_eager_gradients_equal_sdpa() -> None:
    q, k, v, mask = _inputs()
    mask[1, :, 5] = True  # SDPA's gradient of an all-masked row is NaN-free only when the row sees a key
    grads = []
    for fn in (eager_attention, torch.nn.functional.scaled_dot_product_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves, attn_mask=mask, scale=0.3, enable_gqa=True).square().sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_flex_refuses_cpu_gradients_and_dropout() -> None:
    q, k, v, _ = _inputs()
    kernel = AttentionKernel("flex", num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(RuntimeError, match="no FlexAttention backward on the CPU"):
        kernel(q.requires_grad_(), k, v, enable_gqa=True)
    with torch.no_grad(), pytest.raises(ValueError, match="attn='flex' has no attention dropout"):
        kernel(q, k, v, dropout_p=0.1, enable_gqa=True)


def test_kernel_adds_no_state_dict_entries() -> None:
    assert AttentionKernel("eager", num_heads=4, num_kv_heads=2, head_dim=8).state_dict() == {}


def test_compile_wraps_the_kernel_in_torch_compile(monkeypatch) -> None:
    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append(fn)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    q, k, v, mask = _inputs()
    kernel = AttentionKernel("eager", num_heads=4, num_kv_heads=2, head_dim=8, compile_attn=True)
    kernel(q, k, v, attn_mask=mask, enable_gqa=True)
    kernel(q, k, v, attn_mask=mask, enable_gqa=True)
    assert len(compiled) == 1  # compiled once, reused


def test_eager_path_really_runs(monkeypatch) -> None:
    calls = []
    inner = attention_module.eager_attention
    monkeypatch.setattr(attention_module, "eager_attention", lambda *a, **kw: calls.append(1) or inner(*a, **kw))
    q, k, v, _ = _inputs()
    AttentionKernel("eager", num_heads=4, num_kv_heads=2, head_dim=8)(q, k, v, enable_gqa=True)
    assert calls == [1]


@pytest.mark.parametrize(
    ("attn", "have_te", "cuda", "missing"),
    [
        ("te", False, True, "needs Transformer Engine"),
        ("te", True, False, "needs a CUDA GPU"),
        ("cudnn", False, False, "needs a CUDA GPU with cuDNN"),
        ("tilelang", True, True, "TileLang sparse-attention kernels"),
    ],
)
def test_backends_that_cannot_run_are_refused_naming_what_is_missing(monkeypatch, attn, have_te, cuda, missing):
    monkeypatch.setattr(flags, "HAVE_TE", have_te)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    problem = attention_backend_problem(attn)
    assert problem is not None
    assert missing in problem
    assert "not implemented" not in problem
    with pytest.raises(ValueError, match=missing):
        AttentionKernel(attn, num_heads=4, num_kv_heads=2, head_dim=8)


def test_te_and_cudnn_are_accepted_where_they_can_run(monkeypatch) -> None:
    monkeypatch.setattr(flags, "HAVE_TE", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert attention_backend_problem("te") is None
    assert attention_backend_problem("cudnn") is None
