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
from am_precision import BackendConfig, flags
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
        rms_norm="quack",
        experts="torch",
        dispatcher="mok",
    )
    with pytest.raises(ValueError, match="cannot run as asked") as err:
        Gemma4ForCausalLM(C.text_config(), backend=backend)
    message = str(err.value)
    for wrong in ("attn='tilelang'", "rms_norm='quack'", "dispatcher='mok'"):
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


@pytest.mark.skipif(flags.HAVE_TE and torch.cuda.is_available(), reason="Transformer Engine and CUDA are here")
def test_transformer_engine_values_are_refused_naming_what_is_missing() -> None:
    """linear / rms_norm 'te', rope_fusion and te_fp8 run Transformer Engine modules and kernels (bench/gpu_smoke.py
    runs them on a GPU); without TE or CUDA each is named in one error, never replaced by the torch modules."""
    backend = _backend(linear="te", rms_norm="te", rope_fusion=True, te_fp8={"recipe": "current"})
    with pytest.raises(ValueError, match="cannot run as asked") as err:
        Gemma4ForCausalLM(C.text_config(), backend=backend)
    message = str(err.value)
    for what in ("linear='te'", "rms_norm='te'", "rope_fusion=True (TE's fused RoPE)", "te_fp8 (TE FP8 autocast)"):
        assert what in message
    assert "not implemented" not in message
    with pytest.raises(ValueError, match=r"rope='quack' needs the `quack` package"):
        Gemma4ForCausalLM(C.text_config(), backend=_backend(rope="quack"))


def test_rms_norm_torch_runs_nn_rmsnorm_and_matches_the_fp32_norm() -> None:
    """rms_norm='torch': every scaled norm is torch's nn.RMSNorm (the same `weight` key), and in fp32 the logits
    equal the default fp32 norm's; the weightless v_norm keeps its form (no key to add)."""
    reference = _model(_backend())
    torch_norms = Gemma4ForCausalLM(C.text_config(), backend=_backend(rms_norm="torch")).eval()
    assert torch_norms.load_state_dict(reference.state_dict()) is not None  # same keys, strict
    layer = torch_norms.model.layers["0"]
    assert isinstance(layer.input_layernorm, torch.nn.RMSNorm)
    assert isinstance(layer.self_attn.q_norm, torch.nn.RMSNorm)
    assert isinstance(torch_norms.model.norm, torch.nn.RMSNorm)
    ids = torch.randint(0, C.text_config().vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = reference(ids).logits, torch_norms(ids).logits
    assert (actual - expected).abs().max() <= FP32_TOL * expected.abs().max()


def test_fused_rotary_tables_carry_the_angles_of_transformers_cos_and_sin() -> None:
    """rope_fusion hands TE's kernel the fp32 angles cos/sin come from; rotating by them is transformers' rotation
    (checked here with torch's cos/sin of the angles, the math TE's kernel computes)."""
    from am_models_gemma4.attention import _rotary
    from am_models_gemma4.layers import Gemma4RotaryEmbedding

    config = C.text_config()
    plain, fused = Gemma4RotaryEmbedding(config), Gemma4RotaryEmbedding(config, fused=True)
    x = torch.randn(2, 6, 4, 16)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]])  # the second row packs two documents
    for layer_type in sorted(set(config.layer_types)):
        cos, sin = plain(x, positions, layer_type)
        tables = fused(x, positions, layer_type)
        assert plain(x, positions, layer_type).angles is None
        assert torch.equal(tables[0], cos)
        assert torch.equal(tables[1], sin)
        assert tables.angles is not None
        assert tables.angles.dtype == torch.float32
        assert torch.allclose(tables.angles.cos(), cos, atol=1e-6)
        assert torch.allclose(tables.angles.sin(), sin, atol=1e-6)
        head_dim = cos.shape[-1]
        q = torch.randn(2, 6, 4, head_dim)
        expected = _rotary(q, cos, sin)
        assert torch.allclose(_rotary(q, tables.angles.cos(), tables.angles.sin()), expected, atol=1e-6)


