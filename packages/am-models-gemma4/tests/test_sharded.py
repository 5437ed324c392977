"""Real size without materializing: meta build, seeded per-rank init, sharded checkpoint loading (issue 23 §1).

Contract: a Gemma 4 model built on the meta device, sharded (FSDP2 over dp 2, or experts over ep 2), then given
storage by `materialize_sharded` or `to_empty` + `load_sharded_checkpoint`, holds EXACTLY (torch.equal) the values of
the single process running `materialize_sharded` / `from_pretrained` on the whole model, buffers the constructor
computes included; each rank reads only its own blocks (bytes counted); the strict key check names missing and
unexpected tensors as the files name them. One gloo group of 2 ranks; the oracle is computed in the pytest process.
FSDP2 runs on the untied variant, ep on the tied one (the Gemma 4 default).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from _g4_configs import text_config, vlm_config
from _g4_dist import case_result, run_cases, run_group

from am_model_io import read_safetensors_folder
from am_models_gemma4 import (
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    load_sharded_checkpoint,
    materialize_sharded,
)

WORLD = 2
SEED = 3
TIED = {"fsdp2": False, "ep": True}
MAX_SHARD = "20KB"  # several files + an index


def _config(layout: str) -> Any:
    return text_config(moe=True, tie_word_embeddings=TIED[layout])


def _single(layout: str) -> Gemma4ForCausalLM:
    model = materialize_sharded(Gemma4ForCausalLM.from_config(_config(layout), device="meta"), seed=SEED)
    assert isinstance(model, Gemma4ForCausalLM)
    return model


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor (buffers too) gathered to its full shape (collective for DTensors; same order on every rank)."""
    from torch.distributed.tensor import DTensor

    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: t.full_tensor() if isinstance(t, DTensor) else t.detach().clone() for n, t in named.items()}


def _meta_model(layout: str, mesh: Any) -> Gemma4ForCausalLM:
    from torch.distributed.fsdp import fully_shard

    model = Gemma4ForCausalLM.from_config(_config(layout), device="meta")
    if layout == "ep":
        model.apply_expert_parallel(mesh)
        return model
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _init_case(layout: str, mesh: Any) -> dict[str, Any]:
    return {"state": _full_state(materialize_sharded(_meta_model(layout, mesh), seed=SEED))}


def _load_case(layout: str, mesh: Any, folder: str) -> dict[str, Any]:
    model = _meta_model(layout, mesh)
    model.to_empty(device="cpu")
    report = load_sharded_checkpoint(model, folder)
    return {"state": _full_state(model), "bytes_read": report.bytes_read}


def _vlm_meta(mesh: Any = None) -> Gemma4ForConditionalGeneration:
    """The VLM (untied head: FSDP2 groups hold whole tensors) on the meta device; with `mesh`, FSDP2 over it per
    text decoder layer, per vision encoder layer and the root."""
    from torch.distributed.fsdp import fully_shard

    model = Gemma4ForConditionalGeneration.from_config(vlm_config(moe=True, tie_word_embeddings=False), device="meta")
    if mesh is not None:
        for layer in [*model.model.language_model.layers.values(), *model.model.vision_tower.encoder.layers]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _bad_keys_case(folder: str) -> str:
    model = Gemma4ForCausalLM.from_config(_config("ep"), device="meta")
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match="does not match") as info:
        load_sharded_checkpoint(model, folder)
    return str(info.value)


