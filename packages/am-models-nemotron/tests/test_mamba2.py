"""The Mamba2 mixer: prefill + one-token decode steps equal the full-sequence forward; gated norm, conv with packed
documents and the time-step clamp against direct computations; the fp32 holder."""

from __future__ import annotations

import copy
from importlib.util import find_spec

import pytest
import torch
import torch.nn.functional as F
from am_nemotron_helpers import assert_close_rel, randomize_, tiny_hf_config

from am_models_nemotron import (
    Mamba2Mixer,
    MambaRMSNormGated,
    NemotronConfig,
    NemotronHybridCache,
    default_backend,
    mamba_kernels_available,
)

FP32_TOL = 2e-6
GRAD_TOL = 1e-5


def _mixer(**overrides) -> tuple[Mamba2Mixer, NemotronConfig]:
    cfg = NemotronConfig.from_any(tiny_hf_config("M", **overrides))
    torch.manual_seed(0)
    mixer = Mamba2Mixer(cfg, 0, backend=default_backend())
    mixer.init_weights(num_hidden_layers=1, rescale_prenorm_residual=False)
    randomize_(mixer, seed=5)
    return mixer, cfg


def test_prefill_then_decode_steps_equal_the_full_sequence() -> None:
    mixer, cfg = _mixer()
    x = torch.randn(2, 19, 32)
    full = mixer(x)
    cache = NemotronHybridCache(cfg, 2)
    prefix = 11
    outputs = [mixer(x[:, :prefix], cache=cache)]
    cache.has_previous_state = True
    for t in range(prefix, 19):
        outputs.append(mixer(x[:, t : t + 1], cache=cache))
    assert_close_rel(torch.cat(outputs, dim=1), full, rtol=FP32_TOL, what="prefill + decode")
    assert cache.ssm_states[0].dtype == torch.float32


def test_short_prefill_shorter_than_the_conv_window() -> None:
    mixer, cfg = _mixer()
    x = torch.randn(1, 6, 32)
    cache = NemotronHybridCache(cfg, 1)
    outputs = [mixer(x[:, :2], cache=cache)]
    cache.has_previous_state = True
    outputs += [mixer(x[:, t : t + 1], cache=cache) for t in range(2, 6)]
    assert_close_rel(torch.cat(outputs, dim=1), mixer(x), rtol=FP32_TOL, what="short prefill")


def test_multi_token_continuation_from_a_cache() -> None:
    mixer, cfg = _mixer()
    x = torch.randn(1, 20, 32)
    cache = NemotronHybridCache(cfg, 1)
    first = mixer(x[:, :9], cache=cache)
    cache.has_previous_state = True
    second = mixer(x[:, 9:], cache=cache)  # chunked prefill: initial SSM state from the cache
    assert_close_rel(second, mixer(x)[:, 9:], rtol=FP32_TOL, what="continuation")
    assert first.shape == (1, 9, 32)


def test_packed_documents_equal_each_document_alone() -> None:
    mixer, _ = _mixer()
    lengths = [3, 9, 6]
    x = torch.randn(1, sum(lengths), 32)
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    packed = mixer(x, seq_idx=seq_idx)
    start = 0
    for length in lengths:
        alone = mixer(x[:, start : start + length])
        assert_close_rel(packed[:, start : start + length], alone, rtol=FP32_TOL, what=f"document at {start}")
        start += length


