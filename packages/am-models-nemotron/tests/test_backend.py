"""BackendConfig in Nemotron-H: every value runs as asked or is refused naming what is missing — never rewritten.

Each runnable attention backend (sdpa, eager, flex) gives the SDPA model's logits within fp32 tolerance, and the
backend's own code path is shown to run (its kernel function is wrapped with a call counter). Values that need CUDA,
Transformer Engine or an all-to-all dispatcher package are refused at construction with one `ValueError` listing
every problem. Availability is faked the way am-precision's tests fake it (its `flags` module and
`torch.cuda.is_available`); nothing imports transformer_engine.
"""

from __future__ import annotations

import logging

import pytest
import torch
from am_nemotron_helpers import randomize_, tiny_hf_config, tokens

from am_models_nemotron import SUPPORTED_BACKENDS, NemotronHForCausalLM, NemotronV3Model, resolve_backend
from am_models_nemotron.backend import default_backend
from am_precision import BackendConfig, flags
from am_precision import attention as attention_kernels

# fp32 logits of a 3-layer tiny model: the kernels differ only in summation order (softmax in fp32 everywhere).
FP32_TOL = 1e-5


def _model(attn: str, pattern: str = "M*-*") -> NemotronHForCausalLM:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_hf_config(pattern), default_backend().replace(attn=attn))
    return randomize_(model).eval()


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Wrap `am_precision.attention.<name>` so every call is counted."""
    calls: list[int] = []
    inner = getattr(attention_kernels, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, name, counted)
    return calls


@pytest.mark.parametrize(("attn", "kernel"), [("eager", "eager_attention"), ("flex", "_flex_attention")])
def test_each_runnable_attention_backend_runs_its_own_kernel_and_equals_sdpa(monkeypatch, attn, kernel) -> None:
    reference = _model("sdpa")
    model = _model(attn)
    model.load_state_dict(reference.state_dict())
    assert set(model.state_dict()) == set(reference.state_dict())  # the backend adds no checkpoint keys
    ids = tokens(2, 11)
    padding = torch.ones_like(ids)
    padding[1, :3] = 0  # left padding: the boolean-mask path, next to the plain causal one of row-free batches
    calls = _counting(monkeypatch, kernel)
    with torch.no_grad():
        for mask in (None, padding):
            got = model(ids, attention_mask=mask).logits
            want = reference(ids, attention_mask=mask).logits
            torch.testing.assert_close(got, want, rtol=FP32_TOL, atol=FP32_TOL)
    assert len(calls) == 2 * 2  # two attention layers, two forwards: every call went through the chosen kernel


def test_eager_attention_trains_like_sdpa() -> None:
    reference, model = _model("sdpa"), _model("eager")
    model.load_state_dict(reference.state_dict())
    ids = tokens(2, 9)
    for m in (reference, model):
        m.train()
        m(ids, labels=ids).loss.backward()
    for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_flex_refuses_cpu_training_with_the_reason() -> None:
    model = _model("flex").train()
    ids = tokens(1, 8)
    with pytest.raises(RuntimeError, match="no FlexAttention backward on the CPU"):
        model(ids, labels=ids)


@pytest.mark.parametrize(
    ("attn", "missing"),
    [
        ("tilelang", "TileLang sparse-attention kernels"),
        ("te", "needs Transformer Engine"),
        ("cudnn", "needs a CUDA GPU"),
    ],
)
def test_attention_backends_that_cannot_run_here_are_refused_naming_what_is_missing(attn, missing) -> None:
    if attn == "te" and flags.HAVE_TE:
        pytest.skip("Transformer Engine is installed here")
    if attn == "cudnn" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match=missing) as err:
        NemotronHForCausalLM(tiny_hf_config("*"), default_backend().replace(attn=attn))
    assert "not implemented" not in str(err.value)


def test_te_attention_without_cuda_names_cuda(monkeypatch) -> None:
    monkeypatch.setattr(flags, "HAVE_TE", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="attn='te' needs a CUDA GPU"):
        NemotronHForCausalLM(tiny_hf_config("*"), default_backend().replace(attn="te"))


def test_values_are_never_rewritten_and_every_problem_is_listed_once(caplog) -> None:
    backend = BackendConfig(attn="tilelang", linear="torch", experts="gmm", dispatcher="hybridep")
    with (
        caplog.at_level(logging.WARNING, logger="am_models_nemotron"),
        pytest.raises(ValueError, match="cannot run as asked") as err,
    ):
        NemotronHForCausalLM(tiny_hf_config("*E"), backend)
    message = str(err.value)
    assert "attn='tilelang'" in message
    assert "experts='gmm'" in message
    assert "dispatcher='hybridep'" in message
    assert not caplog.records  # refused, not resolved with a warning


def test_supported_values_are_returned_unchanged() -> None:
    assert set(SUPPORTED_BACKENDS) == {"attn", "experts", "dispatcher"}
    implemented = default_backend()
    assert resolve_backend(implemented) is implemented
    assert resolve_backend(None) == implemented
    for attn in ("sdpa", "eager", "flex"):
        chosen = implemented.replace(attn=attn)
        assert resolve_backend(chosen) is chosen


def test_rope_fusion_is_refused_because_the_attention_has_no_rope() -> None:
    """Nemotron-H's attention is NoPE: rope_fusion=True has nothing to fuse, so it is refused (never ignored)."""
    with pytest.raises(ValueError, match="no positional encoding"):
        NemotronHForCausalLM(tiny_hf_config("*"), default_backend().replace(rope_fusion=True))
    with pytest.raises(ValueError, match="rope='quack' picks a rotary-embedding kernel"):
        NemotronHForCausalLM(tiny_hf_config("*"), default_backend().replace(rope="quack"))


