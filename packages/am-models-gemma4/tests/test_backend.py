"""BackendConfig in Gemma 4: `backend=` chooses the attention kernel and the experts' GEMM, or is refused.

Each runnable attention backend (eager, flex) gives the SDPA model's logits within fp32 tolerance on sliding and full
layers, with padding and the blocked sliding-window path (sequence longer than twice the window), and its own code
path is shown to run (the kernel function is wrapped with a call counter). Values Gemma 4 cannot run are refused at
construction in one `ValueError` naming what is missing; nothing is rewritten or ignored.
"""

from __future__ import annotations

import _g4_configs as C
import pytest
import torch

from am_models_gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from am_precision import BackendConfig
from am_precision import attention as attention_kernels

# fp32 logits of a 4-layer tiny model: the kernels differ only in summation order (softmax in fp32 everywhere).
FP32_TOL = 1e-5


def _backend(**fields) -> BackendConfig:
    values = {"attn": "sdpa", "linear": "torch", "rms_norm": "torch_fp32", "experts": "torch", "dispatcher": "torch"}
    values.update(fields)
    return BackendConfig(**values)


def _model(backend: BackendConfig | None, *, moe: bool = False) -> Gemma4ForCausalLM:
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(C.text_config(moe=moe), backend=backend)
    C.perturb_(model)
    return model.eval()


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    inner = getattr(attention_kernels, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, name, counted)
    return calls


@pytest.mark.parametrize(("attn", "kernel"), [("eager", "eager_attention"), ("flex", "_flex_attention")])
def test_each_runnable_attention_backend_runs_its_own_kernel_and_equals_sdpa(monkeypatch, attn, kernel) -> None:
    reference = _model(None, moe=True)
    model = _model(_backend(attn=attn), moe=True)
    model.load_state_dict(reference.state_dict())
    assert set(model.state_dict()) == set(reference.state_dict())  # the backend adds no checkpoint keys
    ids = torch.randint(1, C.VOCAB, (2, 13))  # 13 > 2 * sliding_window: the blocked sliding-window path runs
    padding = torch.ones_like(ids)
    padding[1, :3] = 0
    calls = _counting(monkeypatch, kernel)
    with torch.no_grad():
        for mask in (None, padding):
            got = model(input_ids=ids, attention_mask=mask).logits
            want = reference(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(got, want, rtol=FP32_TOL, atol=FP32_TOL)
    assert len(calls) == 2 * len(C.LAYER_TYPES)  # every layer of both forwards ran the chosen kernel


def test_eager_attention_trains_like_sdpa() -> None:
    reference, model = _model(None), _model(_backend(attn="eager"))
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(1, C.VOCAB, (2, 11))
    for m in (reference, model):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        # relative to the gradient's own scale: fp32 summation-order noise of a 4-layer model
        scale = float(want.grad.abs().max())
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=2e-5 * scale, msg=name)


def test_experts_backend_chooses_the_grouped_gemm() -> None:
    model = _model(_backend(experts="torch"), moe=True)
    with torch.no_grad():
        model(input_ids=torch.randint(1, C.VOCAB, (1, 6)))
    choices = {layer.moe.experts.grouped_mm_choice.backend for layer in model.model.layers.values()}
    assert choices == {"loop"}  # experts='torch': one matmul per expert, as asked


def test_the_vision_language_model_takes_the_backend_positionally() -> None:
    """upstream's order (config, moe_config, backend): the text layers get the chosen kernel."""
    model = Gemma4ForConditionalGeneration(C.vlm_config(), None, _backend(attn="eager"))
    kernels = {layer.self_attn.core_attention.attn for layer in model.model.language_model.layers.values()}
    assert kernels == {"eager"}


def test_values_gemma4_cannot_run_are_refused_all_at_once() -> None:
    backend = BackendConfig(
        attn="tilelang",
        linear="torch",
        rms_norm="torch",
        experts="torch",
        dispatcher="hybridep",
        enable_hf_state_dict_adapter=False,
    )
    with pytest.raises(ValueError, match="cannot run as asked") as err:
        Gemma4ForCausalLM(C.text_config(), backend=backend)
    message = str(err.value)
    for wrong in ("attn='tilelang'", "rms_norm='torch'", "dispatcher='hybridep'", "enable_hf_state_dict_adapter=False"):
        assert wrong in message
    with pytest.raises(TypeError, match=r"must be an am_precision\.BackendConfig"):
        Gemma4ForCausalLM(C.text_config(), backend="sdpa")


def test_context_parallelism_refuses_a_kernel_the_ring_would_replace() -> None:
    """Under CP every chunk runs am-context-parallel's ring kernel: a non-SDPA choice is refused before any
    collective (the `cp_problems` hook), not silently replaced."""
    model = _model(_backend(attn="eager"))
    problems = model.cp_problems(seq_len=16, local_seq_len=8, cp_size=2)
    assert len(problems) == 1
    assert "attn='eager'" in problems[0]
    assert "use attn='sdpa' with cp > 1" in problems[0]
    assert _model(_backend(attn="sdpa")).cp_problems(seq_len=16, local_seq_len=8, cp_size=2) == []