def test_fsdp_optimizations_drive_the_fsdp_hooks_only_when_asked(monkeypatch) -> None:
    """enable_fsdp_optimizations: prepare_for_grad_accumulation / prepare_for_final_backward (upstream's hooks) call
    am-precision's deferred-sync functions (run on a 2-rank FSDP2 group in am-precision's test_fsdp2.py)."""
    import am_models_gemma4.pretrained as model_module  # where the hooks look the functions up

    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        model_module, "prepare_for_grad_accumulation", lambda m, *, pp_enabled: seen.append(("acc", pp_enabled))
    )
    monkeypatch.setattr(
        model_module, "prepare_for_final_backward", lambda m, *, pp_enabled: seen.append(("final", pp_enabled))
    )
    for backend in (None, _backend()):
        model = Gemma4ForCausalLM(C.text_config(), backend=backend)
        model.prepare_for_grad_accumulation()
        model.prepare_for_final_backward()
    assert seen == []
    model = Gemma4ForCausalLM(C.text_config(), backend=_backend(enable_fsdp_optimizations=True))
    model.prepare_for_grad_accumulation(pp_enabled=True)
    model.prepare_for_final_backward()
    assert seen == [("acc", True), ("final", False)]


def test_rotary_tables_survive_torch_rebuilding_them_from_an_iterable() -> None:
    """FSDP2 casts a layer's forward inputs by rebuilding every tuple as `type(x)(generator)`
    (torch.distributed.utils._apply_to_tensors with FSDP2's own `_cast_fp_tensor`); the rotary tables come back as
    the same (cos, sin), and with the fp32 angles (never cast) when cos already has the compute dtype — the case of
    every mixed-precision run, where the rotary embedding computes cos in the activations' dtype (FSDP2's
    param_dtype). A cast that makes a new cos drops the angles: the fused RoPE then refuses, it never guesses."""
    import functools

    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    from am_models_gemma4.layers import Gemma4RotaryEmbedding, RotaryTables

    config = C.text_config()
    fused = Gemma4RotaryEmbedding(config, fused=True)
    positions = torch.arange(6)[None]
    cast_to_bf16 = functools.partial(_cast_fp_tensor, torch.bfloat16)
    for layer_type in sorted(set(config.layer_types)):
        original = fused(torch.randn(1, 6, 16, dtype=torch.bfloat16), positions, layer_type)  # bf16 activations
        assert original[0].dtype == torch.bfloat16
        tables = _apply_to_tensors(cast_to_bf16, {"position_embeddings": original})["position_embeddings"]
        assert isinstance(tables, RotaryTables)
        assert tables[0] is original[0]
        assert tables[1] is original[1]
        assert tables.angles is original.angles
        assert tables.angles.dtype == torch.float32  # not cast: the angles are not an element of the tuple

    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    rebuilt = _apply_to_tensors(cast_to_bf16, {"position_embeddings": RotaryTables(cos, sin, cos * 0)})
    tables = rebuilt["position_embeddings"]
    assert isinstance(tables, RotaryTables)
    torch.testing.assert_close(tables[0], cos.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(tables[1], sin.bfloat16(), rtol=0, atol=0)
    assert tables.angles is None  # cos was cast to a new tensor: dropped, and the fused RoPE refuses without them


@pytest.mark.skipif(
    flags.HAVE_TE or flags.HAVE_GMM or flags.HAVE_DEEP_EP or flags.HAVE_UCCL_EP or torch.cuda.is_available(),
    reason="a library or CUDA is present here",
)
@pytest.mark.parametrize(
    ("fields", "missing"),
    [
        ({"experts": "te", "dispatcher": "deepep"}, ("experts='te' (TE GroupedLinear) needs", "`deep_ep` package")),
        ({"experts": "gmm", "dispatcher": "uccl_ep"}, ("`grouped_gemm` package", "`uccl_ep` package")),
        ({"experts": "torch_mm", "dispatcher": "hybridep"}, ("dispatcher='hybridep' needs the `deep_ep` package",)),
    ],
    ids=["te_deepep", "gmm_uccl_ep", "hybridep"],
)
def test_library_experts_and_dispatchers_are_refused_here_naming_the_library_and_cuda(fields, missing) -> None:
    """experts te / gmm and the dispatchers deepep / hybridep / uccl_ep are Gemma 4's (SUPPORTED_BACKENDS); without
    the library and CUDA they are refused naming both, never as "not implemented"."""
    from am_models_gemma4.backend import SUPPORTED_BACKENDS

    assert fields["experts"] in SUPPORTED_BACKENDS["experts"]
    assert fields["dispatcher"] in SUPPORTED_BACKENDS["dispatcher"]
    with pytest.raises(ValueError, match="cannot run as asked") as err:
        Gemma4ForCausalLM(C.text_config(moe=True), backend=_backend(**fields))
    message = str(err.value)
    for what in missing:
        assert what in message
    assert "torch.cuda.is_available() is False" in message
    assert "not implemented" not in message


def test_mxfp8_experts_are_refused_off_blackwell_and_build_am_moe_mxfp8_experts_on_it(monkeypatch) -> None:
    """experts='torch_mm_mxfp8' is Gemma 4's: refused off Blackwell naming the GPU it needs; where the check passes
    (faked here) every MoE layer builds am-moe's MXFP8 experts (grouped_mm="mxfp8")."""
    import am_models_gemma4.backend as backend_module
    from am_models_gemma4.backend import SUPPORTED_BACKENDS

    backend = _backend(experts="torch_mm_mxfp8")
    assert "torch_mm_mxfp8" in SUPPORTED_BACKENDS["experts"]
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10):
        with pytest.raises(ValueError, match="Blackwell") as err:
            Gemma4ForCausalLM(C.text_config(moe=True), backend=backend)
        assert "not implemented" not in str(err.value)
    monkeypatch.setattr(backend_module, "backend_runtime_problems", lambda backend, *, fields: [])
    model = Gemma4ForCausalLM(C.text_config(moe=True), backend=backend)
    assert {layer.moe.experts.grouped_mm for layer in model.model.layers.values()} == {"mxfp8"}


