"""am_model_io.materialize: seeded per-unit materialization of a meta-built model (single process here; the model
packages test FSDP2 / ep layouts against it on gloo ranks). Contract: values depend on (seed, unit name) only,
the global RNG is untouched, and every tensor is accounted for or the call refuses, naming what is wrong."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from am_model_io import InitUnit, local_region, materialize_sharded_, unit_seed


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 16, bias=False)


def _normal(module: nn.Module) -> None:
    for param in module.parameters():
        nn.init.normal_(param, std=0.02)


def _units(model: nn.Module) -> list[InitUnit]:
    names = ["embed", *(f"blocks.{i}" for i in range(3)), "head"]
    return [InitUnit(name, _normal) for name in names]


def _meta() -> _Toy:
    with torch.device("meta"):
        return _Toy()


def test_values_depend_on_the_seed_and_the_unit_name_only() -> None:
    a = materialize_sharded_(_meta(), template=_meta(), units=_units(_meta()), seed=1, device="cpu")
    # another unit order: the same values
    b = materialize_sharded_(_meta(), template=_meta(), units=_units(_meta())[::-1], seed=1, device="cpu")
    c = materialize_sharded_(_meta(), template=_meta(), units=_units(_meta()), seed=2, device="cpu")
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
        assert not torch.equal(tensor, c.state_dict()[name]), name
    assert unit_seed(1, "embed") != unit_seed(1, "head")


def test_the_global_rng_is_left_as_it_was() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    materialize_sharded_(_meta(), template=_meta(), units=_units(_meta()), seed=1, device="cpu")
    assert torch.equal(torch.rand(3), expected)


def test_a_pipeline_stage_gets_the_same_values_for_the_units_it_keeps() -> None:
    full = materialize_sharded_(_meta(), template=_meta(), units=_units(_meta()), seed=4, device="cpu")
    stage = _meta()
    del stage.embed
    stage.blocks = nn.ModuleList([stage.blocks[0]])  # keeps the name blocks.0
    materialize_sharded_(stage, template=_meta(), units=_units(_meta()), seed=4, device="cpu")
    for name, tensor in stage.state_dict().items():
        assert torch.equal(tensor, full.state_dict()[name]), name


def test_uncovered_and_already_materialized_tensors_are_refused_and_named() -> None:
    with pytest.raises(ValueError, match=r"meta tensors no init unit covers: \['head.weight'\]"):
        materialize_sharded_(_meta(), template=_meta(), units=_units(_meta())[:-1], seed=0, device="cpu")
    real = _Toy()
    with pytest.raises(ValueError, match="tensors already materialized"):
        materialize_sharded_(real, template=_meta(), units=_units(real), seed=0, device="cpu")


def test_local_region_of_a_plain_tensor_is_all_of_it() -> None:
    assert local_region(torch.zeros(3, 4)) == ((0, 0), (3, 4))
    assert local_region(torch.tensor(1.0)) == ((), ())