def _write_checkpoints(root: str) -> dict[str, str]:
    from safetensors.torch import save_file

    folders = {layout: os.path.join(root, layout) for layout in TIED}
    for layout, folder in folders.items():
        _single(layout).save_pretrained(folder, max_shard_size=MAX_SHARD)
    bad = folders["bad"] = os.path.join(root, "bad")
    _single("ep").save_pretrained(bad, max_shard_size=None)
    tensors = read_safetensors_folder(bad)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.experts.extra"] = torch.zeros(2)
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    return folders


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {layout: init_device_mesh("cpu", (world_size,), mesh_dim_names=(layout,)) for layout in TIED}
    shared = [_write_checkpoints(tempfile.mkdtemp(prefix="am_gemma4_sharded_")) if rank == 0 else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    folders: dict[str, str] = shared[0]  # type: ignore[assignment]
    cases: dict[str, Any] = {"folders": lambda: folders, "bad_keys": lambda: _bad_keys_case(folders["bad"])}
    cases["init_vlm"] = lambda: {"state": _full_state(materialize_sharded(_vlm_meta(meshes["fsdp2"]), seed=SEED))}
    for layout in TIED:
        cases[f"init_{layout}"] = lambda layout=layout: _init_case(layout, meshes[layout])
        cases[f"load_{layout}"] = lambda layout=layout: _load_case(layout, meshes[layout], folders[layout])
    return run_cases(cases)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_group(WORLD, _worker, timeout=300.0)


def _assert_equal(got: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert set(got) == set(expected)
    different = [name for name, tensor in expected.items() if not torch.equal(got[name], tensor)]
    assert not different, f"tensors that differ from the single process: {different}"


@pytest.mark.parametrize("layout", ["fsdp2", "ep"])
def test_materialized_sharded_model_equals_the_single_process_init(ranks: list[dict[str, Any]], layout: str) -> None:
    expected = _single(layout)
    for rank in range(WORLD):
        _assert_equal(case_result(ranks, f"init_{layout}", rank)["state"], expected)
    assert expected.lm_head.weight is expected.model.embed_tokens.weight or not TIED[layout]
    other = materialize_sharded(Gemma4ForCausalLM.from_config(_config(layout), device="meta"), seed=SEED + 1)
    assert not torch.equal(other.model.embed_tokens.weight, expected.model.embed_tokens.weight)


@pytest.mark.parametrize("layout", ["fsdp2", "ep"])
def test_sharded_load_equals_the_single_process_load(ranks: list[dict[str, Any]], layout: str) -> None:
    folder = case_result(ranks, "folders", 0)[layout]
    expected = Gemma4ForCausalLM.from_pretrained(folder)
    for rank in range(WORLD):
        _assert_equal(case_result(ranks, f"load_{layout}", rank)["state"], expected)


def test_each_rank_reads_only_its_own_blocks(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 shards every parameter over dp (no persistent buffer but the layer scalars, read by both ranks): the
    ranks together read the file once plus the scalars; under ep each rank reads the dense tensors and half the
    experts."""
    folders = case_result(ranks, "folders", 0)
    for layout in TIED:
        tensors = read_safetensors_folder(folders[layout])
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        experts = sum(t.numel() * t.element_size() for k, t in tensors.items() if ".experts." in k)
        scalars = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith("layer_scalar"))
        read = [case_result(ranks, f"load_{layout}", rank)["bytes_read"] for rank in range(WORLD)]
        if layout == "fsdp2":
            assert sum(read) == total + (WORLD - 1) * scalars
            assert all(r < 0.6 * total for r in read)
        else:
            assert experts > 0
            assert read == [total - experts // WORLD] * WORLD


def test_missing_and_unexpected_keys_are_named_as_the_files_name_them(ranks: list[dict[str, Any]]) -> None:
    message = case_result(ranks, "bad_keys", 0)
    assert "missing keys (1): ['model.layers.1.mlp.up_proj.weight']" in message
    assert "unexpected keys (1): ['model.layers.1.experts.extra']" in message


def test_meta_from_pretrained_reads_no_data_and_checks_names(ranks: list[dict[str, Any]]) -> None:
    folders = case_result(ranks, "folders", 0)
    model = Gemma4ForCausalLM.from_pretrained(folders["ep"], device_map="meta")
    assert all(t.is_meta for t in model.state_dict().values())
    with pytest.raises(ValueError, match=r"missing keys \(1\)"):
        Gemma4ForCausalLM.from_pretrained(folders["bad"], device_map="meta")


def test_vision_language_model_loads_into_a_meta_built_model(tmp_path: Any) -> None:
    """The VLM (vision tower, tied head): a meta build + `to_empty` + `load_sharded_checkpoint` equals
    `from_pretrained`, the recomputed RoPE buffers of both towers included."""
    reference = Gemma4ForConditionalGeneration(vlm_config(moe=True))
    reference.save_pretrained(tmp_path)
    model = Gemma4ForConditionalGeneration.from_config(vlm_config(moe=True), device="meta")
    model.to_empty(device="cpu")
    load_sharded_checkpoint(model, tmp_path)
    _assert_equal({**dict(model.named_parameters()), **dict(model.named_buffers())}, reference)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight


def test_vision_language_model_seeded_init_equals_the_single_process(ranks: list[dict[str, Any]]) -> None:
    """Issue 23: the VLM's seeded init covers the vision tower too (transformers' Gemma 4 rules per vision encoder
    layer and module, the multimodal embedder): FSDP2 over 2 ranks holds exactly the single process's values, the
    vision tower is initialized (not left empty: its weights are finite and not all zero, its norms ones, its RoPE
    frequencies those of a freshly constructed tower), and the tied VLM stays tied."""
    single = materialize_sharded(_vlm_meta(), seed=SEED)
    for rank in range(WORLD):
        _assert_equal(case_result(ranks, "init_vlm", rank)["state"], single)
    tower: Any = single.model.vision_tower
    fresh: Any = Gemma4ForConditionalGeneration(vlm_config(moe=True, tie_word_embeddings=False)).model.vision_tower
    for name, tensor in tower.named_parameters():
        assert torch.isfinite(tensor).all(), name
        if name.endswith("layernorm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
    assert tower.encoder.layers[0].mlp.gate_proj.linear.weight.abs().sum() > 0
    for name, buffer in tower.named_buffers():
        torch.testing.assert_close(buffer, dict(fresh.named_buffers())[name], msg=name)
    tied = materialize_sharded(Gemma4ForConditionalGeneration.from_config(vlm_config(moe=True), device="meta"), seed=0)
    assert tied.lm_head.weight is tied.model.language_model.embed_tokens.weight
