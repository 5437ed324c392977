"""The trainer's `--model-path` resolution (`trainer.models.folder_spec`): an HF-format folder is built with the
class the am-capabilities registry names for its `architectures` (or, without them, its `model_type`), which is
how our model packages' entry points reach the trainer; anything else goes to transformers' AutoModelForCausalLM.
In-process and cheap: each case saves a tiny preset and loads it back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer.models import build_model, folder_spec, preset_spec


def _saved_preset(name: str, folder: Path, *, drop_architectures: bool = False) -> torch.nn.Module:
    spec = preset_spec(name, hidden_size=32, num_layers=4, mtp_depths=1, tie_embeddings=False, vocab_size=None)
    model = build_model(spec, seed=0)
    spec.save(model, folder)
    if drop_architectures:
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text())
        config.pop("architectures", None)
        config_path.write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(
    ("preset", "module", "class_name"),
    [
        ("nemotron", "am_models_nemotron", "NemotronHForCausalLM"),
        ("gemma4", "am_models_gemma4", "Gemma4ForCausalLM"),
        ("llama", "transformers", "LlamaForCausalLM"),
    ],
)
@pytest.mark.parametrize("drop_architectures", [False, True], ids=["architectures", "model_type_only"])
def test_folder_is_built_by_the_registered_class_with_its_weights(
    tmp_path: Path, preset: str, module: str, class_name: str, drop_architectures: bool
) -> None:
    saved = _saved_preset(preset, tmp_path, drop_architectures=drop_architectures)
    spec = folder_spec(tmp_path)
    loaded = build_model(spec, seed=1)  # a different seed: every weight must come from the folder
    assert type(loaded).__name__ == class_name
    assert type(loaded).__module__.split(".")[0] == module
    assert spec.family == json.loads((tmp_path / "config.json").read_text())["model_type"]
    assert spec.vocab_size == 256
    expected = saved.state_dict()
    actual = loaded.state_dict()
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=0, atol=0, msg=key)


class _StandIn(torch.nn.Module):
    """A class the trainer has never heard of; registering it is all it takes to be used for a folder."""

    def __init__(self, folder: Path, dtype: torch.dtype, device_map: str) -> None:
        super().__init__()
        self.folder, self.dtype, self.device_map = folder, dtype, device_map

    @classmethod
    def from_pretrained(cls, folder: Path, *, dtype: torch.dtype, device_map: str) -> _StandIn:
        return cls(folder, dtype, device_map)


def test_folder_logic_names_no_model(tmp_path: Path) -> None:
    from am_capabilities import register_model, unregister_model

    config = {"architectures": ["StandInForCausalLM"], "model_type": "stand_in", "text_config": {"vocab_size": 7}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    register_model(_StandIn, architecture="StandInForCausalLM")
    try:
        spec = folder_spec(tmp_path)
        model = spec.build()
    finally:
        unregister_model("StandInForCausalLM")
    assert isinstance(model, _StandIn)
    assert (model.folder, model.dtype) == (tmp_path, torch.float32)
    assert model.device_map == "meta", "validation builds a folder's model without reading its weights"
    assert (spec.family, spec.vocab_size) == ("stand_in", 7)