def test_fsdp_optimizations_drive_the_fsdp_hooks_only_when_asked(monkeypatch) -> None:
    """enable_fsdp_optimizations: the model's prepare_for_grad_accumulation / prepare_for_final_backward (upstream's
    MoE FSDP hooks) call am-precision's deferred-sync functions with pp_enabled; without it they do nothing. The
    sync itself is tested on a 2-rank FSDP2 group in am-precision (test_fsdp2.py)."""
    import am_models_nemotron.pretrained as model_module  # the hooks live on the base, NemotronHPreTrainedModel

    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        model_module, "prepare_for_grad_accumulation", lambda m, *, pp_enabled: seen.append(("acc", pp_enabled))
    )
    monkeypatch.setattr(
        model_module, "prepare_for_final_backward", lambda m, *, pp_enabled: seen.append(("final", pp_enabled))
    )
    plain = NemotronHForCausalLM(tiny_hf_config("*"), default_backend())
    plain.prepare_for_grad_accumulation()
    plain.prepare_for_final_backward()
    assert seen == []
    optimized = NemotronHForCausalLM(tiny_hf_config("*"), default_backend().replace(enable_fsdp_optimizations=True))
    optimized.prepare_for_grad_accumulation(pp_enabled=False)
    optimized.prepare_for_final_backward(pp_enabled=True)
    assert seen == [("acc", False), ("final", True)]


def test_te_values_are_refused_naming_transformer_engine_all_at_once() -> None:
    """TE linears, TE norms and FP8 need Transformer Engine and CUDA: one ValueError names every field."""
    if flags.HAVE_TE:
        pytest.skip("Transformer Engine is installed here")
    backend = default_backend().replace(linear="te", rms_norm="te", te_fp8={"recipe": "current"})
    with pytest.raises(ValueError, match="cannot run as asked") as err:
        NemotronHForCausalLM(tiny_hf_config("*"), backend)
    message = str(err.value)
    for what in ("linear='te' needs Transformer Engine", "rms_norm='te' needs", "te_fp8 (TE FP8 autocast) needs"):
        assert what in message


def test_te_fp8_block_forward_runs_inside_the_fp8_autocast(monkeypatch) -> None:
    """The block enters `te_fp8.maybe_te_autocast()` around its mixer (where TE modules would compute in FP8)."""
    import contextlib

    from am_models_nemotron import NemotronBlock
    from am_precision import TEFp8Config

    entered: list[str] = []

    @contextlib.contextmanager
    def autocast(self):
        entered.append(self.recipe)
        yield

    monkeypatch.setattr(TEFp8Config, "maybe_te_autocast", autocast)
    block = NemotronBlock(tiny_hf_config("-"), 0, backend=default_backend())
    x = torch.randn(1, 4, 32)
    plain = block(x)
    assert entered == []
    block.te_fp8 = TEFp8Config(recipe="block")
    torch.testing.assert_close(block(x), plain)  # torch modules: same numbers, inside the autocast
    assert entered == ["block"]


def test_backbone_takes_a_raw_config_and_an_optional_positional_backend() -> None:
    config = tiny_hf_config("M*E")
    assert isinstance(NemotronV3Model(config).layers["0"].mixer, torch.nn.Module)
    model = NemotronV3Model(config, BackendConfig(attn="eager", linear="torch", experts="torch", dispatcher="torch"))
    assert model.backend.attn == "eager"
    assert model.layers["1"].mixer.core_attention.attn == "eager"


