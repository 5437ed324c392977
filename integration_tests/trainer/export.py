"""The HF-format export of a run, streamed: no rank ever holds the whole model.

What it is for: `make_hf_exporter` returns `export(folder)` (collective, every rank), which writes the folder the
model's own `save_pretrained` writes — the same keys, dtypes and values, config.json (and generation_config.json for
a transformers model that generates) — split into safetensors files of at most `max_shard_bytes` each. One writer per
pipeline stage (the stage's first rank: dp_cp rank 0 of tp rank 0); tensor by tensor, in state-dict order:
    the full value of a parameter / buffer is assembled on the writer only: each rank of the stage that holds a
    distinct block of it (a DTensor's `local_region`: FSDP2, expert-parallel and TP shards; copies on Replicate mesh
    dims and on other tp / expert-dp coordinates send nothing) sends its block point to point; a plain tensor is
    the writer's own; a module that shards itself under TP (plain-tensor shards, e.g. Mamba2) re-assembles its few
    tensors through its `tensor_parallel_full_state` (over tp, one module at a time);
    the full value is converted to the file's names and dtypes (the model's `am_model_io.FileLayout`, the one its
    own save uses: our model packages' `hf_file_layout`; transformers' tied weights and weight conversions in
    `transformers_file_layout`) and handed to an am_model_io `ShardWriter`, which
    writes a file as soon as the next tensor would take it over the budget.
Rank 0 then names the files (`model.safetensors`, or `model-0000i-of-0000n.safetensors` + the index) from what the
writers report and writes config.json, holding no weight. Peak extra host memory of a writer: one budget of tensors
plus the tensor in flight (a single tensor larger than the budget gets a file of its own, as transformers does); of
any other rank: its own block of the tensor in flight.
What it must not do: decide the layout (parallel.py), or gather a whole model, a whole stage or a whole state dict on
any rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from am_model_io import FileLayout

DEFAULT_SHARD_BYTES = 5 * 10**9  # our models' save_pretrained default ("5GB")


def shard_bytes(size: str | int) -> int:
    """`--hf-shard-size` in bytes: plain bytes ("65536") or save_pretrained's spelling ("5GB", "200MB", "64KB").

    Raises:
        ValueError: not a positive size.
    """
    from am_model_io import parse_shard_size

    text = str(size).strip()
    return parse_shard_size(int(text) if text.isdigit() else text)


def _conversion_lookup(model: Any) -> Any:
    """The model transformers should look its weight conversions up on. transformers finds them by class name, and
    FSDP2 (or a pipeline stage class) renames the class of a wrapped model: "FSDPGPTNeoXForCausalLM" has none, so
    GPT-NeoX's `lm_head` would be written as `lm_head` instead of the file's `embed_out`. The model itself when its
    class is transformers' own, else a meta-device twin of that class (same config; no storage), carrying the
    conversions `from_pretrained` attached to the model, if any."""
    from transformers import PreTrainedModel

    own = next(
        (c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and c.__module__.startswith("transformers")),
        type(model),
    )
    if type(model) is own:
        return model
    with torch.device("meta"):
        twin = own(copy.deepcopy(model.config))
    if getattr(model, "_weight_conversions", None) is not None:
        twin._weight_conversions = model._weight_conversions
    return twin


def transformers_file_layout(model: Any) -> FileLayout:
    """transformers' `save_pretrained`: the model's names, minus `_keys_to_ignore_on_save` and the targets of its
    tied weights (`all_tied_weights_keys`, what the config ties), with its weight conversions reverted (e.g. fused
    experts written back per expert); config.json with the model's dtype and class, generation_config.json when the
    model generates."""
    from transformers.core_model_loading import revert_weight_conversion

    dropped = set(getattr(model, "all_tied_weights_keys", None) or {}) | set(model._keys_to_ignore_on_save or ())
    named = _conversion_lookup(model)
    fused = _fused_file_keys(named)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # file key -> the model tensors of it seen so far

    def to_file(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kept = {k: v for k, v in tensors.items() if k not in dropped}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in kept.items():
            found = fused(name)
            if found is None:
                out.update(revert_weight_conversion(named, {name: tensor}))
                continue
            # a file tensor transformers cuts into several model tensors on load (`Chunk`: HRM-Text's gqkv_proj):
            # written once all of them are here (siblings in one module, so on one stage's writer)
            key, parts = found
            group = pending.setdefault(key, {})
            group[name] = tensor
            if len(group) == parts:
                out.update(revert_weight_conversion(named, pending.pop(key)))
        return out

    def write_metadata(folder: Path) -> None:
        config = copy.deepcopy(model.config)
        config.dtype = str(model.dtype).split(".")[1]
        # FSDP2 swaps in a class named "FSDP<cls>" (transformers strips the prefix the same way)
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
        config.save_pretrained(str(folder))
        if model.can_generate():
            model.generation_config.save_pretrained(str(folder))

    return FileLayout(to_file, write_metadata)


def _fused_file_keys(model: Any) -> Callable[[str], tuple[str, int] | None]:
    """`fused(name)`: (the file key, how many model tensors make it) for a model tensor that transformers' save joins
    with others into one file tensor (the reverse of a load-time converter with several targets), else None."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, apply_converters

    forward = [t for t in get_model_conversion_mapping(model, add_legacy=False) if isinstance(t, WeightConverter)]
    reverse: list[Any] = [t.reverse_transform() for t in forward[::-1] if len(t.target_patterns) > 1]

    def fused(name: str) -> tuple[str, int] | None:
        key, pattern = apply_converters(name, reverse)
        if pattern is None:
            return None
        converter = next(c for c in reverse if pattern in c.source_patterns)
        return key, len(converter.source_patterns)

    return fused


