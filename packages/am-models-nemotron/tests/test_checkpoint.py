"""Checkpoint folders: strict loading (every missing / unexpected key listed), damaged files named, shards with an
index, and a transformers folder completed with MTP weights (transformers has no MTP)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from am_nemotron_helpers import assert_close_rel, hf_model, save_hf, tiny_hf_config, tokens
from safetensors.torch import save_file

from am_model_io import read_safetensors_folder
from am_models_nemotron import NemotronHForCausalLM, NemotronStateDictAdapter
from am_precision import fp32_keep_rules, match_keep_rule


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory):
    hf = hf_model(tiny_hf_config("ME*", mtp_depths=1), seed=3)
    return hf, save_hf(hf, tmp_path_factory.mktemp("hf"))


def _copy(folder: Path, target: Path) -> Path:
    target.mkdir(exist_ok=True)
    for file in folder.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def test_transformers_folder_plus_mtp_shard_loads_and_matches(hf_folder, tmp_path: Path) -> None:
    hf, folder = hf_folder
    target = _copy(folder, tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"missing keys \(\d+\): \['mtp\.layers\.0"):
        NemotronHForCausalLM.from_pretrained(target)
    donor = NemotronHForCausalLM(hf.config)
    mtp = {
        k: v for k, v in NemotronStateDictAdapter(hf.config).to_hf(donor.state_dict()).items() if k.startswith("mtp.")
    }
    backbone = read_safetensors_folder(target)
    (target / "model.safetensors").rename(target / "model-00001-of-00002.safetensors")
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(target / "model-00002-of-00002.safetensors"))
    weight_map = {
        **dict.fromkeys(backbone, "model-00001-of-00002.safetensors"),
        **dict.fromkeys(mtp, "model-00002-of-00002.safetensors"),
    }
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ours = NemotronHForCausalLM.from_pretrained(target).eval()
    ids = tokens(2, 13)
    with torch.no_grad():
        assert_close_rel(ours(ids).logits, hf(ids).logits, rtol=1e-5, what="logits")
    for name, value in donor.mtp.state_dict().items():
        assert torch.equal(ours.mtp.state_dict()[name], value), name


def test_missing_and_unexpected_keys_are_all_listed(hf_folder, tmp_path: Path) -> None:
    _, folder = hf_folder
    tensors = read_safetensors_folder(folder)
    tensors.pop("backbone.layers.0.mixer.A_log")
    tensors.pop("lm_head.weight")
    tensors["backbone.layers.9.norm.weight"] = torch.ones(32)
    tensors["backbone.layers.2.mixer.q_proj.weight"] = torch.ones(5, 5)
    target = _copy(folder, tmp_path / "bad")
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match="does not match") as info:
        NemotronHForCausalLM.from_pretrained(target, num_nextn_predict_layers=0)
    message = str(info.value)
    # The checkpoint's own names, not the internal ones (`model.layers.0.mixer._fp32_params.A_log`).
    assert "missing keys (2): ['backbone.layers.0.mixer.A_log', 'lm_head.weight']" in message
    assert "unexpected keys (1): ['backbone.layers.9.norm.weight']" in message
    assert "_fp32_params" not in message
    assert "backbone.layers.2.mixer.q_proj.weight: checkpoint (5, 5) vs model (32, 32)" in message


def test_incomplete_expert_set_is_reported(hf_folder, tmp_path: Path) -> None:
    _, folder = hf_folder
    tensors = read_safetensors_folder(folder)
    tensors.pop("backbone.layers.1.mixer.experts.4.up_proj.weight")
    target = _copy(folder, tmp_path / "experts")
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.\{e\}\.up_proj\.weight: missing experts \[4\]"):
        NemotronHForCausalLM.from_pretrained(target, num_nextn_predict_layers=0)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_file_is_named(hf_folder, tmp_path: Path, damage: str) -> None:
    _, folder = hf_folder
    target = _copy(folder, tmp_path / damage)
    path = target / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 10)
    with pytest.raises(ValueError, match=r"Cannot read safetensors file .*model\.safetensors"):
        NemotronHForCausalLM.from_pretrained(target, num_nextn_predict_layers=0)


def test_missing_shard_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"model-1\.safetensors"):
        read_safetensors_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"No model\.safetensors"):
        read_safetensors_folder(tmp_path / "nothing")


def test_saved_pinned_tensors_are_f32_even_from_a_bf16_model(tmp_path: Path) -> None:
    from safetensors import safe_open

    from am_precision import cast_model_to_dtype

    model = NemotronHForCausalLM(tiny_hf_config("ME"))
    cast_model_to_dtype(model, torch.bfloat16)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        dtypes = {k: handle.get_slice(k).get_dtype() for k in handle.keys()}  # noqa: SIM118
    assert dtypes["backbone.layers.0.mixer.A_log"] == "F32"
    assert dtypes["backbone.layers.1.mixer.gate.e_score_correction_bias"] == "F32"
    assert dtypes["backbone.layers.0.mixer.in_proj.weight"] == "BF16"
    reloaded = NemotronHForCausalLM.from_pretrained(tmp_path)
    assert reloaded.model.layers["0"].mixer.A_log.dtype == torch.float32
    assert torch.equal(reloaded.model.layers["0"].mixer.A_log, model.model.layers["0"].mixer.A_log)


def test_pinned_tensors_stored_in_bf16_elsewhere_load_as_fp32(tmp_path: Path) -> None:
    """A checkpoint written by another tool with every tensor in bf16: the tensors the model's keep list pins come
    back fp32 (holding the bf16 values), the others keep the checkpoint's dtype."""
    model = NemotronHForCausalLM(tiny_hf_config("ME", mtp_depths=1))
    model.save_pretrained(tmp_path)
    bf16 = {k: v.to(torch.bfloat16) for k, v in read_safetensors_folder(tmp_path).items()}
    save_file(bf16, str(tmp_path / "model.safetensors"))
    loaded = NemotronHForCausalLM.from_pretrained(tmp_path)
    rules = fp32_keep_rules(loaded)
    tensors = dict([*loaded.named_parameters(), *loaded.named_buffers()])
    pinned = {name for name in tensors if match_keep_rule(name, rules) is not None}
    assert {n.rsplit(".", 1)[-1] for n in pinned} == {"A_log", "dt_bias", "D", "e_score_correction_bias"}
    assert any(n.startswith("mtp.") for n in pinned)
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():  # am-moe's int64 expert-load counters: statistics, not weights
            assert name.endswith("experts.tokens_per_expert"), name
            assert tensor.dtype == torch.int64, name
            continue
        assert tensor.dtype == (torch.float32 if name in pinned else torch.bfloat16), name
    expected = model.model.layers["0"].mixer.A_log.to(torch.bfloat16).float()
    assert torch.equal(loaded.model.layers["0"].mixer.A_log, expected)


def test_file_layout_one_tensor_at_a_time_writes_what_save_pretrained_writes(tmp_path: Path) -> None:
    """`hf_file_layout` is what a streaming export (one tensor at a time) follows: its entries, tensor by tensor,
    are exactly the saved file's (NVIDIA's per-expert names, F32 pins of a bf16 model, MTP included)."""
    from am_models_nemotron import hf_file_layout
    from am_precision import cast_model_to_dtype

    model = NemotronHForCausalLM(tiny_hf_config("ME", mtp_depths=1))
    cast_model_to_dtype(model, torch.bfloat16)
    model.save_pretrained(tmp_path / "saved")
    layout = hf_file_layout(model)
    streamed: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        entries = layout.to_file({name: tensor})
        assert not set(entries) & set(streamed), name
        streamed.update(entries)
    saved = read_safetensors_folder(tmp_path / "saved")
    assert streamed.keys() == saved.keys()
    for key, tensor in saved.items():
        assert streamed[key].dtype == tensor.dtype, key
        assert torch.equal(streamed[key], tensor), key
    layout.write_metadata(tmp_path / "meta")
    assert (tmp_path / "meta" / "config.json").read_text() == (tmp_path / "saved" / "config.json").read_text()
