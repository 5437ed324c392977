"""Building a model of any size: on the meta device first, then each rank materializes only the blocks it holds.

What it is for (issue 23 §1; torchtitan's order): no rank ever holds a whole model.
    1. validation builds the model's structure on the meta device (`meta_model`): a preset from its config, a
       `--model-path` folder from its config.json, with the strict key check done on the safetensors headers (our
       registered classes: their `from_pretrained(folder, device_map="meta")`; any other transformers causal LM:
       `header_key_problems`, named as the files name them). No tensor data is read.
    2. the run splits that meta model into pipeline stages, applies tensor parallelism (DTensor placements over tp;
       a module that shards itself, Nemotron-H's Mamba2 mixer, keeps plain meta tensors of its shard's shape),
       shards the experts over ep and wraps FSDP2 (DTensor parameters with their full logical shape, 2-D (dp_cp,
       tp) on top of TP, still without storage);
    3. `materialize_parts` gives each rank storage for its own blocks only (TP shards included: no rank ever holds
       a whole stage), then values:
       - a preset: the seeded per-unit init (`am_model_io.materialize_sharded_` with the model package's
         `meta_twin` / `init_units`; for a transformers preset, one unit per decoder layer / `_no_split_modules` block
         and per other tensor-owning module, initialized by the model's own `_init_weights`). A tensor's value is a
         function of (seed, unit name) only, so every layout holds exactly the single process's values, and the
         single-process reference (`build_model`) runs the same function. A DTensor copies exactly the indices it
         holds (`am_model_io.local_index`: any Shard / _StridedShard / Replicate placements on any mesh dims); a
         module that shards itself cuts its shard out of the unit's full value (`tensor_parallel_shard_state`);
       - a folder: our registered classes' `load_sharded_checkpoint` (each rank reads its own slices, per-expert keys
         of its own experts only); any other transformers causal LM whose files name its tensors as its modules do
         (what transformers' `save_pretrained` writes): the seeded init (for the buffers no file holds), then
         `am_model_io.load_sharded_tensors_` (each rank reads its own blocks with `get_slice`; a packed TP layout,
         a slice of every packed part, is read run by run with `am_model_io.read_local`; a tensor transformers cuts
         out of a fused file tensor on load, by `Chunk` / `Interleave`, reads its rows of that tensor with
         `LazyCheckpoint.read_indexed`). Registered classes' loaders
         fill a module that shards itself from its whole tensors, one module at a time (`fill_self_sharded_`);
       - a tied embedding whose two ends landed on different pipeline stages: the output copy takes the input's
         values (am-pipelining's `sync_tied_embedding_weights`, over the two ranks' pair group).
Peak host memory per rank: its own blocks plus one init unit (one decoder layer) in fp32, or one tensor block read
(test_real_size.py measures it at dp 4 and at tp 2).
What it must not do: allocate a whole model (outside `build_model`'s single process, which is the reference), name a
model class (the model packages' functions come through the `ModelSpec`), or issue a collective other than the tied
copy's broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from am_model_io import InitUnit, ShardedLoad, materialize_sharded_


@dataclass(frozen=True)
class SeededInit:
    """How a model family is initialized piecewise: `meta_twin(part)` is the whole unsharded model `part` was cut
    from, on the meta device; `init_units(twin)` its init units (am-precision's `InitUnit`)."""

    meta_twin: Callable[[nn.Module], nn.Module]
    init_units: Callable[[nn.Module], list[InitUnit]]


# ------------------------------------------------------------------------------------------------------------------
# transformers models: their own `_init_weights`, one unit per block
# ------------------------------------------------------------------------------------------------------------------


def transformers_meta_twin(model: nn.Module) -> nn.Module:
    """The whole transformers model `model` (or a pipeline stage cut from it) was built as, on the meta device."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    return twin.float()


def _block_names(model: nn.Module) -> list[str]:
    """The model's blocks, each one init unit: the decoder layers (am-pipelining's `find_layers`), else the blocks of
    transformers' `_no_split_modules` classes (outermost), else none."""
    from trainer.parallel import _layer_modules

    ids = {id(module) for module in _layer_modules(model)}
    return [name for name, module in model.named_modules() if id(module) in ids]