def test_packed_documents_gradients_equal_each_document_alone() -> None:
    """The masked conv's backward (and the scan's) on a packed row: the input gradient of each document equals
    that document run alone, and the parameter gradients equal their sum over the documents."""
    mixer, _ = _mixer()
    lengths = [2, 9, 1, 6]  # documents shorter than the conv window, and one of a single token
    x = torch.randn(1, sum(lengths), 32, requires_grad=True)
    grad_out = torch.randn(1, sum(lengths), 32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    mixer(x, seq_idx=seq_idx).backward(grad_out)
    packed = {name: p.grad.clone() for name, p in mixer.named_parameters()}
    mixer.zero_grad(set_to_none=True)
    start = 0
    for length in lengths:
        piece = x.detach()[:, start : start + length].clone().requires_grad_(True)
        mixer(piece).backward(grad_out[:, start : start + length])
        assert_close_rel(x.grad[:, start : start + length], piece.grad, rtol=FP32_TOL, what=f"dx at {start}")
        start += length
    for name, p in mixer.named_parameters():  # sums over the row in another order: the gradient tolerance
        assert_close_rel(packed[name], p.grad, rtol=GRAD_TOL, what=f"grad {name}")


def test_gated_norm_normalizes_each_group_after_the_gate() -> None:
    norm = MambaRMSNormGated(8, group_size=4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x, gate = torch.randn(3, 8), torch.randn(3, 8)
    gated = x * F.silu(gate)
    expected = torch.cat(
        [g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6) for g in gated.split(4, dim=-1)], dim=-1
    ) * torch.arange(1.0, 9.0)
    assert_close_rel(norm(x, gate), expected, rtol=FP32_TOL, what="gated norm")


def test_time_step_limit_clamps_dt() -> None:
    mixer, _ = _mixer(time_step_limit=(0.05, 0.2))
    raw = torch.linspace(-8, 8, 4 * 5).view(5, 4)
    dt = mixer._discretize(raw, mixer.dt_bias)
    expected = F.softplus(raw + mixer.dt_bias).clamp(0.05, 0.2)
    assert torch.equal(dt, expected)
    assert dt.min() >= 0.05
    assert dt.max() <= 0.2
    unclamped, _ = _mixer(time_step_limit=(0.0, float("inf")))
    assert torch.equal(unclamped._discretize(raw, mixer.dt_bias), F.softplus(raw + mixer.dt_bias))


def test_fp32_holder_owns_the_ssm_parameters() -> None:
    mixer, _ = _mixer()
    names = {n for n, _ in mixer.named_parameters()}
    assert {"_fp32_params.A_log", "_fp32_params.dt_bias", "_fp32_params.D"} <= names
    assert mixer.A_log is mixer._fp32_params.A_log
    mixer.to(torch.bfloat16)  # a plain .to() rounds them; cast_model_to_dtype is the supported cast (test_model)
    outputs = mixer._fp32_params()
    params = (mixer.A_log, mixer.dt_bias, mixer.D)
    for out, param in zip(outputs, params, strict=True):
        # Equal values in their own storage (FSDP2 frees the parameters' unsharded storage after this forward),
        # still connected to the parameter for autograd.
        assert torch.equal(out, param)
        assert out.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
    sum(o.sum() for o in outputs).backward()
    assert all(p.grad is not None and torch.equal(p.grad, torch.ones_like(p)) for p in params)


# Triton / CUDA kernels accumulate in fp32 with TF32 tensor-core products: agree to ~1e-3 relative with fp32 torch.
KERNEL_TOL = 5e-3


@pytest.mark.skipif(
    not torch.cuda.is_available() or find_spec("mamba_ssm") is None or find_spec("causal_conv1d") is None,
    reason="needs CUDA with mamba-ssm and causal-conv1d installed (the 'kernels' extra)",
)
def test_cuda_kernels_match_the_plain_pytorch_path() -> None:
    """With the kernels on CUDA the full-sequence path (plain and packed) gives the plain-PyTorch path's numbers.

    Widths are multiples of 8 (causal_conv1d's channel-last layout needs it)."""
    mixer, _ = _mixer(mamba_num_heads=8, n_groups=2, time_step_limit=(0.001, 0.5))
    on_gpu = copy.deepcopy(mixer).cuda()
    x = torch.randn(2, 37, 32)
    seq_idx = torch.tensor([[0] * 15 + [1] * 22, [0] * 37], dtype=torch.int32)
    assert mamba_kernels_available(x.cuda())
    with torch.no_grad():
        for packed in (None, seq_idx):
            expected = mixer(x, seq_idx=packed)
            actual = on_gpu(x.cuda(), seq_idx=None if packed is None else packed.cuda()).cpu()
            assert_close_rel(actual, expected, rtol=KERNEL_TOL, what=f"kernels vs torch (seq_idx={packed is not None})")
