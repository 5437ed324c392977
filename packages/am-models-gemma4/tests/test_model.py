"""Text model parity with transformers (fp32): logits, loss and gradients, through both checkpoint directions.

Dense and MoE configs mix sliding and full layers (full layers with global_head_dim, proportional RoPE,
attention_k_eq_v), final logit soft-capping and tied embeddings; norms and layer scalars are moved off their init
values so every parameter matters. Also: per-layer inputs with KV sharing, padding, packed documents, and the
pipeline-stage protocol (layers keyed by global index, rotary per layer type, transformers' masks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _g4_configs import VOCAB, perturb_, text_config, vlm_config
from transformers import Gemma4ForCausalLM as HFGemma4ForCausalLM
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from am_models_gemma4 import Gemma4ForCausalLM, Gemma4StateDictAdapter, gemma4_capabilities

RTOL = 1e-5  # fp32 parity with transformers, relative to the largest entry of the reference tensor


def _close(got: torch.Tensor, ref: torch.Tensor, *, rtol: float = RTOL) -> None:
    got, ref = got.detach(), ref.detach()
    scale = ref.abs().max().clamp(min=1e-12)
    assert float((got - ref).abs().max() / scale) <= rtol, float((got - ref).abs().max() / scale)


def _hf_model(tmp_path: Path, **config: Any) -> tuple[HFGemma4ForCausalLM, Path]:
    torch.manual_seed(0)
    hf = HFGemma4ForCausalLM(text_config(**config))
    perturb_(hf)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    return hf, folder


def _ids(batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _our_grads_in_hf_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return Gemma4StateDictAdapter.to_hf(grads)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_loss_and_gradients_match_transformers(tmp_path: Path, moe: bool) -> None:
    hf, folder = _hf_model(tmp_path, moe=moe)
    ours = Gemma4ForCausalLM.from_pretrained(folder)
    ids = _ids()
    ref = hf(input_ids=ids, labels=ids)
    got = ours(input_ids=ids, labels=ids)
    _close(got.logits, ref.logits)
    _close(got.loss, ref.loss)
    ref.loss.backward()
    got.loss.backward()
    ours_grads = _our_grads_in_hf_names(ours)
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert set(ours_grads) == set(hf_grads)
    for name, grad in hf_grads.items():
        _close(ours_grads[name], grad, rtol=5e-5)  # backward sums in another order (vectorised experts)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path: Path, moe: bool) -> None:
    torch.manual_seed(1)
    ours = Gemma4ForCausalLM(text_config(moe=moe))
    perturb_(ours, seed=1)
    ours.save_pretrained(tmp_path / "ours")
    hf = HFGemma4ForCausalLM.from_pretrained(tmp_path / "ours")
    ids = _ids(seed=1)
    _close(ours(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_per_layer_inputs_and_kv_sharing_match_transformers(tmp_path: Path) -> None:
    """E-series features: PLE, the last two layers reuse K/V (no k/v weights), double-wide MLP on them."""
    hf, folder = _hf_model(tmp_path, hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True)
    ours = Gemma4ForCausalLM.from_pretrained(folder)
    assert ours.model.layers["3"].self_attn.k_proj is None
    assert ours.model.layers["3"].mlp.intermediate_size == 2 * ours.config.intermediate_size
    ids = _ids()
    _close(ours(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_padding_matches_transformers_on_real_tokens(tmp_path: Path) -> None:
    hf, folder = _hf_model(tmp_path, moe=True)
    ours = Gemma4ForCausalLM.from_pretrained(folder)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    real = mask.bool()
    _close(ours(input_ids=ids, attention_mask=mask).logits[real], hf(input_ids=ids, attention_mask=mask).logits[real])


def test_packed_documents_equal_separate_sequences() -> None:
    """Two documents packed in one row (`_packed_seq_ids`, positions restarting) give each document's own logits."""
    torch.manual_seed(2)
    model = Gemma4ForCausalLM(text_config(moe=True))
    perturb_(model, seed=2)
    first, second = _ids(1, 7, seed=3), _ids(1, 10, seed=4)
    packed = torch.cat([first, second], dim=1)
    doc_ids = torch.tensor([[1] * 7 + [2] * 10])
    positions = torch.cat([torch.arange(7), torch.arange(10)]).unsqueeze(0)
    logits = model(input_ids=packed, position_ids=positions, _packed_seq_ids=doc_ids).logits
    _close(logits[:, :7], model(input_ids=first).logits)
    _close(logits[:, 7:], model(input_ids=second).logits)