def transformers_init_units(twin: nn.Module) -> list[InitUnit]:
    """Init units of a transformers model: each block (see `_block_names`), then every other module that owns a
    parameter or buffer directly, each initialized by the model's own `_init_weights` applied children first (as
    transformers' `initialize_weights` does) — so norms start at one, RoPE buffers are recomputed, embeddings'
    padding rows are zero."""
    init_weights: Any = getattr(twin, "_init_weights", None)
    if not callable(init_weights):
        raise ValueError(f"{type(twin).__name__} has no _init_weights: it cannot be initialized piecewise")

    def init(module: nn.Module) -> None:
        module.apply(init_weights)

    blocks = _block_names(twin)
    inside = tuple(f"{name}." for name in blocks)
    units = [InitUnit(name, init) for name in blocks]
    for name, module in twin.named_modules():
        if name in blocks or name.startswith(inside):
            continue
        owns = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        if owns:
            units.append(InitUnit(name, init))
    return units


TRANSFORMERS_INIT = SeededInit(meta_twin=transformers_meta_twin, init_units=transformers_init_units)


# ------------------------------------------------------------------------------------------------------------------
# Materializing the parts a rank holds
# ------------------------------------------------------------------------------------------------------------------


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (`lm_head.weight is embed_tokens.weight`), in module order."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _retie(part: nn.Module, groups: list[list[str]]) -> None:
    """Tie again, by identity, the tied tensors (`groups`: `tied_groups` of the whole model) `part` holds both ends
    of (`to_empty` makes each a tensor of its own); the first name's tensor is the one the units initialized."""
    params = dict(part.named_parameters(remove_duplicate=False))
    for names in groups:
        present = [name for name in names if name in params]
        for name in present[1:]:
            if params[name] is not params[present[0]]:
                setattr(part.get_submodule(_module_of(name)), name.rsplit(".", 1)[-1], params[present[0]])


def _tied_copy_units(part: nn.Module, groups: list[list[str]], units: list[InitUnit]) -> list[InitUnit]:
    """Units for the output copy of a tied embedding held by a stage without the input (the model's units cover the
    tensor through the embedding): zeros here, the embedding's values after `sync_tied_embedding_weights`."""
    names = {unit.name for unit in units}

    def zero(module: nn.Module) -> None:
        for tensor in module.parameters():
            tensor.zero_()

    extra = []
    params = dict(part.named_parameters(remove_duplicate=False))
    modules = {name for name, _ in part.named_modules(remove_duplicate=False)}
    for group in groups:
        held = [name for name in group if name in params]
        if held and _module_of(group[0]) not in modules:
            module = _module_of(held[0])
            if module not in names:
                extra.append(InitUnit(module, zero))
    return extra


def materialize_seeded(part: nn.Module, *, init: SeededInit, seed: int, device: torch.device | str) -> nn.Module:
    """Storage for `part`'s own blocks on `device` and the seeded per-unit init of its family (see the module
    docstring); a tied pair `part` holds both ends of is tied again."""
    twin = init.meta_twin(part)
    groups = tied_groups(twin)  # before the per-unit init, which unties the twin too
    units = init.init_units(twin)
    units = units + _tied_copy_units(part, groups, units)
    materialize_sharded_(part, template=twin, units=units, seed=seed, device=device)
    _retie(part, groups)
    return part


def materialize_parts(
    parts: list[nn.Module],
    *,
    materialize: Callable[[nn.Module, int, torch.device], ShardedLoad | None],
    seed: int,
    device: torch.device,
) -> int:
    """Materialize every part this rank holds (`materialize`: the spec's), then give the output copy of a tied
    embedding split over two stages the input's values (collective over the two ranks' pair group; every rank calls
    it, ranks without a copy do nothing). Returns the checkpoint bytes this rank read (0: a seeded init)."""
    from am_pipelining import sync_tied_embedding_weights

    read = 0
    for part in parts:
        loaded = materialize(part, seed, device)
        read += loaded.bytes_read if loaded is not None else 0
    sync_tied_embedding_weights(parts)
    return read


# ------------------------------------------------------------------------------------------------------------------
# transformers folders: the strict check on the headers, each rank's blocks read on their own
# ------------------------------------------------------------------------------------------------------------------


