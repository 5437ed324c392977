"""am_model_io.pretrained and generation: what every model's from_pretrained / save_pretrained / generate share.
Model-level loading and saving are tested in the model packages; here each helper's own contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from am_model_io import (
    FileLayout,
    OwnCacheGenerationHooks,
    load_hf_config,
    pretrained_saver,
    read_safetensors_folder,
    split_pretrained_kwargs,
)


def test_split_pretrained_kwargs_takes_out_hub_and_auto_keywords_and_leaves_the_models() -> None:
    kwargs = {"revision": "main", "token": False, "_from_auto": True, "trust_remote_code": True, "depth": 2}
    assert split_pretrained_kwargs(kwargs) == {"revision": "main", "token": False}
    assert kwargs == {"depth": 2}


@pytest.mark.parametrize("name", ["adapter_kwargs", "subfolder", "proxies"])
def test_split_pretrained_kwargs_refuses_what_would_change_the_load(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}=.* is not supported"):
        split_pretrained_kwargs({name: "x"})
    assert split_pretrained_kwargs({name: None}) == {}  # None changes nothing


def _saver() -> Any:
    """A save_pretrained writing the model's own names and a marker file as its metadata."""
    return pretrained_saver(lambda model: FileLayout(dict, lambda folder: (folder / "meta.txt").write_text("m")))


def test_saver_writes_the_layouts_tensors_and_metadata(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    _saver()(model, tmp_path / "a" / "b", max_shard_size=None)
    assert (tmp_path / "a" / "b" / "meta.txt").read_text() == "m"
    saved = read_safetensors_folder(tmp_path / "a" / "b")
    assert saved.keys() == {"weight", "bias"}
    assert torch.equal(saved["weight"], model.weight.detach())
    _saver()(model, tmp_path / "c", state_dict={"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    assert torch.equal(read_safetensors_folder(tmp_path / "c")["weight"], torch.ones(2, 2))


def test_saver_lists_every_key_problem_and_refuses_pickles(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="save_pretrained needs the full state dict") as info:
        _saver()(model, tmp_path / "a", state_dict={"weight": torch.zeros(2, 2), "other": torch.zeros(1)})
    assert "lacks 1 of the model's keys: ['bias']" in str(info.value)
    assert "has 1 keys the model does not: ['other']" in str(info.value)
    with pytest.raises(ValueError, match="safe_serialization=False"):
        _saver()(model, tmp_path / "c", safe_serialization=False)
    assert not (tmp_path / "a").exists()
    assert not (tmp_path / "c").exists()


def test_load_hf_config_names_a_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json in"):
        load_hf_config(tmp_path)
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, num_attention_heads=2).save_pretrained(str(tmp_path))
    assert load_hf_config(tmp_path).hidden_size == 16


def test_own_cache_hooks_win_over_the_mixin_after_them() -> None:
    class Defaults:
        @classmethod
        def can_generate(cls) -> bool:
            return False

        def get_experts_implementation(self) -> dict[str, str]:
            raise AssertionError("the mixin's default must not be reached")

    class Model(OwnCacheGenerationHooks, Defaults):
        pass

    assert Model.can_generate()
    assert Model().get_experts_implementation() == {}
    assert Model().set_experts_implementation("grouped_mm") is None


def test_own_cache_hooks_answer_device_and_dtype_from_the_parameters() -> None:
    """`generate` reads `model.device` / `model.dtype`: the first parameter's device, the first floating dtype."""

    class Model(OwnCacheGenerationHooks, nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.steps = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
            self.weight = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))

    model = Model()
    assert model.device == torch.device("cpu")
    assert model.dtype == torch.bfloat16
    model.weight = None  # type: ignore[assignment]
    assert model.dtype == torch.float32  # no floating parameter left
