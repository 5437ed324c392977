"""`Gemma4ForConditionalGeneration` parity with transformers (fp32): text-only and image+text, both checkpoint ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _g4_configs import IMAGE_TOKEN, VOCAB, image_inputs, perturb_, vlm_config
from transformers import Gemma4ForConditionalGeneration as HFGemma4ForConditionalGeneration
from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig

from am_models_gemma4 import Gemma4ForConditionalGeneration, Gemma4StateDictAdapter

RTOL = 1e-5


def _close(got: torch.Tensor, ref: torch.Tensor, *, rtol: float = RTOL) -> None:
    got, ref = got.detach(), ref.detach()
    scale = ref.abs().max().clamp(min=1e-12)
    assert float((got - ref).abs().max() / scale) <= rtol, float((got - ref).abs().max() / scale)


def _image_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, IMAGE_TOKEN - 4, (1, 14), generator=torch.Generator().manual_seed(0))
    ids[0, 3:7] = IMAGE_TOKEN
    pixel_values, positions = image_inputs(1)
    return {
        "input_ids": ids,
        "pixel_values": pixel_values,
        "image_position_ids": positions,
        "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
    }


@pytest.fixture(params=[(False, None), (True, "vision")], ids=["dense", "moe-vision-bidirectional"])
def pair(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[HFGemma4ForConditionalGeneration, Gemma4ForConditionalGeneration]:
    moe, bidirectional = request.param
    torch.manual_seed(0)
    hf = HFGemma4ForConditionalGeneration(vlm_config(moe=moe, use_bidirectional_attention=bidirectional))
    perturb_(hf)
    hf.save_pretrained(tmp_path / "hf")
    return hf, Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "hf")


def test_text_only_logits_loss_and_gradients_match(pair: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    hf, ours = pair
    ids = torch.randint(1, VOCAB - 5, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids, labels=ids)
    got = ours(input_ids=ids, labels=ids)
    _close(got.logits, ref.logits)
    _close(got.loss, ref.loss)
    ref.loss.backward()
    got.loss.backward()
    ours_grads = Gemma4StateDictAdapter.to_hf({n: p.grad for n, p in ours.named_parameters() if p.grad is not None})
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert set(ours_grads) == set(hf_grads)
    assert any(".layers.0." in name for name in hf_grads)
    for name, grad in hf_grads.items():
        _close(ours_grads[name], grad, rtol=5e-5)


def test_image_logits_loss_and_gradients_match(pair: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    hf, ours = pair
    batch = _image_batch()
    ref = hf(**batch, labels=batch["input_ids"])
    got = ours(**batch, labels=batch["input_ids"])
    _close(got.logits, ref.logits)
    _close(got.loss, ref.loss)
    ref.loss.backward()
    got.loss.backward()
    ours_grads = Gemma4StateDictAdapter.to_hf({n: p.grad for n, p in ours.named_parameters() if p.grad is not None})
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert set(ours_grads) == set(hf_grads)
    assert any(name.startswith("model.vision_tower.") for name in hf_grads)
    for name, grad in hf_grads.items():
        _close(ours_grads[name], grad, rtol=5e-5)


def test_images_change_the_logits(pair: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """Guards the parity tests: image features reach the text model (and, for 'vision', the bidirectional mask)."""
    _, ours = pair
    batch = _image_batch()
    with_images = ours(**batch).logits
    other_pixels = dict(batch, pixel_values=batch["pixel_values"] + 1.0)
    assert not torch.allclose(with_images, ours(**other_pixels).logits)
    if ours.config.text_config.use_bidirectional_attention == "vision":
        causal_only = ours(**{k: v for k, v in batch.items() if k != "mm_token_type_ids"}).logits
        assert not torch.allclose(with_images[:, 3:6], causal_only[:, 3:6])


def test_our_checkpoint_loads_in_transformers(tmp_path: Path, pair: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    _, ours = pair
    ours.save_pretrained(tmp_path / "ours")
    hf = HFGemma4ForConditionalGeneration.from_pretrained(tmp_path / "ours")
    batch = _image_batch()
    _close(ours(**batch).logits, hf(**batch).logits)


def test_pipeline_protocol_attributes(pair: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """What am-pipelining's Gemma 4 VLM forward reads from the model."""
    _, ours = pair
    batch = _image_batch()
    features = ours.model.get_image_features(batch["pixel_values"], batch["image_position_ids"], return_dict=True)
    assert torch.cat(list(features.pooler_output)).shape == (4, ours.config.text_config.hidden_size)
    assert ours.model.language_model.embed_tokens is ours.model.embed_tokens
    assert ours.lm_head.weight is ours.model.language_model.embed_tokens.weight
    hidden = ours.model.language_model(input_ids=None, inputs_embeds=torch.randn(1, 5, 32)).last_hidden_state
    assert hidden.shape == (1, 5, 32)


@pytest.mark.parametrize("name", ["pixel_values_videos", "input_features"])
def test_video_and_audio_inputs_are_rejected(name: str) -> None:
    model = Gemma4ForConditionalGeneration(vlm_config())
    with pytest.raises(NotImplementedError, match=f"video and audio inputs are not supported.*{name}"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), **{name: torch.zeros(1, 2, 3)})


def test_audio_config_is_rejected() -> None:
    config = vlm_config()
    config.audio_config = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(NotImplementedError, match="audio_config"):
        Gemma4ForConditionalGeneration(config)


def test_keep_lists_are_the_text_models() -> None:
    """One list per package: the VLM pins what the text model pins, found under `model.language_model.`."""
    from am_models_gemma4 import Gemma4ForCausalLM
    from am_precision import fp32_keep_rules, match_keep_rule

    for name in ("_keep_in_fp32_modules_strict", "_keep_in_fp32_modules"):
        assert getattr(Gemma4ForConditionalGeneration, name) is getattr(Gemma4ForCausalLM, name)
    rules = fp32_keep_rules(Gemma4ForConditionalGeneration)
    assert match_keep_rule("model.language_model.layers.1.moe.router.proj.weight", rules) is not None
    assert match_keep_rule("model.language_model.layers.1.self_attn.q_proj.weight", rules) is None