def header_sources(folder: Path, model: nn.Module) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """(the model's name -> the file keys it is read from, loading info) for a transformers model whose files name
    its tensors as its modules do, or as transformers' conversion rules map them (per-expert files stacked, and
    fused, into one tensor: see `_model_names`), from the safetensors headers only (no tensor data is read).

    A source is `[key]` for a tensor stored as itself, or one entry per expert for a stack transformers merges on
    load: a tuple of keys concatenated along dim 0 (`(experts.{e}.w1.weight, experts.{e}.w3.weight)` is row e of
    Mixtral's `[E, 2I, H]` `gate_up_proj`), which `am_model_io.load_sharded_tensors_` reads block by block: a rank
    holding experts [a, b) reads only their files; or `[_Reindexed]` for a target transformers cuts out of one fused
    tensor by re-indexing its rows (`Chunk`, `Interleave`: HRM-Text's `gqkv_proj` -> gate / q / k / v,
    Inkling 2's interleaved `w13_weight` -> `gate_up_proj`), read by `load_transformers_blocks` with
    `LazyCheckpoint.read_indexed`: a rank reads only its block's rows of the file's tensor.

    The loading info has transformers' form (`missing_keys`, `unexpected_keys`, `mismatched_keys` as `(key, file
    shape, model shape)`), for trainer/models.py's strict `check_loaded_keys`: every parameter and persistent buffer
    must be in the files (a tied group needs one of its names; a stack every expert's pieces), nothing else may be
    (models.py's `ALLOWED_UNEXPECTED` aside: that check filters). `converted_keys` lists the keys only a transformers
    load can convert (a conversion other than stacking, concatenating and re-indexing rows, e.g. `Transpose`,
    `PermuteForRope`): such a folder is loaded whole.
    """
    from am_model_io import LazyCheckpoint

    expected = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    with LazyCheckpoint(folder) as checkpoint:
        stored = {key: tuple(t.shape) for key, t in checkpoint.meta_state_dict().items()}
        renamed = _model_names(model, stored, expected)
        by_name: dict[str, str | _Reindexed] = {name: key for key, name in renamed.items() if isinstance(name, str)}
        # a fused tensor transformers splits / re-orders on load: each target is rows of one file key
        by_name.update({part.name: part for parts in renamed.values() if isinstance(parts, list) for part in parts})
        stacks: dict[str, dict[int, dict[int, str]]] = {}  # the model's name -> expert -> piece -> file key
        for key, target in renamed.items():
            if isinstance(target, _Stacked) and target.name in expected:
                stacks.setdefault(target.name, {}).setdefault(target.expert, {})[target.piece] = key
        tied = {name: group for group in tied_groups(model) for name in group}
        sources: dict[str, list[Any]] = {}
        missing: list[str] = []
        unexpected = [key for key, name in renamed.items() if isinstance(name, str) and name not in expected]
        unexpected += [key for key, t in renamed.items() if isinstance(t, _Stacked) and t.name not in expected]
        unexpected += sorted(
            {key for key, t in renamed.items() if isinstance(t, list) and any(p.name not in expected for p in t)}
        )
        for name in expected:
            if name in stacks:
                rows, absent, extra = _stack_rows(stacks[name], renamed, experts=expected[name][0])
                missing += absent
                unexpected += extra
                if not absent:
                    sources[name] = rows
                continue
            group = tied.get(name, [name])
            found = next((by_name[n] for n in [name, *group] if n in by_name), None)
            if found is not None:
                sources[name] = [found]
            elif name == next(n for n in group if n in expected):  # a tied group missing entirely is named once
                missing.append(name)
        mismatched: list[tuple[str, tuple[int, ...] | None, tuple[int, ...]]] = []
        for name, keys in sources.items():
            if isinstance(keys[0], _Reindexed):
                if keys[0].shape != expected[name]:
                    mismatched.append((keys[0].key, keys[0].shape, expected[name]))
                continue
            single = len(keys) == 1 and isinstance(keys[0], str)
            shapes = [checkpoint.source_shape(entry) for entry in keys]
            shape = shapes[0] if single else (len(keys), *(shapes[0] or ()))
            if any(s is None or s != shapes[0] for s in shapes) or shape != expected[name]:
                first = keys[0] if isinstance(keys[0], str) else " + ".join(keys[0])
                mismatched.append((first if single else f"{first} .. ({len(keys)} experts)", shape, expected[name]))
    info: dict[str, list[Any]] = {
        "converted_keys": sorted(key for key, name in renamed.items() if name is None),
        "missing_keys": sorted(missing),
        "unexpected_keys": sorted(unexpected),
        "mismatched_keys": mismatched,
    }
    return sources, info


@dataclass(frozen=True)
class _Stacked:
    """A per-expert file key that transformers stacks into the model's tensor `name`: row `expert`, piece `piece` of
    the row (the converter's source pattern index: pieces are concatenated along the row's dim 0 in that order);
    `span` is where the expert index sits in the key (to name a missing expert's key as the files would)."""

    name: str
    expert: int
    piece: int
    span: tuple[int, int]


