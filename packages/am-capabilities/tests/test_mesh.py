"""MeshContext and mesh reading: attribute meshes in-process, and real ``DeviceMesh`` objects on a 4-rank gloo
group spawned once for this module (every distributed case runs inside that one launch, including attached models
under FSDP2's ``fully_shard``)."""

from __future__ import annotations

import copy
import math
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn

from am_capabilities import MeshContext, attach_capabilities_and_validate, read_mesh_sizes, validate_for_mesh
from am_testing import run_group

WORLD_SIZE = 4
# Generous: four ranks import torch concurrently on two cores; a hung rank must fail the test, not the suite.
LAUNCH_TIMEOUT_S = 300.0  # 4 ranks importing torch on 2 busy cores; a real hang still ends here


class _Index:
    """An integer-like scalar (as numpy / 0-d integer tensors are) that is not an ``int``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


# ----------------------------------------------------------------------------------------------------------------
# MeshContext and attribute meshes
# ----------------------------------------------------------------------------------------------------------------


def test_mesh_context_defaults_are_one_and_world_size_is_the_product():
    assert MeshContext() == MeshContext(tp_size=1, pp_size=1, cp_size=1, ep_size=1, dp_size=1)
    mesh = MeshContext(tp_size=2, pp_size=3, cp_size=1, ep_size=2, dp_size=5)
    assert mesh.world_size == 2 * 3 * 1 * 2 * 5


def test_mesh_context_is_frozen_hashable_and_picklable():
    mesh = MeshContext(tp_size=2, dp_size=4)
    with pytest.raises(AttributeError):
        mesh.tp_size = 4  # type: ignore[misc]
    assert {mesh: 1}[MeshContext(tp_size=2, dp_size=4)] == 1
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert copy.deepcopy(mesh) == mesh


def test_mesh_context_lists_every_invalid_size():
    with pytest.raises(ValueError, match="Invalid MeshContext") as info:
        MeshContext(tp_size=0, pp_size=2.5, cp_size=True, ep_size="2", dp_size=-1)  # type: ignore[arg-type]
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 5
    for axis, shown in [("tp", "tp_size=0"), ("pp", "pp_size=2.5"), ("cp", "cp_size=True"), ("ep", "ep_size='2'")]:
        assert any(line.strip().startswith(f"- {shown}:") and f"{axis}_size" in line for line in lines), axis
    assert any("dp_size=-1" in line and ">= 1" in line for line in lines)


def test_mesh_context_normalises_integer_like_scalars():
    mesh = MeshContext(tp_size=_Index(2))  # type: ignore[arg-type]
    assert mesh.tp_size == 2
    assert type(mesh.tp_size) is int


def test_read_mesh_sizes_treats_missing_and_none_attributes_as_one():
    sizes, problems = read_mesh_sizes(SimpleNamespace(pp_size=2, cp_size=None))
    assert problems == []
    assert sizes == {"tp": 1, "pp": 2, "cp": 1, "ep": 1, "dp": 1}


def test_read_mesh_sizes_collects_problems_and_keeps_reading():
    sizes, problems = read_mesh_sizes(SimpleNamespace(tp_size=0, pp_size=4, cp_size=2.0))
    assert sizes["pp"] == 4
    assert sizes["tp"] == 1
    assert sizes["cp"] == 1
    assert len(problems) == 2
    assert "write cp_size=2 as an int" in problems[1]


def test_from_mesh_accepts_context_and_attribute_objects():
    context = MeshContext(cp_size=2)
    assert MeshContext.from_mesh(context) is context
    assert MeshContext.from_mesh(SimpleNamespace(ep_size=4, dp_size=2)) == MeshContext(ep_size=4, dp_size=2)
    with pytest.raises(ValueError, match="tp_size=0"):
        MeshContext.from_mesh(SimpleNamespace(tp_size=0))


# ----------------------------------------------------------------------------------------------------------------
# Real DeviceMesh cases (4 gloo ranks, one launch)
# ----------------------------------------------------------------------------------------------------------------


class _PlainModule(nn.Module):
    """No plans, no backend, no SDPA flag: supports nothing but data parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)