# ------------------------------------------------------------------------------------------------------------------
# One tensor's full value on the writer
# ------------------------------------------------------------------------------------------------------------------


def _holds_distinct_block(value: Any, writer: int) -> bool:
    """Whether this rank's block of DTensor `value` is one the writer takes: its mesh copy holds the writer (other tp
    / expert-dp coordinates hold copies) and on every mesh dim that does not shard it, it sits where the writer
    sits (Replicate dims hold copies). Distinct blocks tile the tensor exactly once."""
    mesh = value.device_mesh
    where = (mesh.mesh == writer).nonzero()
    if where.numel() == 0:
        return False
    writer_coordinate = where[0].tolist()
    mine = mesh.get_coordinate()
    # Shard and FSDP2's _StridedShard split the tensor; Replicate holds copies (Partial: refused by local_region)
    return all(not p.is_replicate() or mine[d] == writer_coordinate[d] for d, p in enumerate(value.placements))


def _block(offset: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _full_on_writer(name: str, value: Any, *, writer: int, stage_ranks: Sequence[int]) -> torch.Tensor | None:
    """The full value of one parameter / buffer (CPU) on `writer`, None on every other rank of the stage.

    A DTensor: every rank with a distinct block sends a header `[takes, offset..., shape...]` (int64), then its
    block, point to point to the writer, which places them (and checks that they cover the tensor once). A plain
    tensor is the same on every rank of the stage: the writer's own. Collective over `stage_ranks`."""
    from torch.distributed.tensor import DTensor

    from am_model_io import local_region

    me = dist.get_rank()
    if not isinstance(value, DTensor):
        return value.detach().to("cpu") if me == writer else None
    local = value.to_local().detach()
    offset, shape = local_region(value)
    takes = _holds_distinct_block(value, writer)
    ndim = len(value.shape)
    if me != writer:
        dist.send(torch.tensor([int(takes), *offset, *shape], dtype=torch.int64, device=local.device), dst=writer)
        if takes and local.numel():
            dist.send(local.contiguous(), dst=writer)
        return None
    full = torch.empty(tuple(value.shape), dtype=value.dtype)
    covered = 0
    if takes:
        full[_block(offset, shape)] = local.cpu()
        covered += local.numel()
    header = torch.empty(1 + 2 * ndim, dtype=torch.int64, device=local.device)
    for rank in stage_ranks:
        if rank == writer:
            continue
        dist.recv(header, src=rank)
        values = header.tolist()
        if not values[0]:
            continue
        their_offset, their_shape = values[1 : 1 + ndim], values[1 + ndim :]
        count = int(torch.Size(their_shape).numel())
        if count:
            block = torch.empty(their_shape, dtype=local.dtype, device=local.device)
            dist.recv(block, src=rank)
            full[_block(their_offset, their_shape)] = block.cpu()
            covered += count
    if covered != full.numel():
        raise RuntimeError(
            f"HF export of {name}: the stage's distinct blocks cover {covered} of its {full.numel()} elements "
            f"(placements {value.placements}); a layout this exporter does not understand"
        )
    return full


def _tp_module_groups(part: nn.Module) -> dict[str, tuple[str, nn.Module, list[str]]]:
    """Plain-tensor TP shards of `part` (modules that shard themselves): name -> (module prefix, module, the module's
    shard names), one entry per name, so the first name met exports the whole module."""
    from am_tensor_parallel import FULL_STATE_METHOD
    from trainer.tensor_parallel import tp_local_names

    local = tp_local_names(part)
    if local is None:
        return {}
    groups: dict[str, tuple[str, nn.Module, list[str]]] = {}
    for prefix, module in part.named_modules():
        owned = sorted(name for name in local.names if prefix and name.startswith(prefix + "."))
        if owned and callable(getattr(module, FULL_STATE_METHOD, None)):  # the module that shards itself
            for name in owned:
                groups.setdefault(name, (prefix, module, owned))
    return groups


def _full_tp_module(
    prefix: str, module: nn.Module, owned: list[str], state: dict[str, Any], *, tp_group: Any, keep: bool
) -> dict[str, torch.Tensor]:
    """A self-sharding module's plain-tensor TP shards re-assembled by its `tensor_parallel_full_state` (collective
    over tp; each input gathered over dp x cp first): the module's few tensors, kept on the writer only."""
    from torch.distributed.tensor import DTensor

    from am_tensor_parallel import FULL_STATE_METHOD

    relative = {}
    for name in owned:
        value = state[name]
        relative[name[len(prefix) + 1 :]] = value.full_tensor() if isinstance(value, DTensor) else value
    full = getattr(module, FULL_STATE_METHOD)(relative, group=tp_group)
    return {f"{prefix}.{name}": tensor.detach().cpu() for name, tensor in full.items()} if keep else {}


# ------------------------------------------------------------------------------------------------------------------
# The exporter
# ------------------------------------------------------------------------------------------------------------------


def make_hf_exporter(
    parts: list[nn.Module],
    *,
    file_layout: Callable[[nn.Module], FileLayout],
    stage_ranks: Sequence[int] | None = None,
    tp_group: Any = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Callable[[Path], dict[str, Any] | None]:
    """`export(folder)`: collective (every rank); writes the HF-format folder of the whole model, streamed (see the
    module docstring). Returns, on rank 0, the export's report (`files`, `max_shard_bytes`, and per writer its
    `rank`, `files`, `bytes` and `peak_held_bytes`: the most tensor bytes its `ShardWriter` held at once); None on
    the other ranks.

    parts: this rank's model parts (the whole model, or its pipeline stages), possibly FSDP2 / EP / TP-sharded.
    file_layout: how the model's own save writes a part (`ModelSpec.file_layout`: our model packages'
        `hf_file_layout`, `transformers_file_layout` for any other transformers model).
    stage_ranks: the global ranks holding this rank's stages, the writer first (None: this rank alone).
    tp_group: the tp process group when the parts hold plain-tensor TP shards.
    """
    from am_model_io import ShardWriter, finish_shard_files

    ranks = list(stage_ranks) if stage_ranks is not None else [dist.get_rank()]
    writer_rank = ranks[0]

    def export(folder: Path) -> dict[str, Any] | None:
        me = dist.get_rank()
        is_writer = me == writer_rank
        writer = ShardWriter(folder, max_shard_bytes=max_shard_bytes, prefix=f".rank{me:05d}") if is_writer else None
        for part in parts:
            layout = file_layout(part)
            state = part.state_dict(keep_vars=True)
            tp_groups = _tp_module_groups(part) if tp_group is not None else {}
            done: set[str] = set()
            for name, value in state.items():
                if name in done or not isinstance(value, torch.Tensor):
                    continue
                if name in tp_groups:
                    prefix, module, owned = tp_groups[name]
                    full = _full_tp_module(prefix, module, owned, state, tp_group=tp_group, keep=is_writer)
                    done.update(owned)
                else:
                    one = _full_on_writer(name, value, writer=writer_rank, stage_ranks=ranks)
                    full = {name: one} if one is not None else {}
                if writer is not None:
                    for key, tensor in layout.to_file(full).items():
                        writer.add(key, tensor)
                del full  # one tensor (one self-sharding module) in flight
        report = None
        if writer is not None:
            files = writer.close()
            report = {"rank": me, "files": files, "peak_held_bytes": writer.peak_held_bytes}
        reports: list[Any] = [None] * dist.get_world_size() if me == 0 else []
        dist.gather_object(report, reports if me == 0 else None, dst=0)
        if me != 0:
            return None
        written = [r for r in reports if r is not None]
        finish_shard_files(folder, [file for r in written for file in r["files"]])
        file_layout(parts[0]).write_metadata(folder)
        return {
            "files": sum(len(r["files"]) for r in written),
            "max_shard_bytes": max_shard_bytes,
            "writers": [
                {
                    "rank": r["rank"],
                    "files": len(r["files"]),
                    "bytes": sum(file.nbytes for file in r["files"]),
                    "peak_held_bytes": r["peak_held_bytes"],
                }
                for r in written
            ],
        }

    return export


__all__ = ["DEFAULT_SHARD_BYTES", "make_hf_exporter", "shard_bytes", "transformers_file_layout"]