def test_context_parallelism_refuses_a_kernel_the_ring_would_replace() -> None:
    """Under CP every chunk runs am-context-parallel's ring kernel: a non-SDPA choice is refused before any
    collective (the `cp_problems` hook), not silently replaced."""
    problems = _model("eager").cp_problems(seq_len=16, local_seq_len=8, cp_size=2)
    assert any("attn='eager'" in p and "use attn='sdpa' with cp > 1" in p for p in problems)
    assert not any("attn=" in p for p in _model("sdpa").cp_problems(seq_len=16, local_seq_len=8, cp_size=2))


def test_without_the_hf_adapter_checkpoints_hold_the_native_keys(tmp_path) -> None:
    """enable_hf_state_dict_adapter=False: save_pretrained writes model.state_dict()'s own keys (stacked experts,
    the fp32 holder) and from_pretrained reads them back exactly; the HF layout stays the default."""
    from am_model_io import read_safetensors_folder

    native = default_backend().replace(enable_hf_state_dict_adapter=False)
    torch.manual_seed(0)
    model = randomize_(NemotronHForCausalLM(tiny_hf_config("M*E"), native))
    model.save_pretrained(tmp_path / "native")
    written = read_safetensors_folder(tmp_path / "native")
    assert set(written) == set(model.state_dict())
    assert written["model.layers.2.mixer.experts.up_proj"].dim() == 3  # stacked [E, out, in], not per expert
    assert written["model.layers.0.mixer._fp32_params.A_log"].dtype == torch.float32
    loaded = NemotronHForCausalLM.from_pretrained(tmp_path / "native", backend=native)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    model_hf = NemotronHForCausalLM(tiny_hf_config("M*E"), default_backend())
    model_hf.save_pretrained(tmp_path / "hf")
    assert "backbone.embeddings.weight" in read_safetensors_folder(tmp_path / "hf")


def test_load_sharded_checkpoint_uses_the_native_layout_without_the_hf_adapter(tmp_path) -> None:
    """enable_hf_state_dict_adapter=False: `load_sharded_checkpoint` reads the native layout `save_pretrained` wrote,
    exactly, and checks it in that layout as `from_pretrained` does: a missing tensor is named by its native key, and
    a checkpoint in NVIDIA's HF naming is refused (it was read through the HF adapter whatever the backend said)."""
    from am_model_io import write_safetensors
    from am_models_nemotron import load_sharded_checkpoint

    native = default_backend().replace(enable_hf_state_dict_adapter=False)
    torch.manual_seed(0)
    model = randomize_(NemotronHForCausalLM(tiny_hf_config("M*E"), native))
    model.save_pretrained(tmp_path / "native")
    NemotronHForCausalLM(tiny_hf_config("M*E"), default_backend()).save_pretrained(tmp_path / "hf")
    holed = {k: v for k, v in model.state_dict().items() if k != "model.norm.weight"}
    (tmp_path / "holed").mkdir()
    write_safetensors(holed, tmp_path / "holed", max_shard_size=None)

    def target() -> NemotronHForCausalLM:
        return NemotronHForCausalLM(tiny_hf_config("M*E"), native, device="meta").to_empty(device="cpu")

    loaded = target()
    report = load_sharded_checkpoint(loaded, tmp_path / "native")
    assert set(report.names) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match=r"model\.norm\.weight") as info:
        load_sharded_checkpoint(target(), tmp_path / "holed")
    assert "backbone.norm_f.weight" not in str(info.value)
    with pytest.raises(ValueError, match=r"backbone\.embeddings\.weight"):
        load_sharded_checkpoint(target(), tmp_path / "hf")
    with pytest.raises(ValueError, match=r"backbone\.embeddings\.weight"):  # the same refusal as from_pretrained's
        NemotronHForCausalLM.from_pretrained(tmp_path / "hf", backend=native)


LIBRARY_VALUES = [
    ({"experts": "te", "dispatcher": "deepep"}, ("experts='te' (TE GroupedLinear) needs", "`deep_ep` package")),
    ({"experts": "gmm", "dispatcher": "uccl_ep"}, ("experts='gmm' needs the `grouped_gemm` package", "`uccl_ep`")),
    ({"experts": "torch_mm", "dispatcher": "hybridep"}, ("dispatcher='hybridep' needs the `deep_ep` package",)),
]


