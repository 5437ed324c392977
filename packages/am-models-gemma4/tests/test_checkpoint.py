"""Checkpoint folders: strict loading (every problem listed), corrupt files named, shards, tied head saved once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _g4_configs import perturb_, text_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from am_model_io import read_safetensors_folder
from am_models_gemma4 import Gemma4ForCausalLM
from am_precision import fp32_keep_rules, match_keep_rule


def _saved(tmp_path: Path, *, moe: bool = True) -> tuple[Gemma4ForCausalLM, Path]:
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(text_config(moe=moe))
    perturb_(model)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    return model, folder


def test_round_trip_restores_every_tensor(tmp_path: Path) -> None:
    model, folder = _saved(tmp_path)
    loaded = Gemma4ForCausalLM.from_pretrained(folder)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_tied_head_is_saved_once_in_transformers_layout(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        gate_up = handle.get_tensor("model.layers.0.experts.gate_up_proj")
    assert "lm_head.weight" not in keys
    assert "model.layers.0.router.per_expert_scale" in keys
    assert not any(".moe." in key for key in keys)
    assert gate_up.shape == (4, 2 * 16, 32)  # transformers' [E, 2I, H]


def test_missing_and_unexpected_keys_are_all_listed(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    del tensors["model.layers.2.router.scale"]
    tensors["model.layers.0.extra.weight"] = torch.zeros(1)
    tensors["model.norm.weight"] = torch.zeros(5)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match Gemma4ForCausalLM") as info:
        Gemma4ForCausalLM.from_pretrained(folder)
    message = str(info.value)
    for fragment in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.2.router.scale",  # the file's naming (ours: model.layers.2.moe.router.scale)
        "model.layers.0.extra.weight",
        "model.norm.weight: checkpoint (5,) vs model (32,)",
    ):
        assert fragment in message


def test_corrupt_file_error_names_the_file(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        Gemma4ForCausalLM.from_pretrained(folder)


def test_sharded_save_and_load(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = Gemma4ForCausalLM(text_config())
    model.save_pretrained(tmp_path / "sharded", max_shard_size=20_000)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded = Gemma4ForCausalLM.from_pretrained(tmp_path / "sharded")
    ids = torch.randint(1, 100, (1, 9))
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    assert len(read_safetensors_folder(tmp_path / "sharded")) == len(load_file_all(tmp_path / "sharded"))


def load_file_all(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in folder.glob("model-*.safetensors"):
        out.update(load_file(str(path)))
    return out


def test_bf16_load_keeps_router_fp32(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path)
    model = Gemma4ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert model.model.layers["1"].moe.router.proj.weight.dtype == torch.float32
    assert model.model.layers["1"].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_bf16_load_pins_exactly_what_the_keep_lists_name(tmp_path: Path) -> None:
    """Every tensor the class's keep lists match stays fp32 (router parameters, RoPE buffers); nothing else does,
    even when the checkpoint itself was stored in bf16."""
    model, folder = _saved(tmp_path)
    bf16 = {k: v.to(torch.bfloat16) for k, v in read_safetensors_folder(folder).items()}
    save_file(bf16, str(folder / "model.safetensors"), metadata={"format": "pt"})
    loaded = Gemma4ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    rules = fp32_keep_rules(Gemma4ForCausalLM)
    tensors = dict([*loaded.named_parameters(), *loaded.named_buffers()])
    pinned = {name for name in tensors if match_keep_rule(name, rules) is not None}
    assert any(".router." in name for name in pinned)
    assert any("rotary_emb" in name for name in pinned)
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            assert tensor.dtype == (torch.float32 if name in pinned else torch.bfloat16), name
    router = "model.layers.1.moe.router.proj.weight"
    assert torch.equal(tensors[router], model.state_dict()[router].to(torch.bfloat16).float())


def test_missing_folder_contents_are_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        Gemma4ForCausalLM.from_pretrained(tmp_path)


def test_without_the_hf_adapter_the_native_keys_are_written_and_read(tmp_path: Path) -> None:
    """`BackendConfig(enable_hf_state_dict_adapter=False)` (upstream: the model has no adapter): save_pretrained
    writes the model's own keys (`layers.N.moe.*`), from_pretrained / load_sharded_checkpoint read them back exactly,
    and a folder in transformers' layout is refused naming the keys it lacks."""
    from am_models_gemma4 import load_sharded_checkpoint
    from am_precision import BackendConfig

    native = BackendConfig(attn="sdpa", linear="torch", experts="torch", dispatcher="torch",
                           enable_hf_state_dict_adapter=False)  # fmt: skip
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(text_config(moe=True), backend=native)
    perturb_(model)
    model.save_pretrained(tmp_path / "native")
    keys = set(read_safetensors_folder(tmp_path / "native"))
    assert "model.layers.0.moe.router.per_expert_scale" in keys
    assert "model.layers.0.router.per_expert_scale" not in keys
    loaded = Gemma4ForCausalLM.from_pretrained(tmp_path / "native", backend=native)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    meta = Gemma4ForCausalLM.from_pretrained(tmp_path / "native", backend=native, device_map="meta")
    meta.to_empty(device="cpu")
    load_sharded_checkpoint(meta, tmp_path / "native")
    for (name, a), (_, b) in zip(model.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # the native layout reads only the model's own names: a folder in transformers' layout is refused
    _, hf_folder = _saved(tmp_path)
    with pytest.raises(ValueError, match=r"missing keys .*model\.layers\.0\.moe\.router\.per_expert_scale"):
        Gemma4ForCausalLM.from_pretrained(hf_folder, backend=native)


def test_file_layout_one_tensor_at_a_time_writes_what_save_pretrained_writes(tmp_path: Path) -> None:
    """`hf_file_layout` is what a streaming export (one tensor at a time) follows: its entries, tensor by tensor,
    are exactly the saved file's (names, dtypes, values; the tied head left out)."""
    from am_models_gemma4 import hf_file_layout

    model, folder = _saved(tmp_path)
    layout = hf_file_layout(model)
    streamed: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        entries = layout.to_file({name: tensor})
        assert not set(entries) & set(streamed), name
        streamed.update(entries)
    saved = read_safetensors_folder(folder)
    assert streamed.keys() == saved.keys()
    for key, tensor in saved.items():
        assert streamed[key].dtype == tensor.dtype, key
        assert torch.equal(streamed[key], tensor), key
    layout.write_metadata(tmp_path / "meta")
    assert (tmp_path / "meta" / "config.json").read_text() == (folder / "config.json").read_text()
