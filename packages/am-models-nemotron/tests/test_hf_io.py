"""Loading and saving like transformers: transformers' keywords (torch_dtype / dtype, device_map, revision), hub ids
through `snapshot_download`, shards written by huggingface_hub, tensor-by-tensor loading, AutoModel registration."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from am_nemotron_helpers import tiny_hf_config, tokens

from am_model_io import LazyCheckpoint
from am_models_nemotron import NemotronHForCausalLM
from am_precision import fp32_keep_rules, match_keep_rule


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[NemotronHForCausalLM, Path]:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_hf_config("ME*", mtp_depths=1)).eval()
    folder = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(folder, max_shard_size="20KB")
    return model, folder


def test_sharded_save_writes_shards_and_index_and_reloads_equal_logits(sharded) -> None:
    model, folder = sharded
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == [s.name for s in shards]
    assert not (folder / "model.safetensors").exists()
    loaded = NemotronHForCausalLM.from_pretrained(folder).eval()
    ids = tokens(2, 11)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_transformers_loads_our_sharded_folder(sharded) -> None:
    from transformers import NemotronHForCausalLM as HFNemotronH

    model, folder = sharded
    hf = HFNemotronH.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = tokens(2, 11)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keyword", ["torch_dtype", "dtype"])
def test_bf16_load_keeps_pinned_tensors_fp32(sharded, keyword: str) -> None:
    model, folder = sharded
    loaded = NemotronHForCausalLM.from_pretrained(folder, **{keyword: torch.bfloat16})
    rules = fp32_keep_rules(loaded)
    tensors = dict([*loaded.named_parameters(), *loaded.named_buffers()])
    pinned = {n for n in tensors if match_keep_rule(n, rules) is not None}
    assert pinned
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            assert tensor.dtype == (torch.float32 if name in pinned else torch.bfloat16), name
    a_log = "model.layers.0.mixer._fp32_params.A_log"
    assert torch.equal(tensors[a_log], model.state_dict()[a_log])


def test_dtype_auto_and_disagreeing_spellings(sharded) -> None:
    _, folder = sharded
    with pytest.raises(ValueError, match="disagree"):
        NemotronHForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16, dtype=torch.float16)
    with pytest.raises(ValueError, match="not a torch dtype"):
        NemotronHForCausalLM.from_pretrained(folder, dtype="bfloat17")
    loaded = NemotronHForCausalLM.from_pretrained(folder, dtype="bfloat16", device_map="cpu")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("device_map", ["auto", "balanced", {"model": "cpu", "lm_head": "cpu"}, "disk"])
def test_device_maps_that_split_or_offload_are_refused(sharded, device_map) -> None:
    _, folder = sharded
    with pytest.raises(ValueError, match="cannot be honoured"):
        NemotronHForCausalLM.from_pretrained(folder, device_map=device_map)


def test_single_device_maps_load_there(sharded) -> None:
    _, folder = sharded
    for device_map in ("cpu", torch.device("cpu"), {"": "cpu"}):
        loaded = NemotronHForCausalLM.from_pretrained(folder, device_map=device_map)
        assert {p.device.type for p in loaded.parameters()} == {"cpu"}


def test_safe_serialization_false_is_refused(tmp_path: Path) -> None:
    model = NemotronHForCausalLM(tiny_hf_config("M"))
    with pytest.raises(ValueError, match="safe_serialization=False"):
        model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert not (tmp_path / "bin").exists()


def test_hub_id_goes_through_snapshot_download(sharded, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    model, folder = sharded
    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded = NemotronHForCausalLM.from_pretrained("nvidia/tiny-test", revision="abc123", token="t")
    assert len(calls) == 1
    assert calls[0]["repo_id"] == "nvidia/tiny-test"
    assert calls[0]["revision"] == "abc123"
    assert calls[0]["token"] == "t"
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        NemotronHForCausalLM.from_pretrained(str(folder / "absent"))
    assert len(calls) == 1


def test_sharded_load_reads_one_tensor_group_at_a_time(sharded, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the tensors read from the files and not yet placed in the model: at most one tensor (or one
    layer's per-expert tensors, stacked into one parameter) at any time, never the checkpoint as a whole."""
    _, folder = sharded
    live: dict[int, int] = {}
    peak = [0]
    read = LazyCheckpoint.read

    def counting_read(self: LazyCheckpoint, key: str) -> torch.Tensor:
        tensor = read(self, key)
        live[id(tensor)] = tensor.numel() * tensor.element_size()
        weakref.finalize(tensor, live.pop, id(tensor), None)
        peak[0] = max(peak[0], sum(live.values()))
        return tensor

    monkeypatch.setattr(LazyCheckpoint, "read", counting_read)
    loaded = NemotronHForCausalLM.from_pretrained(folder)
    sizes = [t.numel() * t.element_size() for t in loaded.state_dict().values()]
    assert sum(sizes) > 10 * max(sizes)  # the model is large next to its largest tensor
    assert 0 < peak[0] <= max(sizes)
    assert set(live) <= {id(b) for b in loaded.buffers()}  # only tensors that became the model's buffers


def test_auto_model_for_causal_lm_register_then_from_pretrained(sharded, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, NemotronHConfig

    model, folder = sharded
    mapping = AutoModelForCausalLM._model_mapping
    monkeypatch.setattr(mapping, "_extra_content", dict(mapping._extra_content))  # undone after the test
    AutoModelForCausalLM.register(NemotronHConfig, NemotronHForCausalLM, exist_ok=True)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert type(loaded) is NemotronHForCausalLM
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.layers["0"].mixer.A_log.dtype == torch.float32
    fp32 = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokens(1, 7)
    with torch.no_grad():
        torch.testing.assert_close(fp32(ids).logits, model(ids).logits, rtol=0, atol=0)
