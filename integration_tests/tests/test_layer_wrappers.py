"""`--activation-checkpointing` and `--compile` (trainer/layer_wrappers.py): per decoder layer, parameter names
kept, the loss and every gradient unchanged by checkpointing, support decided by am-capabilities."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import TINY_ARGS
from trainer.config import parse_args
from trainer.layer_wrappers import (
    activation_checkpointing_problems,
    apply_activation_checkpointing,
    apply_compile,
    is_activation_checkpointed,
    is_compiled,
)
from trainer.loop import TokenSumLoss
from trainer.models import build_model, preset_spec
from trainer.validation import BadInput, validate

from am_pipelining import PipelineCausalLMLoss, find_layers


def _loss_and_grads(model: torch.nn.Module, windows: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, labels = windows[:, :-1], windows[:, 1:]
    loss_fn = TokenSumLoss()
    loss_fn.denominator = float(labels.numel())
    loss = PipelineCausalLMLoss(loss_fn, model=model)(model(input_ids=inputs), labels)  # the trainer's loss path
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# Every term of am-moe's balancing on, so a recomputed forward that counted again would show in the sums.
BALANCING = dict(bias_update_rate=1e-3, aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01, z_loss_coeff=0.001)


def _gemma4_kv_sharing() -> torch.nn.Module:
    """Gemma 4 whose last two layers reuse the K/V their store layers publish during the forward (the published
    configurations' KV sharing): a recomputed reuse layer must read the same K/V as its first pass."""
    from trainer.models import gemma4_config

    from am_models_gemma4 import Gemma4ForCausalLM

    config = gemma4_config(hidden_size=32, num_layers=4, moe=False, vocab_size=256)
    config.num_kv_shared_layers = 2
    torch.manual_seed(0)
    return Gemma4ForCausalLM(config)


def _twins(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    if family == "gemma4-kv-sharing":
        plain = _gemma4_kv_sharing()
        return plain, copy.deepcopy(plain)
    spec = preset_spec(family, hidden_size=32, num_layers=4, mtp_depths=1, tie_embeddings=False, vocab_size=None)
    return build_model(spec, seed=0), build_model(spec, seed=0)


@pytest.mark.parametrize("family", ["nemotron", "llama", "gemma4", "gemma4-moe", "gemma4-kv-sharing"])
def test_activation_checkpointing_changes_neither_loss_nor_gradients(family: str) -> None:
    """Checkpointed layers give the plain run's loss and gradients, keep every parameter name and state-dict key,
    and (MoE) count the expert load and the balancing terms of each forward once: the recomputation in backward
    adds nothing to them."""
    from am_moe import LoadBalancing, aux_loss_values, configure_load_balancing, expert_load

    plain, checkpointed = _twins(family)
    moe = family in ("nemotron", "gemma4-moe")
    if moe:  # Gemma 4's softmax router has no selection bias to update
        rates = BALANCING if family == "nemotron" else {**BALANCING, "bias_update_rate": 0.0}
        for model in (plain, checkpointed):
            configure_load_balancing(model, LoadBalancing(**rates))
    names, keys = [name for name, _ in checkpointed.named_parameters()], list(checkpointed.state_dict())
    assert apply_activation_checkpointing(checkpointed) == 4
    assert [name for name, _ in checkpointed.named_parameters()] == names, "parameter names must not change"
    assert list(checkpointed.state_dict()) == keys, "state-dict keys must not change"
    assert all(is_activation_checkpointed(layer) for layer in find_layers(checkpointed).layers)
    assert not any(is_activation_checkpointed(layer) for layer in find_layers(plain).layers)
    # Proof that the layers really recompute: a submodule of the first layer runs twice per step (forward, then
    # again inside backward) with checkpointing, once without.
    calls = {"plain": 0, "checkpointed": 0}
    for key, model in (("plain", plain), ("checkpointed", checkpointed)):
        first = next(m for m in find_layers(model).layers[0].modules() if isinstance(m, torch.nn.Linear))
        first.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    windows = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    want_loss, want_grads = _loss_and_grads(plain, windows)
    got_loss, got_grads = _loss_and_grads(checkpointed, windows)
    assert calls == {"plain": 1, "checkpointed": 2}
    assert torch.equal(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    if moe:
        want_load, got_load = expert_load(plain).tokens_per_expert, expert_load(checkpointed).tokens_per_expert
        assert want_load
        assert got_load.keys() == want_load.keys()
        for layer, counts in want_load.items():
            assert torch.equal(got_load[layer], counts), layer
        want_terms, got_terms = aux_loss_values(plain), aux_loss_values(checkpointed)
        assert sum(want_terms.values()) > 0, want_terms
        assert got_terms == pytest.approx(want_terms, rel=1e-6)
    assert apply_activation_checkpointing(checkpointed) == 4  # idempotent: still one checkpoint per layer
    _loss_and_grads(checkpointed, windows)
    assert calls["checkpointed"] == 4


def test_compiled_layers_give_the_eager_loss_and_gradients() -> None:
    """--compile end to end on the CPU (inductor): a 2-layer Llama whose layers are compiled trains one step with the
    eager loss and gradients (compiled kernels may reorder fp32 sums, hence the tolerance)."""
    spec = preset_spec("llama", hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=False, vocab_size=None)
    eager, compiled = build_model(spec, seed=0), build_model(spec, seed=0)
    assert apply_compile(compiled) == 2
    windows = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    want_loss, want_grads = _loss_and_grads(eager, windows)
    got_loss, got_grads = _loss_and_grads(compiled, windows)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_model_without_gradient_checkpointing_support_is_refused(tmp_path: Path) -> None:
    """Support is the class's declaration (am-capabilities' rule): a class that does not declare
    supports_gradient_checkpointing = True is refused up front; Gemma 4 (dense and MoE) and every MoE model under
    expert parallelism are accepted."""

    class Undeclared(torch.nn.Module):
        pass

    problems = activation_checkpointing_problems(Undeclared(), mesh=None)
    assert len(problems) == 1
    assert "--activation-checkpointing: Undeclared does not support gradient" in problems[0]
    args = [*TINY_ARGS, "--model", "llama", "--activation-checkpointing", "--compile", "--out", str(tmp_path)]
    with pytest.raises(BadInput, match=r"--activation-checkpointing with --compile: torch cannot compile"):
        validate(parse_args(args), world_size=1)
    for model, ep in (("gemma4", 1), ("gemma4-moe", 2), ("nemotron", 2)):
        layout = ["--model", model, "--dp", str(ep), "--ep", str(ep), "--activation-checkpointing"]
        validate(parse_args([*TINY_ARGS, "--layers", "4", *layout, "--out", str(tmp_path)]), world_size=ep)


def test_compile_reaches_every_decoder_layer() -> None:
    """--compile compiles each decoder layer in place (names kept); compiling itself happens on the first forward,
    too slow on 2 CPU cores to run here for every family."""
    spec = preset_spec("llama", hidden_size=32, num_layers=3, mtp_depths=0, tie_embeddings=False, vocab_size=None)
    model = build_model(spec, seed=0)
    names = [name for name, _ in model.named_parameters()]
    assert apply_compile(model) == 3
    assert all(is_compiled(layer) for layer in find_layers(model).layers)
    assert not is_compiled(model)
    assert not is_compiled(model.lm_head)
    assert [name for name, _ in model.named_parameters()] == names
    assert parse_args(["--compile"]).compile
