"""Loading and saving like transformers: transformers' keywords (torch_dtype / dtype, device_map, revision), hub ids
through `snapshot_download`, shards written by huggingface_hub, tensor-by-tensor loading, AutoModel registration,
and transformers loading what we save (sharded)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from _g4_configs import perturb_, text_config

from am_model_io import LazyCheckpoint
from am_models_gemma4 import Gemma4ForCausalLM
from am_precision import fp32_keep_rules, match_keep_rule


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Gemma4ForCausalLM, Path]:
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(text_config(moe=True)).eval()
    perturb_(model)
    folder = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(folder, max_shard_size="8KB")
    return model, folder


def _ids() -> torch.Tensor:
    return torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(5))


def test_sharded_save_writes_shards_and_index_and_reloads_equal_logits(sharded) -> None:
    model, folder = sharded
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == [s.name for s in shards]
    assert "lm_head.weight" not in weight_map  # tied: saved once, as transformers does
    loaded = Gemma4ForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=_ids()).logits, model(input_ids=_ids()).logits, rtol=0, atol=0)


def test_transformers_loads_our_sharded_folder(sharded) -> None:
    from transformers import Gemma4ForCausalLM as HFGemma4ForCausalLM

    model, folder = sharded
    hf = HFGemma4ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=_ids()).logits, model(input_ids=_ids()).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keyword", ["torch_dtype", "dtype"])
def test_bf16_load_keeps_pinned_tensors_fp32(sharded, keyword: str) -> None:
    _, folder = sharded
    loaded = Gemma4ForCausalLM.from_pretrained(folder, **{keyword: torch.bfloat16})
    rules = fp32_keep_rules(Gemma4ForCausalLM)
    tensors = dict([*loaded.named_parameters(), *loaded.named_buffers()])
    pinned = {n for n in tensors if match_keep_rule(n, rules) is not None}
    assert any(".router." in n for n in pinned)
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            assert tensor.dtype == (torch.float32 if name in pinned else torch.bfloat16), name


def test_dtype_spellings(sharded) -> None:
    _, folder = sharded
    with pytest.raises(ValueError, match="disagree"):
        Gemma4ForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16, dtype=torch.float16)
    loaded = Gemma4ForCausalLM.from_pretrained(folder, dtype="bfloat16", device_map="cpu")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="low_cpu_mem_usage"):
        Gemma4ForCausalLM.from_pretrained(folder, low_cpu_mem_usage=True)


@pytest.mark.parametrize("device_map", ["auto", "sequential", {"model": "cpu", "lm_head": "cpu"}])
def test_device_maps_that_split_are_refused(sharded, device_map) -> None:
    _, folder = sharded
    with pytest.raises(ValueError, match="cannot be honoured"):
        Gemma4ForCausalLM.from_pretrained(folder, device_map=device_map)


def test_safe_serialization_false_is_refused(sharded, tmp_path: Path) -> None:
    model, _ = sharded
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
    loaded = Gemma4ForCausalLM.from_pretrained("google/tiny-gemma4", revision="v1", local_files_only=True)
    assert [(c["repo_id"], c["revision"], c["local_files_only"]) for c in calls] == [("google/tiny-gemma4", "v1", True)]
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_sharded_load_reads_one_tensor_at_a_time(sharded, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the tensors read from the files and not yet copied into the model: one at a time."""
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
    loaded = Gemma4ForCausalLM.from_pretrained(folder)
    sizes = [t.numel() * t.element_size() for t in loaded.state_dict().values()]
    assert sum(sizes) > 10 * max(sizes)
    assert 0 < peak[0] <= max(sizes)
    assert not live


def test_auto_model_for_causal_lm_register_then_from_pretrained(sharded, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    model, folder = sharded
    mapping = AutoModelForCausalLM._model_mapping
    monkeypatch.setattr(mapping, "_extra_content", dict(mapping._extra_content))  # undone after the test
    AutoModelForCausalLM.register(Gemma4TextConfig, Gemma4ForCausalLM, exist_ok=True)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is Gemma4ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=_ids()).logits, model(input_ids=_ids()).logits, rtol=0, atol=0)
    bf16 = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16)
    assert bf16.model.layers["1"].moe.router.proj.weight.dtype == torch.float32
    assert bf16.model.layers["1"].self_attn.q_proj.weight.dtype == torch.bfloat16
