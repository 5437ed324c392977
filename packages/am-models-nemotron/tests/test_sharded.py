"""Real size without materializing: meta build, seeded per-rank init, sharded checkpoint loading (issue 23 §1).

Contract: a model built on the meta device, sharded (FSDP2 over dp 2, or experts over ep 2), then given storage by
`materialize_sharded` or `to_empty` + `load_sharded_checkpoint`, holds EXACTLY (torch.equal) the values of the single
process running `materialize_sharded` / `from_pretrained` on the whole model; each rank reads only its own blocks
from the files (bytes counted); the strict key check names missing and unexpected tensors as the files name them.
One gloo group of 2 ranks for the whole module; the oracle is computed in the pytest process.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from am_nemotron_dist import case_result, run_cases, run_group
from am_nemotron_helpers import tiny_hf_config

from am_model_io import read_safetensors_folder
from am_models_nemotron import (
    NemotronHForCausalLM,
    load_sharded_checkpoint,
    materialize_sharded,
)

WORLD = 2
SEED = 7
PATTERN = "M*-E"  # mamba, attention, MLP, MoE (6 experts) and one MTP depth: every kind of unit
MAX_SHARD = "20KB"  # several safetensors files + an index, so keys of one tensor set span files


def _config() -> Any:
    return tiny_hf_config(PATTERN, mtp_depths=1)


def _single() -> NemotronHForCausalLM:
    return materialize_sharded(NemotronHForCausalLM.from_config(_config(), device="meta"), seed=SEED)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor gathered to its full shape (collective for DTensors; same order on every rank)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, tensor in model.state_dict().items():
        out[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()
    return out


def _fsdp2(model: NemotronHForCausalLM, mesh: Any) -> NemotronHForCausalLM:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers.values():
        fully_shard(layer, mesh=mesh)
    if model.mtp is not None:
        fully_shard(model.mtp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _meta_model(layout: str, mesh: Any) -> NemotronHForCausalLM:
    model = NemotronHForCausalLM.from_config(_config(), device="meta")
    if layout == "fsdp2":
        return _fsdp2(model, mesh)
    model.apply_expert_parallel(mesh)
    return model


def _init_case(layout: str, mesh: Any) -> dict[str, Any]:
    model = materialize_sharded(_meta_model(layout, mesh), seed=SEED)
    return {"state": _full_state(model)}


def _load_case(layout: str, mesh: Any, folder: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    model = _meta_model(layout, mesh)
    model.to_empty(device="cpu")
    report = load_sharded_checkpoint(model, folder)
    sharded = sorted(n for n, t in model.state_dict().items() if isinstance(t, DTensor))
    return {"state": _full_state(model), "bytes_read": report.bytes_read, "names": report.names, "sharded": sharded}


def _bad_keys_case(folder: str) -> str:
    model = NemotronHForCausalLM.from_config(_config(), device="meta")
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match="does not match") as info:
        load_sharded_checkpoint(model, folder)
    return str(info.value)


def _write_checkpoints(root: str) -> tuple[str, str]:
    """The single-process model saved in shards, and a copy with one tensor missing and one unexpected."""
    from safetensors.torch import save_file

    good, bad = os.path.join(root, "good"), os.path.join(root, "bad")
    model = _single()
    model.save_pretrained(good, max_shard_size=MAX_SHARD)
    model.save_pretrained(bad, max_shard_size=None)
    tensors = read_safetensors_folder(bad)
    del tensors["backbone.layers.1.mixer.q_proj.weight"]
    tensors["backbone.layers.9.mixer.A_log"] = torch.zeros(4)
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    return good, bad


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ep = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    folders = [_write_checkpoints(tempfile.mkdtemp(prefix="am_nemotron_sharded_")) if rank == 0 else None]
    torch.distributed.broadcast_object_list(folders, src=0)
    good, bad = folders[0]  # type: ignore[misc]
    return run_cases(
        {
            "init_fsdp2": lambda: _init_case("fsdp2", dp),
            "init_ep": lambda: _init_case("ep", ep),
            "load_fsdp2": lambda: _load_case("fsdp2", dp, good),
            "load_ep": lambda: _load_case("ep", ep, good),
            "bad_keys": lambda: _bad_keys_case(bad),
            "folder": lambda: good,
        }
    )


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_group(WORLD, _worker, timeout=300.0)


def _assert_equal_states(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    different = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not different, f"tensors that differ from the single process: {different}"


@pytest.mark.parametrize("layout", ["fsdp2", "ep"])
def test_materialized_sharded_model_equals_the_single_process_init(ranks: list[dict[str, Any]], layout: str) -> None:
    expected = _single().state_dict()
    for rank in range(WORLD):
        _assert_equal_states(case_result(ranks, f"init_{layout}", rank)["state"], expected)
    # not vacuous: the seeded init is random (a different seed gives other weights)
    other = materialize_sharded(NemotronHForCausalLM.from_config(_config(), device="meta"), seed=SEED + 1)
    assert not torch.equal(other.lm_head.weight, expected["lm_head.weight"])


@pytest.mark.parametrize("layout", ["fsdp2", "ep"])
def test_sharded_load_equals_the_single_process_load(ranks: list[dict[str, Any]], layout: str) -> None:
    folder = case_result(ranks, "folder", 0)
    expected = NemotronHForCausalLM.from_pretrained(folder).state_dict()
    for rank in range(WORLD):
        result = case_result(ranks, f"load_{layout}", rank)
        _assert_equal_states(result["state"], expected)
        assert set(result["names"]) == set(expected)


def test_each_rank_reads_only_its_own_blocks(ranks: list[dict[str, Any]]) -> None:
    """Bytes read from the files: FSDP2 shards every parameter over dp, so the ranks together read the checkpoint
    once, plus the unsharded buffers once per rank; under ep each rank reads the dense tensors and half the experts."""
    folder = case_result(ranks, "folder", 0)
    tensors = read_safetensors_folder(folder)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    experts = sum(t.numel() * t.element_size() for k, t in tensors.items() if ".experts." in k)
    fsdp = [case_result(ranks, "load_fsdp2", rank) for rank in range(WORLD)]
    sharded = set(fsdp[0]["sharded"])
    replicated = sum(
        t.numel() * t.element_size()
        for k, t in NemotronHForCausalLM.from_pretrained(folder).state_dict().items()
        if k not in sharded
    )
    assert replicated < total / 10  # the buffers only
    assert sum(r["bytes_read"] for r in fsdp) == total + (WORLD - 1) * replicated
    assert all(r["bytes_read"] < 0.6 * total for r in fsdp)
    assert experts > 0
    for rank in range(WORLD):
        assert case_result(ranks, "load_ep", rank)["bytes_read"] == total - experts // WORLD


def test_missing_and_unexpected_keys_are_named_as_the_files_name_them(ranks: list[dict[str, Any]]) -> None:
    message = case_result(ranks, "bad_keys", 0)
    assert "missing keys (1): ['backbone.layers.1.mixer.q_proj.weight']" in message
    assert "unexpected keys (1): ['backbone.layers.9.mixer.A_log']" in message


def test_a_pipeline_stage_loads_only_its_layers_with_the_whole_model_checked(ranks: list[dict[str, Any]]) -> None:
    """A stage (layers 2 and 3, the head, MTP) keeps the full model's names; the strict check still runs on the whole
    model, and the stage reads only its own tensors."""
    folder = case_result(ranks, "folder", 0)
    expected = NemotronHForCausalLM.from_pretrained(folder).state_dict()
    stage = NemotronHForCausalLM.from_config(_config(), device="meta")
    del stage.model.layers["0"], stage.model.layers["1"]
    stage.model.embed_tokens = None
    stage.to_empty(device="cpu")
    report = load_sharded_checkpoint(stage, folder)
    state = stage.state_dict()
    assert set(report.names) == set(state)
    assert not any(name.startswith(("model.layers.0.", "model.layers.1.", "model.embed_tokens")) for name in state)
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name
    stage_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert report.bytes_read == stage_bytes  # fp32 files, fp32 model: exactly this stage's tensors


def test_meta_from_pretrained_reads_no_data_and_checks_names(ranks: list[dict[str, Any]]) -> None:
    folder = case_result(ranks, "folder", 0)
    model = NemotronHForCausalLM.from_pretrained(folder, device_map="meta")
    assert all(t.is_meta for t in model.state_dict().values())
    bad = os.path.join(os.path.dirname(folder), "bad")
    with pytest.raises(ValueError, match=r"missing keys \(1\)"):
        NemotronHForCausalLM.from_pretrained(bad, device_map="meta")