def test_layers_run_as_pipeline_stages_with_transformers_masks() -> None:
    """What am-pipelining's Gemma 4 text forward does: embed, rotary per layer type, layers by global index with
    transformers' masks, norm — on two stages pruned from copies of the model."""
    torch.manual_seed(3)
    model = Gemma4ForCausalLM(text_config())
    perturb_(model, seed=3)
    ids = _ids(seq=12)
    expected = model(input_ids=ids).logits
    text = model.model
    assert text.config._attn_implementation == "sdpa"  # set when unset, so transformers builds 4-D masks
    assert list(text.layers.keys()) == ["0", "1", "2", "3"]
    assert text.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    for implementation in ("sdpa", "eager"):
        text.config._attn_implementation = implementation
        hidden = text.embed_tokens(ids)
        positions = torch.arange(12).unsqueeze(0)
        kwargs = {"config": text.config, "inputs_embeds": hidden, "attention_mask": None, "past_key_values": None}
        masks = {
            "full_attention": create_causal_mask(position_ids=positions, **kwargs),
            "sliding_attention": create_sliding_window_causal_mask(position_ids=positions, **kwargs),
        }
        for stage_layers in (["0", "1"], ["2", "3"]):
            for key in stage_layers:
                kind = text.config.layer_types[int(key)]
                hidden = text.layers[key](
                    hidden,
                    None,
                    shared_kv_states={},
                    position_embeddings=text.rotary_emb(hidden, positions, kind),
                    attention_mask=masks[kind],
                    position_ids=positions,
                    past_key_values=None,
                )
        logits = model.lm_head(text.norm(hidden))
        logits = torch.tanh(logits / 30.0) * 30.0
        _close(logits, expected)
        # the same masks as transformers' {layer_type: mask} mapping through the text model
        mapped = model.lm_head(text(inputs_embeds=text.embed_tokens(ids), attention_mask=masks).last_hidden_state)
        _close(torch.tanh(mapped / 30.0) * 30.0, expected)


def test_embedding_is_tied_to_the_lm_head() -> None:
    model = Gemma4ForCausalLM(text_config())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_capabilities_dense_pp_cp_moe_pp_cp_ep() -> None:
    dense, moe = gemma4_capabilities(text_config()), gemma4_capabilities(text_config(moe=True))
    assert dense["supports_pp"]
    assert dense["supports_cp"]
    assert not dense["supports_ep"]
    assert moe["supports_cp"]
    assert moe["supports_ep"]
    assert moe["supports_pp"]  # the pipeline passes the padding mask to every stage's MoE layers
    assert not gemma4_capabilities(text_config(hidden_size_per_layer_input=8))["supports_pp"]
    assert not gemma4_capabilities(text_config(moe=True, hidden_size_per_layer_input=8))["supports_pp"]
    assert Gemma4ForCausalLM.get_capabilities(text_config(moe=True)) == moe


