"""am_model_io.pretrained and generation: what every model's from_pretrained / save_pretrained / generate share.
Model-level loading and saving are tested in the model packages; here each helper's own contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from am_model_io import (
    OwnCacheGenerationHooks,
    load_hf_config,
    save_folder,
    split_pretrained_kwargs,
    state_dict_to_save,
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


def test_state_dict_to_save_lists_every_key_problem() -> None:
    model = nn.Linear(2, 2)
    assert set(state_dict_to_save(model, None)) == {"weight", "bias"}
    with pytest.raises(ValueError, match="save_pretrained needs the full state dict") as info:
        state_dict_to_save(model, {"weight": torch.zeros(2, 2), "other": torch.zeros(1)})
    assert "lacks 1 of the model's keys: ['bias']" in str(info.value)
    assert "has 1 keys the model does not: ['other']" in str(info.value)


def test_save_folder_creates_it_and_refuses_pickles(tmp_path: Path) -> None:
    assert save_folder(tmp_path / "a" / "b", safe_serialization=True).is_dir()
    with pytest.raises(ValueError, match="safe_serialization=False"):
        save_folder(tmp_path / "c", safe_serialization=False)
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
