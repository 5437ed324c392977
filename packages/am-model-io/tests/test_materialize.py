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


# ------------------------------------------------------------------------------------------------------------------
# DTensor layouts: every rank's indices, checked against torch's own split (`distribute_tensor` without a source
# rank cuts each rank's local tensor on the rank itself), on torch's fake process group (no communication).
# ------------------------------------------------------------------------------------------------------------------

LAYOUTS = {
    "tp-rows": ("Replicate", "Shard0"),
    "dp-rows-tp-cols": ("Shard0", "Shard1"),
    "dp-then-tp-rows": ("Shard0", "Shard0"),
    "fsdp2-over-tp-rows": ("Strided0", "Shard0"),  # what FSDP2 gives a TP Shard(0) parameter on (dp, tp)
    "packed-rows-over-tp": ("Replicate", "Strided0"),  # am-tensor-parallel's packed_colwise: a slice of every part
    "fsdp2-over-packed": ("Shard0", "Strided0"),
    "cols-only": ("Shard1", "Replicate"),
}


def _placement(name: str):  # type: ignore[no-untyped-def]
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if name == "Replicate":
        return Replicate()
    if name.startswith("Strided"):
        return _StridedShard(int(name[-1]), split_factor=2)
    return Shard(int(name[-1]))


def _take(full: torch.Tensor, index: tuple) -> torch.Tensor:  # type: ignore[type-arg]
    for dim, entry in enumerate(index):
        full = full[(slice(None),) * dim + (entry,)]
    return full