def test_contract_declares_contiguous_cp_and_the_expert_parallel_hook() -> None:
    """What every infrastructure package reads (am-model-contract): contiguous CP with the model's own attention and
    hooks bound to the instance; the expert-parallel hook only for a MoE config."""
    from am_model_contract import contract_of

    dense_model, moe_model = Gemma4ForCausalLM(text_config()), Gemma4ForCausalLM(text_config(moe=True))
    dense, moe = contract_of(dense_model), contract_of(moe_model)
    assert dense.cp.layout == moe.cp.layout == "contiguous"
    assert dense.cp.owns_attention
    assert moe.cp.owns_attention
    assert dense.cp.options is not None
    assert dense.cp.options() == dense_model.get_cp_options()
    assert dense.cp.problems is not None
    assert dense.cp.problems(seq_len=8, local_seq_len=4, cp_size=2) == []
    assert (dense.ep.is_moe, dense.ep.apply) == (False, None)
    assert moe.ep.is_moe
    assert moe.ep.apply is not None
    assert moe.ep.apply.__self__ is moe_model
    # the whole model's plan (the text model's `_tp_plan` under `model.`), the one am-tensor-parallel applies
    assert dense.tp.plan is not None
    assert any(key.startswith("model.layers.") for key in dense.tp.plan)
    assert not hasattr(Gemma4ForCausalLM, "_cp_layout")
    assert not hasattr(Gemma4ForCausalLM, "_owns_cp_attention")


def test_am_capabilities_reads_the_declaration() -> None:
    """What am-capabilities concludes from the declaration (it is not a dependency: skipped when absent)."""
    am_capabilities = pytest.importorskip("am_capabilities")
    dense_model, moe_model = Gemma4ForCausalLM(text_config()), Gemma4ForCausalLM(text_config(moe=True))
    dense, moe = am_capabilities.ModelSupports(dense_model), am_capabilities.ModelSupports(moe_model)  # weak refs
    assert (dense.supports_pp, dense.supports_cp, dense.supports_ep) == (True, True, False)
    assert (moe.supports_pp, moe.supports_cp, moe.supports_ep) == (True, True, True)
    mesh = type("Mesh", (), {"pp_size": 2, "cp_size": 2, "ep_size": 2})()
    am_capabilities.validate_for_mesh(moe_model, mesh)  # pp x cp x ep: every axis is supported
    ple_moe = Gemma4ForCausalLM(text_config(moe=True, hidden_size_per_layer_input=8))
    with pytest.raises(ValueError, match="pp_size=2") as info:
        am_capabilities.validate_for_mesh(ple_moe, mesh)  # a stage would need the token ids (per-layer inputs)
    assert "cp_size" not in str(info.value)
    assert "ep_size" not in str(info.value)
    with pytest.raises(ValueError, match="num_experts=4 not divisible by 3"):
        am_capabilities.validate_for_mesh(moe_model, type("Mesh", (), {"ep_size": 3})())
    with pytest.raises(ValueError, match="ep_size=2: Gemma4ForCausalLM cannot use expert parallelism"):
        am_capabilities.validate_for_mesh(dense_model, mesh)


def test_unknown_arguments_are_rejected() -> None:
    model = Gemma4ForCausalLM(text_config())
    with pytest.raises(TypeError, match="pixel_values_videos"):
        model(input_ids=_ids(), pixel_values_videos=torch.zeros(1))


def test_cp_problems_name_attention_dropout_before_any_collective() -> None:
    """The hook a trainer asks up front (am-context-parallel's `model_cp_problems`, no process group): attention
    dropout while training, the rule the ring forward enforces (`Gemma4Attention.cp_problem`), one line naming every
    decoder layer; short shards are fine (the ring fetches whatever ranks a sliding window reaches)."""
    from am_context_parallel import model_cp_problems
    from am_models_gemma4 import Gemma4ForConditionalGeneration

    layers = ", ".join(f"model.layers.{i}.self_attn" for i in range(4))
    expected = f"attention_dropout=0.1 is not supported under context parallelism; set it to 0 (in {layers})"
    model = Gemma4ForCausalLM(text_config(attention_dropout=0.1)).train()
    assert model_cp_problems(model, seq_len=8, cp_size=4) == [expected]
    assert model_cp_problems(model.eval(), seq_len=8, cp_size=4) == []
    assert model_cp_problems(Gemma4ForCausalLM(text_config(moe=True)).train(), seq_len=2, cp_size=4) == []
    vlm = Gemma4ForConditionalGeneration(vlm_config(attention_dropout=0.1)).train()
    (problem,) = model_cp_problems(vlm, seq_len=8, cp_size=2)
    assert "model.language_model.layers.3.self_attn" in problem
    assert "vision_tower" not in problem  # the vision tower runs whole images, not the ring