@pytest.mark.parametrize(("fields", "missing"), LIBRARY_VALUES, ids=lambda v: str(v))
def test_library_experts_and_dispatchers_are_refused_here_naming_the_library_and_cuda(fields, missing) -> None:
    """experts te / gmm and the dispatchers deepep / hybridep / uccl_ep are the model's (SUPPORTED_BACKENDS); on a
    machine without the library and CUDA they are refused naming both, never as "not implemented"."""
    if flags.HAVE_TE or flags.HAVE_GMM or flags.HAVE_DEEP_EP or flags.HAVE_UCCL_EP or torch.cuda.is_available():
        pytest.skip("a library or CUDA is present here")
    assert fields["experts"] in SUPPORTED_BACKENDS["experts"]
    assert fields["dispatcher"] in SUPPORTED_BACKENDS["dispatcher"]
    with pytest.raises(ValueError, match="cannot run as asked") as err:
        NemotronHForCausalLM(tiny_hf_config("*E"), default_backend().replace(**fields))
    message = str(err.value)
    for what in missing:
        assert what in message
    assert "torch.cuda.is_available() is False" in message
    assert "not implemented" not in message


def test_library_backends_build_the_library_experts_and_refuse_a_forward_without_ep(monkeypatch) -> None:
    """Where the libraries and CUDA exist (faked: `backend_runtime_problems` finds nothing missing), experts='te' /
    'gmm' build am-moe's TE / grouped_gemm experts, and a library dispatcher refuses to run before
    apply_expert_parallel shards the experts (it moves tokens between ep ranks)."""
    import am_models_nemotron.backend as backend_module

    monkeypatch.setattr(backend_module, "backend_runtime_problems", lambda backend, *, fields: [])
    for experts, dispatcher in (("te", "deepep"), ("gmm", "hybridep"), ("torch", "uccl_ep")):
        backend = default_backend().replace(experts=experts, dispatcher=dispatcher)
        model = NemotronHForCausalLM(tiny_hf_config("E"), backend)
        moe = model.model.layers["0"].mixer
        assert moe.experts.grouped_mm == {"te": "te", "gmm": "gmm", "torch": "loop"}[experts]
        with pytest.raises(ValueError, match=f"dispatcher='{dispatcher}' moves tokens between expert-parallel"):
            model(input_ids=tokens(1, 4))


def test_mxfp8_experts_are_refused_off_blackwell_and_build_am_moe_mxfp8_experts_on_it(monkeypatch) -> None:
    """experts='torch_mm_mxfp8' is the model's: refused off Blackwell naming the GPU it needs; where the check passes
    (faked here) the MoE layers build am-moe's MXFP8 experts (grouped_mm="mxfp8")."""
    import am_models_nemotron.backend as backend_module

    backend = default_backend().replace(experts="torch_mm_mxfp8")
    assert "torch_mm_mxfp8" in SUPPORTED_BACKENDS["experts"]
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10):
        with pytest.raises(ValueError, match="Blackwell") as err:
            NemotronHForCausalLM(tiny_hf_config("*E"), backend)
        assert "not implemented" not in str(err.value)
    monkeypatch.setattr(backend_module, "backend_runtime_problems", lambda backend, *, fields: [])
    model = NemotronHForCausalLM(tiny_hf_config("E"), backend)
    assert model.model.layers["0"].mixer.experts.grouped_mm == "mxfp8"
    if not torch.cuda.is_available():  # am-moe names what its MXFP8 kernel lacks here, never runs another kernel
        with pytest.raises(ValueError, match="'mxfp8' cannot run here") as refused:
            model(input_ids=tokens(1, 4))
        assert "the MXFP8 grouped GEMM runs only on CUDA" in str(refused.value)


def test_expert_parallel_options_pass_the_dispatcher_fields_as_upstream_names_them() -> None:
    from am_models_nemotron.backend import expert_parallel_options

    backend = BackendConfig(
        attn="sdpa",
        linear="torch",
        experts="torch_mm",
        dispatcher="deepep",
        dispatcher_num_sms=24,
        dispatcher_async_dispatch=True,
        dispatcher_share_token_dispatcher=False,
    )
    expected = {
        "dispatcher": "deepep",
        "dispatcher_num_sms": 24,
        "dispatcher_async_dispatch": True,
        "dispatcher_share_token_dispatcher": False,
    }
    assert expert_parallel_options(backend) == expected
    assert expert_parallel_options(backend, dispatcher="torch_token") == expected | {"dispatcher": "torch_token"}
