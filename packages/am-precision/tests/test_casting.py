"""cast_model_to_dtype, yield_fp32_model and cast_frozen_modules_to_compute_dtype on plain (unsharded) models.

Contract: unpinned floating tensors end in the target dtype with exactly `tensor.to(dtype)` values; pinned ones end
in fp32 bit-identical to their values before the cast; skipped subtrees are untouched; integers are left alone.
FSDP2 cases live in test_fsdp2.py.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from am_precision_toy_models import UNROUNDABLE, ToyLM, bf16_would_round, snapshot
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from am_precision import cast_frozen_modules_to_compute_dtype, cast_model_to_dtype, yield_fp32_model

BF16 = torch.bfloat16


def assert_cast(
    model: nn.Module,
    before: dict[str, torch.Tensor],
    pinned: set[str],
    dtype=BF16,
    skipped: frozenset[str] = frozenset(),
) -> None:
    """Pinned names: fp32 and bit-identical; skipped: untouched; other floating tensors: exactly before.to(dtype)."""
    now = dict(model.named_parameters())
    now.update(model.named_buffers())
    assert set(now) == set(before)
    for name, tensor in now.items():
        if name in skipped:
            assert tensor.dtype == before[name].dtype, name
            assert torch.equal(tensor, before[name]), name
            continue
        old = before[name]
        if not old.is_floating_point():
            assert torch.equal(tensor, old), name
        elif name in pinned:
            assert tensor.dtype == torch.float32, name
            assert torch.equal(tensor, old.float()), name
        else:
            assert tensor.dtype == dtype, name
            assert torch.equal(tensor, old.to(dtype)), name


def names_matching(model: nn.Module, *keywords: str) -> set[str]:
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return {n for n in names if any(k in n for k in keywords)}


def test_test_values_are_ones_bf16_would_round():
    model = ToyLM()
    assert bf16_would_round(model.layers[0].router.e_score_correction_bias)
    assert bf16_would_round(model.final_norm.weight)
    assert bf16_would_round(torch.tensor([UNROUNDABLE]))


def test_strict_buffer_and_non_strict_norms_keep_exact_fp32_values():
    model = ToyLM()
    before = snapshot(model)
    returned = cast_model_to_dtype(model, BF16)
    assert returned is model
    assert_cast(model, before, names_matching(model, "norm", "router.e_score_correction_bias"))


def test_without_keep_lists_everything_floating_is_cast():
    model = ToyLM()
    model._keep_in_fp32_modules_strict = None
    model._keep_in_fp32_modules = None
    before = snapshot(model)
    cast_model_to_dtype(model, BF16)
    assert_cast(model, before, set())
    assert model.step.dtype == torch.int64


@pytest.mark.parametrize("container", [tuple, set])
def test_tuple_and_set_keep_lists(container):
    model = ToyLM()
    model._keep_in_fp32_modules_strict = container(["lm_head"])
    model._keep_in_fp32_modules = container(["final_norm", "layers.1.proj"])
    before = snapshot(model)
    cast_model_to_dtype(model, BF16)
    assert_cast(model, before, names_matching(model, "lm_head", "final_norm", "layers.1.proj"))


@pytest.mark.parametrize("keyword", ["rotary_emb", "inv_freq"])
def test_rope_inv_freq_kept_only_when_a_keyword_protects_it(keyword):
    unprotected = ToyLM()
    exact = unprotected.rotary_emb.inv_freq.clone()
    assert bf16_would_round(exact)
    cast_model_to_dtype(unprotected, BF16)
    assert unprotected.rotary_emb.inv_freq.dtype == BF16
    assert not torch.equal(unprotected.rotary_emb.inv_freq.float(), exact)

    protected = ToyLM()
    protected._keep_in_fp32_modules = ["norm", keyword]
    cast_model_to_dtype(protected, BF16)
    assert protected.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(protected.rotary_emb.inv_freq, exact)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_activation_checkpoint_wrapper_names_are_resolved():
    """Keywords written against unwrapped names ("layers.0.norm") match `layers.0._checkpoint_wrapped_module.norm`."""
    model = ToyLM()
    model._keep_in_fp32_modules = ["layers.0.norm"]
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    before = snapshot(model)
    assert "layers.0._checkpoint_wrapped_module.norm.weight" in before
    cast_model_to_dtype(model, BF16)
    pinned = names_matching(model, "layers.0._checkpoint_wrapped_module.norm", "router.e_score_correction_bias")
    assert len(pinned) == 3
    assert_cast(model, before, pinned)
    model(torch.tensor([[1, 2, 3]])).sum().backward()  # still a working model


def test_skip_modules_top_level_and_nested_keep_their_dtype_and_identity():
    model = ToyLM()
    model._fp32_params = nn.Module()  # an fp32 parameter holder, as in NemotronH
    model._fp32_params.a_log = nn.Parameter(torch.full((4,), UNROUNDABLE))
    model.layers[1].router._fp32_params = nn.Linear(2, 2)
    holder, nested = model._fp32_params, model.layers[1].router._fp32_params
    holder_param = holder.a_log
    before = snapshot(model)
    cast_model_to_dtype(model, BF16, skip_modules=("_fp32_params",))
    assert model._fp32_params is holder
    assert model.layers[1].router._fp32_params is nested
    assert holder.a_log is holder_param
    skipped = frozenset(names_matching(model, "_fp32_params"))
    assert len(skipped) == 3
    assert {model.get_parameter(n).dtype for n in skipped} == {torch.float32}
    assert_cast(model, before, names_matching(model, "norm", "router.e_score_correction_bias"), skipped=skipped)


def test_skip_modules_by_dotted_name_and_skipped_holders_are_left_in_their_dtype():
    model = ToyLM()
    model.layers[0].to(torch.float16)
    cast_model_to_dtype(model, BF16, skip_modules=["layers.0"])
    assert {p.dtype for p in model.layers[0].parameters()} == {torch.float16}
    assert model.layers[1].proj.weight.dtype == BF16


def test_skip_modules_rejects_a_bare_string():
    with pytest.raises(TypeError, match=r"write \('_fp32_params',\)"):
        cast_model_to_dtype(ToyLM(), BF16, skip_modules="_fp32_params")


def test_non_floating_dtype_is_rejected():
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        cast_model_to_dtype(ToyLM(), torch.int8)


def test_pinned_tensor_stored_in_another_dtype_is_upcast_to_fp32():
    model = ToyLM().to(BF16)
    cast_model_to_dtype(model, torch.float16)
    assert model.final_norm.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float16


def test_tied_weights_stay_tied_and_an_alias_match_pins_them():
    model = ToyLM()
    model.lm_head.weight = model.embed.weight
    model._keep_in_fp32_modules = ["norm", "lm_head"]
    exact = model.embed.weight.detach().clone()
    cast_model_to_dtype(model, BF16)
    assert model.lm_head.weight is model.embed.weight
    assert model.embed.weight.dtype == torch.float32
    assert torch.equal(model.embed.weight, exact)


def test_gradients_follow_their_parameters():
    model = ToyLM()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    cast_model_to_dtype(model, BF16)
    assert model.final_norm.weight.grad.dtype == torch.float32
    assert model.lm_head.weight.grad.dtype == BF16


def test_yield_fp32_model_restores_initial_dtype_and_keeps_pins():
    model = ToyLM()
    cast_model_to_dtype(model, BF16)
    with yield_fp32_model(model) as inside:
        assert inside is model
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        with torch.no_grad():
            model.lm_head.weight.fill_(UNROUNDABLE)
            model.final_norm.weight.fill_(UNROUNDABLE)
    assert model.lm_head.weight.dtype == BF16
    assert torch.equal(model.lm_head.weight, torch.full_like(model.lm_head.weight, UNROUNDABLE))  # rounded once
    assert torch.equal(model.final_norm.weight, torch.full((8,), UNROUNDABLE))  # pinned: exact


def test_yield_fp32_model_explicit_dtype_and_restores_on_error():
    model = ToyLM()
    with pytest.raises(RuntimeError, match="boom"), yield_fp32_model(model, torch.float16):
        raise RuntimeError("boom")
    assert model.lm_head.weight.dtype == torch.float16
    assert model.final_norm.weight.dtype == torch.float32


class NormFirstBlock(nn.Module):
    """Its first parameter is a kept-fp32 norm: it says nothing about the storage dtype."""

    _keep_in_fp32_modules: ClassVar[list[str]] = ["norm"]

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(4)
        self.proj = nn.Linear(4, 4)


@pytest.mark.parametrize("storage", [BF16, torch.float16])
def test_yield_fp32_model_default_restores_the_storage_dtype_not_a_pinned_params(storage):
    model = NormFirstBlock()
    cast_model_to_dtype(model, storage)
    with yield_fp32_model(model):
        assert model.proj.weight.dtype == torch.float32
    assert model.norm.weight.dtype == torch.float32
    assert model.proj.weight.dtype == storage
    assert model.proj.bias.dtype == storage


def test_yield_fp32_model_default_ignores_skipped_holders():
    model = nn.Module()
    model._fp32_params = nn.Linear(2, 2)  # an fp32 holder registered first
    model.proj = nn.Linear(2, 2)
    cast_model_to_dtype(model, BF16, skip_modules=("_fp32_params",))
    with yield_fp32_model(model, skip_modules=("_fp32_params",)):
        assert model.proj.weight.dtype == torch.float32
    assert model.proj.weight.dtype == BF16
    assert model._fp32_params.weight.dtype == torch.float32


def test_yield_fp32_model_with_mixed_storage_dtypes_asks_for_restore_dtype():
    model = VisionLM()
    model.vision.requires_grad_(False)
    cast_frozen_modules_to_compute_dtype(model, BF16)  # frozen tower bf16, trainable head fp32
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"several dtypes.*pass restore_dtype=") as err, yield_fp32_model(model):
        pytest.fail("the block must not run")
    assert "torch.bfloat16" in str(err.value)
    assert "torch.float32" in str(err.value)
    assert all(t.dtype == before[n].dtype for n, t in snapshot(model).items())  # nothing was cast
    with yield_fp32_model(model, restore_dtype=BF16):
        pass
    assert model.head.weight.dtype == BF16


def test_yield_fp32_model_without_float_params_restores_fp32():
    model = nn.Module()
    model.register_buffer("x", torch.zeros(2, dtype=BF16))
    with yield_fp32_model(model):
        assert model.x.dtype == torch.float32
    assert model.x.dtype == torch.float32


# ---- cast_frozen_modules_to_compute_dtype ----------------------------------------------------------------------


class VisionLM(nn.Module):
    _keep_in_fp32_modules: ClassVar[list[str]] = ["norm"]

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
        self.vision.register_buffer("pixel_scale", torch.full((4,), UNROUNDABLE))
        self.head = nn.Linear(4, 3)


def test_frozen_tower_params_and_buffers_go_to_compute_dtype_trainable_head_stays():
    model = VisionLM()
    model.vision.requires_grad_(False)
    before = snapshot(model)
    cast_frozen_modules_to_compute_dtype(model, BF16)
    for name in ("vision.0.weight", "vision.0.bias", "vision.2.weight", "vision.pixel_scale"):
        tensor = model.get_parameter(name) if "pixel" not in name else model.vision.pixel_scale
        assert tensor.dtype == BF16, name
        assert torch.equal(tensor, before[name].to(BF16)), name
    assert model.vision[1].weight.dtype == BF16  # "vision.1" holds no keep keyword: frozen and cast
    assert model.head.weight.dtype == torch.float32
    assert model.head.weight.requires_grad


def test_keep_list_protects_frozen_norms():
    model = VisionLM()
    model.vision = nn.ModuleDict({"proj": nn.Linear(4, 4), "norm": nn.LayerNorm(4)})
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    cast_frozen_modules_to_compute_dtype(model, BF16)
    assert model.vision["proj"].weight.dtype == BF16
    assert model.vision["norm"].weight.dtype == torch.float32


def test_fully_trainable_model_and_none_dtype_are_no_ops():
    model = VisionLM()
    before = snapshot(model)
    cast_frozen_modules_to_compute_dtype(model, BF16)
    assert all(torch.equal(t, before[n]) and t.dtype == torch.float32 for n, t in snapshot(model).items())
    model.requires_grad_(False)
    cast_frozen_modules_to_compute_dtype(model, None)
    assert all(t.dtype == torch.float32 for t in snapshot(model).values())


class LoRALinear(nn.Linear):
    """Frozen base weight + trainable low-rank adapter children (the mixed-subtree pattern)."""

    def __init__(self, in_features: int, out_features: int, rank: int = 2) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.weight.requires_grad_(False)
        self.lora_a = nn.Linear(in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_b(self.lora_a(x))


def test_lora_mixed_subtree_is_cast_whole_while_other_trainables_stay():
    model = nn.Module()
    model.q_proj = LoRALinear(4, 4)
    model.head = nn.Linear(4, 2)
    model.frozen = nn.Linear(4, 4).requires_grad_(False)
    cast_frozen_modules_to_compute_dtype(model, BF16)
    assert model.q_proj.weight.dtype == BF16
    assert model.q_proj.lora_a.weight.dtype == BF16
    assert model.q_proj.lora_b.weight.dtype == BF16
    assert model.q_proj.lora_a.weight.requires_grad
    assert model.frozen.weight.dtype == BF16
    assert model.head.weight.dtype == torch.float32
    out = model.q_proj(torch.randn(3, 4, dtype=BF16))
    assert out.dtype == BF16