def test_library_backends_build_the_library_experts_and_refuse_a_forward_without_ep(monkeypatch) -> None:
    """Where the libraries and CUDA exist (faked: `backend_runtime_problems` finds nothing missing), experts 'te' /
    'gmm' build am-moe's TE / grouped_gemm experts, apply_expert_parallel gets the backend's dispatcher fields, and
    a library dispatcher refuses to run before the experts are sharded over ep > 1."""
    import am_models_gemma4.backend as backend_module
    from am_models_gemma4.backend import expert_parallel_options

    monkeypatch.setattr(backend_module, "backend_runtime_problems", lambda backend, *, fields: [])
    for experts, dispatcher in (("te", "deepep"), ("gmm", "hybridep"), ("torch", "uccl_ep")):
        backend = _backend(experts=experts, dispatcher=dispatcher, dispatcher_num_sms=24)
        model = Gemma4ForCausalLM(C.text_config(moe=True), backend=backend)
        grouped = {layer.moe.experts.grouped_mm for layer in model.model.layers.values()}
        assert grouped == {{"te": "te", "gmm": "gmm", "torch": "loop"}[experts]}
        with pytest.raises(ValueError, match=f"dispatcher='{dispatcher}' moves tokens between expert-parallel"):
            model(input_ids=torch.randint(1, C.VOCAB, (1, 6)))
    options = expert_parallel_options(backend)
    assert options == {
        "dispatcher": "uccl_ep",
        "dispatcher_num_sms": 24,
        "dispatcher_async_dispatch": False,
        "dispatcher_share_token_dispatcher": True,
    }
    assert expert_parallel_options(None) == {"dispatcher": "torch"}
    assert expert_parallel_options(None, dispatcher="torch_token") == {"dispatcher": "torch_token"}