def _on_fake_ranks(world: int):  # type: ignore[no-untyped-def]
    """Yield (rank, 2 x 2 mesh ("dp", "tp")) for every rank of a fake world of 4, one process group at a time."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            yield rank, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        finally:
            dist.destroy_process_group()


# _StridedShard splits equal parts only (packed rows; FSDP2 pads its own shards): uneven shapes for plain shards only
CASES = [(layout, (8, 6)) for layout in sorted(LAYOUTS)]
CASES += [(layout, (7, 5)) for layout in sorted(LAYOUTS) if "Strided" not in "".join(LAYOUTS[layout])]


@pytest.mark.parametrize(("layout", "shape"), CASES, ids=[f"{layout}-{shape[0]}x{shape[1]}" for layout, shape in CASES])
def test_local_index_is_what_torch_gives_each_rank(layout: str, shape: tuple[int, int]) -> None:
    from torch.distributed.tensor import distribute_tensor

    from am_model_io import local_index

    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    placements = [_placement(name) for name in LAYOUTS[layout]]
    seen = []
    for rank, mesh in _on_fake_ranks(4):
        local = distribute_tensor(full, mesh, placements, src_data_rank=None)
        index = local_index(local)
        assert torch.equal(_take(full, index), local.to_local()), (layout, rank, index)
        seen.append(_take(full, index).flatten())
    if "Replicate" not in LAYOUTS[layout]:  # the four ranks hold every element exactly once
        assert sorted(torch.cat(seen).tolist()) == full.flatten().tolist()


def test_local_region_refuses_indices_that_are_not_one_block() -> None:
    from torch.distributed.tensor import distribute_tensor

    for rank, mesh in _on_fake_ranks(4):
        packed = distribute_tensor(
            torch.zeros(8, 4), mesh, [_placement("Replicate"), _placement("Strided0")], src_data_rank=None
        )
        with pytest.raises(ValueError, match="not one block: use local_index"):
            local_region(packed)
        rows = distribute_tensor(
            torch.zeros(8, 4), mesh, [_placement("Strided0"), _placement("Shard0")], src_data_rank=None
        )
        dp, tp = divmod(rank, 2)  # tp rank t holds rows [4t, 4t + 4), FSDP2 its dp half of them: one block again
        assert local_region(rows) == ((4 * tp + 2 * dp, 0), (2, 4))


class _SelfSharded(nn.Module):
    """A module that shards itself into a plain tensor (as Nemotron-H's Mamba2 mixer does): after `shard(tp, rank)`
    its weight `[rows / tp, 4]` holds every other row, starting at `rank` (a non-contiguous pick)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 4))
        self.layout: tuple[int, int] | None = None

    def shard(self, tp: int, rank: int) -> None:
        self.layout = (tp, rank)
        self.weight = nn.Parameter(self.weight[rank::tp].clone())

    def tensor_parallel_shard_state(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.layout is None:
            return dict(full)
        tp, rank = self.layout
        return {name: t[rank::tp] if name == "weight" else t for name, t in full.items()}


class _WithSelfSharded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = _SelfSharded()
        self.norm = nn.LayerNorm(4)


def test_a_module_that_shards_itself_gets_its_shard_of_the_unit_value() -> None:
    from am_model_io import SHARD_STATE_METHOD

    assert SHARD_STATE_METHOD == "tensor_parallel_shard_state"
    units = [InitUnit("", _normal)]
    with torch.device("meta"):
        whole, template = _WithSelfSharded(), _WithSelfSharded()
    whole = materialize_sharded_(whole, template=template, units=units, seed=3, device="cpu")
    for rank in range(2):
        with torch.device("meta"):
            part = _WithSelfSharded()
        part.mixer.shard(2, rank)
        materialize_sharded_(part, template=_WithSelfSharded().to("meta"), units=units, seed=3, device="cpu")
        assert torch.equal(part.mixer.weight, whole.mixer.weight[rank::2])
        assert torch.equal(part.norm.weight, whole.norm.weight)


def test_a_plain_shard_without_the_hook_is_refused_and_named() -> None:
    with torch.device("meta"):
        part = _WithSelfSharded()
    part.mixer.weight = nn.Parameter(torch.empty(4, 4, device="meta"))  # a shard, but no hook says how it was cut
    with pytest.raises(ValueError, match=r"mixer.weight: the unit's value has shape \(8, 4\), the model's tensor"):
        materialize_sharded_(part, template=_meta_with(), units=[InitUnit("", _normal)], seed=0, device="cpu")


def _meta_with() -> _WithSelfSharded:
    with torch.device("meta"):
        return _WithSelfSharded()


@pytest.mark.parametrize("layout", ["packed-rows-over-tp", "fsdp2-over-tp-rows", "dp-rows-tp-cols"])
def test_read_local_reads_only_the_runs_a_rank_holds(layout: str) -> None:
    """Packed rows (a slice of every part) are read as one run per part; a block in one read; nothing else."""
    from torch.distributed.tensor import distribute_tensor

    from am_model_io import read_local

    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    placements = [_placement(name) for name in LAYOUTS[layout]]
    for _rank, mesh in _on_fake_ranks(4):
        local = distribute_tensor(full, mesh, placements, src_data_rank=None)
        reads: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

        def read_block(offset: tuple[int, ...], shape: tuple[int, ...], reads: list = reads) -> torch.Tensor:  # type: ignore[type-arg]
            reads.append((offset, shape))
            return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]

        assert torch.equal(read_local(local, read_block), local.to_local())
        assert len(reads) == (2 if layout == "packed-rows-over-tp" else 1), reads
        assert sum(n * m for _, (n, m) in reads) == local.to_local().numel()


def test_fill_self_sharded_reads_whole_tensors_and_keeps_the_module_shard() -> None:
    from am_model_io import fill_self_sharded_, self_sharded_names

    whole = materialize_sharded_(
        _meta_with(), template=_meta_with(), units=[InitUnit("", _normal)], seed=5, device="cpu"
    )
    part = _meta_with()
    part.mixer.shard(2, 1)
    part.to_empty(device="cpu")
    assert self_sharded_names(part, template=_meta_with()) == {"mixer.weight": "mixer"}
    asked: list[str] = []

    def read(name: str) -> torch.Tensor:
        asked.append(name)
        return whole.state_dict()[name]

    assert fill_self_sharded_(part, template=_meta_with(), read=read) == ["mixer.weight"]
    assert asked == ["mixer.weight"]
    assert torch.equal(part.mixer.weight, whole.mixer.weight[1::2])