class _LinearModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _fsdp2_attached(mesh: Any, *, attach_first: bool) -> dict[str, Any]:
    """Attach before or after ``fully_shard``; FSDP2's own class sits directly over ours and training still matches
    the unsharded model."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    reference = _LinearModel()
    model = copy.deepcopy(reference)
    if attach_first:
        attach_capabilities_and_validate(model, mesh)
    fully_shard(model, mesh=mesh)
    if not attach_first:
        attach_capabilities_and_validate(model, mesh)
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    grad = model.linear.weight.grad.full_tensor()  # type: ignore[union-attr]
    return {
        "bases_are_fsdp_and_original": type(model).__bases__ == (FSDPModule, _LinearModel),
        "describes": model.supports.describes(model),
        "dp_size": model.supports.mesh.dp_size,
        "supports_tp": model.supports.supports_tp,
        "grad_matches": torch.allclose(grad, reference.linear.weight.grad, rtol=1e-6, atol=1e-6),
    }


def _mesh_fields(context: MeshContext) -> dict[str, int]:
    return {
        "tp": context.tp_size,
        "pp": context.pp_size,
        "cp": context.cp_size,
        "ep": context.ep_size,
        "dp": context.dp_size,
    }


def _distributed_cases() -> dict[str, Any]:
    """Run on every rank; returns {case name: result or ('error', message)}."""
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[str, Any] = {}

    def case(name: str, fn: Any) -> None:
        try:
            results[name] = fn()
        except Exception as exc:
            results[name] = ("error", type(exc).__name__, str(exc))

    pp_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    cp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    hsdp_ep = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "ep"))
    unnamed = init_device_mesh("cpu", (2, 2))
    custom_names = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tensor"))

    case("pp_dp", lambda: _mesh_fields(MeshContext.from_device_mesh(pp_dp)))
    case("cp_tp", lambda: _mesh_fields(MeshContext.from_device_mesh(cp_tp)))
    case("hsdp_ep", lambda: _mesh_fields(MeshContext.from_device_mesh(hsdp_ep)))
    case("submesh_tp", lambda: _mesh_fields(MeshContext.from_device_mesh(cp_tp["tp"])))
    case("from_mesh_dispatch", lambda: _mesh_fields(MeshContext.from_mesh(pp_dp)))
    case("unnamed", lambda: _mesh_fields(MeshContext.from_device_mesh(unnamed)))
    case("unknown_names", lambda: _mesh_fields(MeshContext.from_device_mesh(custom_names)))
    case(
        "aliases",
        lambda: _mesh_fields(MeshContext.from_device_mesh(custom_names, aliases={"fsdp": "dp", "tensor": "tp"})),
    )
    case("validate_pp_dp", lambda: validate_for_mesh(_PlainModule(), pp_dp))
    case("validate_cp_tp", lambda: validate_for_mesh(_PlainModule(), cp_tp))
    case(
        "validate_dp_only",
        lambda: validate_for_mesh(_PlainModule(), init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))),
    )

    def attach_and_copy() -> dict[str, Any]:
        model = _PlainModule()
        model._pp_plan = {"linear": (["x"], ["x"])}  # make PP legal for this instance
        attach_capabilities_and_validate(model, pp_dp)
        clone = copy.deepcopy(model)
        return {
            "pp_size": clone.supports.pp_size,
            "dp_size": clone.supports.mesh.dp_size,
            "describes_clone": clone.supports.describes(clone),
        }

    case("attach_and_copy", attach_and_copy)
    dp = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    case("fsdp2_attach_then_shard", lambda: _fsdp2_attached(dp, attach_first=True))
    case("fsdp2_shard_then_attach", lambda: _fsdp2_attached(dp, attach_first=False))
    return results


def _group_worker(rank: int, world_size: int) -> dict[str, Any]:
    return _distributed_cases()


@pytest.fixture(scope="module")
def device_mesh_results() -> list[dict[str, Any]]:
    """Launch the 4 ranks once (am-testing's `run_group`); return each rank's case results (a crash or hang fails
    every test of this module with each rank's traceback)."""
    return run_group(WORLD_SIZE, _group_worker, timeout=LAUNCH_TIMEOUT_S)


def _case(results: list[dict[str, Any]], name: str) -> Any:
    """The case's result, checked to be identical on every rank."""
    values = [rank_results[name] for rank_results in results]
    assert all(value == values[0] for value in values), f"ranks disagree on {name}: {values}"
    return values[0]


def _sizes(**kw: int) -> dict[str, int]:
    sizes = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1}
    sizes.update(kw)
    return sizes


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("pp_dp", _sizes(pp=2, dp=2)),
        ("cp_tp", _sizes(cp=2, tp=2)),
        ("hsdp_ep", _sizes(dp=1 * 2, ep=2)),
        ("submesh_tp", _sizes(tp=2)),
        ("from_mesh_dispatch", _sizes(pp=2, dp=2)),
        ("aliases", _sizes(dp=2, tp=2)),
    ],
)
def test_from_device_mesh_reads_sizes_by_dimension_name(device_mesh_results, name, expected):
    result = _case(device_mesh_results, name)
    assert result == expected
    assert math.prod(result.values()) in (1, 2, WORLD_SIZE)  # a sub-mesh covers part of the world


def test_from_device_mesh_rejects_unnamed_mesh(device_mesh_results):
    kind, error_type, message = _case(device_mesh_results, "unnamed")
    assert (kind, error_type) == ("error", "ValueError")
    assert "no dimension names" in message
    assert "mesh_dim_names" in message


def test_from_device_mesh_lists_unknown_dimension_names(device_mesh_results):
    kind, error_type, message = _case(device_mesh_results, "unknown_names")
    assert (kind, error_type) == ("error", "ValueError")
    assert "['fsdp', 'tensor']" in message
    assert "aliases" in message


def test_validate_for_mesh_reads_a_device_mesh(device_mesh_results):
    kind, error_type, message = _case(device_mesh_results, "validate_pp_dp")
    assert (kind, error_type) == ("error", "ValueError")
    assert "pp_size=2" in message
    assert "dp_size" not in message

    kind, error_type, message = _case(device_mesh_results, "validate_cp_tp")
    assert (kind, error_type) == ("error", "ValueError")
    assert "tp_size=2" in message
    assert "cp_size=2" in message
    assert "(2 problems)" in message

    assert _case(device_mesh_results, "validate_dp_only") is None


def test_attached_model_on_device_mesh_survives_deepcopy(device_mesh_results):
    assert _case(device_mesh_results, "attach_and_copy") == {"pp_size": 2, "dp_size": 2, "describes_clone": True}


@pytest.mark.parametrize("name", ["fsdp2_attach_then_shard", "fsdp2_shard_then_attach"])
def test_attached_model_under_fsdp2(device_mesh_results, name):
    """FSDP2 re-classes the model as ``FSDP<Class>(FSDPModule, <Class>)``: nothing of ours sits in between, the
    capabilities still describe the model, and sharded gradients equal the unsharded ones."""
    assert _case(device_mesh_results, name) == {
        "bases_are_fsdp_and_original": True,
        "describes": True,
        "dp_size": WORLD_SIZE,
        "supports_tp": False,
        "grad_matches": True,
    }