@dataclass(frozen=True, eq=False)
class _Reindexed:
    """The model's tensor `name` as transformers cuts it out of the file's fused tensor `key` on load: along `dim`
    its index i is the file tensor's index `rows[i]` (1-D int64, as long as the target's dim), every other dim is
    the file tensor's whole; `shape` is the target's full shape."""

    name: str
    key: str
    dim: int
    rows: torch.Tensor
    shape: tuple[int, ...]

    def index(self, offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice | torch.Tensor, ...]:
        """The file tensor's index of the target's block `[offset, offset + shape)` (`LazyCheckpoint.read_indexed`)."""
        return tuple(
            self.rows[o : o + n] if d == self.dim else slice(o, o + n)
            for d, (o, n) in enumerate(zip(offset, shape, strict=True))
        )


def _stack_rows(
    by_expert: dict[int, dict[int, str]], renamed: dict[str, Any], *, experts: int
) -> tuple[list[tuple[str, ...]], list[str], list[str]]:
    """(one entry per expert 0..experts-1: its pieces' keys in order, missing keys, unexpected keys) of a stack."""
    pieces = max((piece for row in by_expert.values() for piece in row), default=-1) + 1
    templates: dict[int, str] = {}
    for row in by_expert.values():
        for piece, key in row.items():
            templates.setdefault(piece, key)
    missing = []
    for expert in range(experts):
        for piece in range(pieces):
            if piece not in by_expert.get(expert, {}):
                template = templates[piece]
                low, high = renamed[template].span
                missing.append(f"{template[:low]}{expert}{template[high:]}")
    extra = [key for expert, row in by_expert.items() if expert >= experts for key in row.values()]
    if missing:
        return [], missing, extra
    return [tuple(by_expert[e][p] for p in range(pieces)) for e in range(experts)], missing, extra


def _model_names(
    model: nn.Module, stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]
) -> dict[str, str | _Stacked | list[_Reindexed] | None]:
    """File key -> the model's name for it, by transformers' own renaming rules for the architecture (e.g. GPT-NeoX's
    `embed_out` is `lm_head`; the base-model prefix added or dropped). A per-expert key that a transformers
    `WeightConverter` stacks (`MergeModulelist(dim=0)`, then optionally `Concatenate(dim=1)` of several patterns:
    Mixtral's `experts.{e}.w1/w3.weight` -> `experts.gate_up_proj`, Qwen2-MoE's and OLMoE's `gate_proj/up_proj`) is
    a `_Stacked` row piece, read block by block. A fused key that a converter only re-indexes along one dim
    (`Chunk`, `Interleave` and their chains, see `_reindexed`) is a list of `_Reindexed` targets. None for a key only
    another conversion can load (tensors transposed or computed on load): such a key cannot be read block by block,
    and the folder is loaded whole."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    except (ImportError, AttributeError, TypeError):  # not a transformers model, or another transformers version
        return {key: key for key in stored}
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None
    names: dict[str, str | _Stacked | list[_Reindexed] | None] = {}
    for key in stored:
        name, pattern = rename_source_key(
            key, renamings, converters, base_model_prefix=prefix, meta_state_dict=expected
        )
        converter = next((c for c in converters if pattern in c.source_patterns), None) if pattern else None
        if pattern is None or converter is None:
            names[key] = name
            continue
        stacked = _stacked_piece(key, name, pattern, converter)
        names[key] = stacked if stacked is not None else _reindexed(key, name, pattern, converter, model, stored[key])
    return names


def _reindexed(
    key: str, name: str, pattern: str, converter: Any, model: nn.Module, shape: tuple[int, ...]
) -> list[_Reindexed] | None:
    """The targets a converter cuts out of the fused file tensor `key` (of `shape`) when each of its operations only
    re-indexes one and the same dim (`Chunk`: equal parts, e.g. `[gate; q; k; v]` rows; `Interleave`: even rows,
    then odd rows; chained as transformers lists them, e.g. `[Interleave(1), Chunk(1)]`). None otherwise.

    The target rows are transformers' own: the converter runs on a probe, `arange(shape[dim])` laid along `dim` (size
    1 on every other dim, so the probe is as small as one row index per row), and each target's probe values are
    the file rows it is made of; names come from the converter too."""
    import copy

    from transformers.core_model_loading import Chunk, Interleave

    operations = list(converter.operations)
    dims = {getattr(op, "dim", None) for op in operations}
    if (
        len(converter.source_patterns) != 1
        or not operations
        or any(type(op) not in (Chunk, Interleave) for op in operations)
        or len(dims) != 1
    ):
        return None
    (dim,) = dims
    if not isinstance(dim, int) or not 0 <= dim < len(shape):
        return None
    probe_shape = [1] * len(shape)
    probe_shape[dim] = shape[dim]
    probe = torch.arange(shape[dim], dtype=torch.int64).reshape(probe_shape)
    fresh = copy.deepcopy(converter)  # its collected tensors are its own
    fresh.add_tensor(name, key, pattern, lambda: probe)
    try:
        targets = fresh.convert(name, model=model, config=getattr(model, "config", None))
    except (ValueError, RuntimeError, TypeError, KeyError, AttributeError):  # a probe it cannot handle: loaded whole
        return None
    found = []
    for target, rows in targets.items():
        if not isinstance(rows, torch.Tensor) or rows.dim() != len(shape):
            return None
        if any(size != 1 for d, size in enumerate(rows.shape) if d != dim):
            return None
        target_shape = (*shape[:dim], rows.shape[dim], *shape[dim + 1 :])
        found.append(_Reindexed(target, key, dim, rows.reshape(-1).clone(), target_shape))
    return found


def _stacked_piece(key: str, name: str, pattern: str, converter: Any) -> _Stacked | None:
    """The row piece `key` is of the stack `name` (see `_model_names`), or None when the converter does more than
    stack per-expert keys (and concatenate several patterns along the row's first dim)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    stacks_only = ops == [(MergeModulelist, 0)] and len(converter.source_patterns) == 1
    stacks_and_fuses = ops == [(MergeModulelist, 0), (Concatenate, 1)]
    if not (stacks_only or stacks_and_fuses) or len(converter.target_patterns) != 1 or pattern.count("*") != 1:
        return None
    import re

    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if found is None:
        return None
    piece = converter.source_patterns.index(pattern)
    return _Stacked(name=name, expert=int(found.group(1)), piece=piece, span=found.span(1))


def load_transformers_blocks(part: nn.Module, folder: Path, *, seed: int, device: torch.device) -> ShardedLoad:
    """A transformers part: the seeded init (buffers no file holds, e.g. RoPE frequencies), then every tensor the
    files hold read into this rank's blocks (`load_sharded_tensors_`: a DTensor reads its own block only; a stack of
    per-expert files only its own experts' files). Returns what was read."""
    from am_model_io import LazyCheckpoint, load_sharded_tensors_, read_local

    materialize_seeded(part, init=TRANSFORMERS_INIT, seed=seed, device=device)
    sources, info = header_sources(folder, transformers_meta_twin(part))
    if any(info.values()):  # validation refused these already: the folder changed since then
        raise ValueError(f"--model-path {folder} changed after validation: {info}")
    held = part.state_dict(keep_vars=True)
    # A tensor whose rows on this rank are not one block (a packed `_StridedShard` TP layout: a slice of every part),
    # or that transformers cuts out of a fused file tensor (`_Reindexed`), is read run by run (`read_local`, each
    # block through `read_indexed` for a re-indexed one); the others block by block (`load_sharded_tensors_`).
    by_runs = {
        name
        for name, tensor in held.items()
        if name in sources and (isinstance(sources[name][0], _Reindexed) or not _one_block(tensor))
    }
    with LazyCheckpoint(folder) as checkpoint:
        blocks = {name: keys for name, keys in sources.items() if name in held and name not in by_runs}
        loaded = load_sharded_tensors_(part, checkpoint, blocks)
        before = checkpoint.bytes_read
        with torch.no_grad():
            for name in sorted(by_runs):
                (key,) = sources[name]  # a stack of per-expert files is never TP-sharded: experts stay whole under tp

                def read_block(offset: tuple[int, ...], shape: tuple[int, ...], key: Any = key) -> torch.Tensor:
                    if isinstance(key, _Reindexed):
                        return checkpoint.read_indexed(key.key, key.index(offset, shape))
                    return checkpoint.read_source_block(key, offset, shape)

                tensor = held[name]
                to_local = getattr(tensor, "to_local", None)
                (to_local() if callable(to_local) else tensor).copy_(read_local(tensor, read_block))
        return ShardedLoad(loaded.names + tuple(sorted(by_runs)), loaded.bytes_read + checkpoint.bytes_read - before)


def _one_block(tensor: torch.Tensor) -> bool:
    """Whether this rank's part of `tensor` is one contiguous block of the full tensor (`local_index`)."""
    from am_model_io import local_index

    return all(isinstance(entry, slice) for entry in local_index(tensor))


__all__ = [
    "TRANSFORMERS_INIT",
    "SeededInit",
    "header_sources",
    "load_transformers_blocks",
    "materialize_parts",
    "materialize_seeded",
    "tied_groups",
    "transformers_init_units",
    "transformers_meta_twin",
]
