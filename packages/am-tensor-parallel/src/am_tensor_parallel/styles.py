"""transformers' tensor-parallel style names, translated to torch `ParallelStyle`s.

A style name is data (`"colwise"`); `translate_style` turns it into the torch object that
`parallelize_module` applies. Names and semantics follow transformers' `ParallelInterface` (5.x names, plus the 4.x
names that mean the same sharding). Styles transformers has but whose work belongs elsewhere (experts: am-moe's
expert parallelism) or that only serve its inference kernels are listed in `UNSUPPORTED_STYLES` with the reason, so
a plan naming them is refused up front, never applied half-way.

This module builds styles; it never decides which module gets which (that is `plan`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = [
    "FULL_STATE_METHOD",
    "MODULE_STYLE_METHOD",
    "PROBLEMS_METHOD",
    "SHARD_STATE_METHOD",
    "STYLES",
    "UNSUPPORTED_STYLES",
    "translate_style",
]

# name -> (what it does; the module kinds it applies to). The aliases of one sharding share a row's meaning.
STYLES: dict[str, str] = {
    "colwise": "Linear: weight/bias Shard(0) (output features); input replicated, output this rank's feature shard",
    "local_colwise": "transformers 4.x name of `colwise` (same sharding; parameters are DTensors here)",
    "colwise_rep": "Linear: like `colwise`, output all-gathered (replicated)",
    "colwise_gather_output": "transformers 5.x name of `colwise_rep`",
    "rowwise": "Linear: weight Shard(1) (input features), bias replicated; input a feature shard, output all-reduced",
    "rowwise_rep": "Linear: like `rowwise`, the input arrives replicated and each rank takes its slice",
    "rowwise_split_input": "transformers 5.x name of `rowwise_rep`",
    "local_rowwise": "Linear: like `rowwise` but the output stays this rank's partial sum (a `gather` parent sums)",
    "gather": "any module: sum its output over tp (forward all-reduce, identity backward); parent of `local_rowwise`",
    "all_reduce": "transformers 5.x name of `gather`",
    "packed_colwise": "Linear with packed [gate; up] output rows: each rank takes its slice of every packed part",
    "packed_rowwise": "Linear whose input is packed [a; b] (the partner of `packed_colwise`): matching slices",
    "embedding_rowwise": "Embedding: vocabulary-parallel (weight Shard(0)); partial lookups summed",
    "embedding_colwise": "Embedding: weight Shard(1) (embedding dim); the slices gathered",
    "sequence_parallel": "norm / dropout: runs on this rank's sequence shard, parameters replicated",
    "replicated_with_grad_allreduce": "norm on a sharded axis (per-head q/k norms): replicated, gradient summed",
    "replicate": "any module: every rank keeps the full module (no sharding, no collective)",
    "sequence_gather": "token-wise module run whole (MoE router + experts): under sequence parallelism its input is "
    "all-gathered from the sequence shards and its output sliced back to them; otherwise `replicate`",
    "module": "a module that shards itself: its `tensor_parallel_style(*, sequence_parallel)` gives the ParallelStyle",
}

# The method a module styled "module" implements (see `apply_tensor_parallel`), and the validation hook any module
# may implement: `tensor_parallel_problems(tp, *, sequence_parallel) -> list[str]`.
MODULE_STYLE_METHOD = "tensor_parallel_style"
PROBLEMS_METHOD = "tensor_parallel_problems"
# The method through which such a module re-assembles its plain-tensor shards (checkpoints, HF export):
# `tensor_parallel_full_state(local: {name relative to the module: this rank's tensor}, *, group) -> {name: full}`,
# collective over the tp group (names it does not shard are returned unchanged).
FULL_STATE_METHOD = "tensor_parallel_full_state"
# Its inverse, through which a meta-built model's such module is filled with this rank's shard (am_model_io's seeded
# materialization, a checkpoint loader): `tensor_parallel_shard_state(full: {name relative to the module: the
# unsharded tensor}) -> {name: this rank's shard}`, pure (no collective; the module knows its tp rank once it is
# sharded), names it does not shard returned unchanged (a module not sharded returns them all unchanged).
SHARD_STATE_METHOD = "tensor_parallel_shard_state"

UNSUPPORTED_STYLES: dict[str, str] = {
    "moe_tp_experts": "experts are sharded by expert parallelism (am_moe.apply_expert_parallel over an ep mesh)",
    "moe_identity_expert": "part of transformers' all-reduce experts, which am-moe's expert parallelism replaces",
    "grouped_gemm": "an expert-parallel style: use am_moe.apply_expert_parallel",
    "ep_router": "an expert-parallel style: use am_moe.apply_expert_parallel",
    "local": "transformers 4.x isolated experts: use am_moe.apply_expert_parallel",
    "local_packed_rowwise": "transformers 4.x inference-only expert style: use am_moe.apply_expert_parallel",
    "local_params": "runs transformers' local inference kernels on DTensor shards; no training semantics to translate",
    "mla_kv_a_proj": "DeepSeek MLA's split projection: not implemented here; give the attention 'replicate'",
}

# Which styles shard a module's output features (a TP region starts) / reduce a region's partial sums (it ends).
COLWISE_STYLES = frozenset({"colwise", "local_colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"})
ROWWISE_STYLES = frozenset({"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise"})
EMBEDDING_STYLES = frozenset({"embedding_rowwise", "embedding_colwise"})
LINEAR_STYLES = COLWISE_STYLES | ROWWISE_STYLES | {"local_rowwise"}
_ALIASES = {
    "local_colwise": "colwise",
    "colwise_gather_output": "colwise_rep",
    "rowwise_split_input": "rowwise_rep",
    "all_reduce": "gather",
}


def canonical_style(name: str) -> str:
    """The one name of a style's sharding (`"colwise_gather_output"` -> `"colwise_rep"`)."""
    return _ALIASES.get(name, name)


def translate_style(name: str, *, sequence_parallel: bool = False, role: str = "") -> ParallelStyle:
    """The torch `ParallelStyle` for one transformers style name.

    Args:
        name: a key of `STYLES`.
        sequence_parallel: the residual stream between TP regions is sharded on the sequence dim (dim 1, as DTensor
            `Shard(1)`): outputs that leave a region (`rowwise*`, `embedding_*`) are reduce-scattered to it instead of
            all-reduced, and `sequence_parallel` norms run on it.
        role: `"head"` for the output projection under sequence parallelism (its input arrives sequence-sharded).

    Raises:
        ValueError: an unknown or unsupported style name (with the reason and the alternative).
    """
    if name in UNSUPPORTED_STYLES:
        raise ValueError(f"tensor-parallel style {name!r} is not supported: {UNSUPPORTED_STYLES[name]}")
    if name not in STYLES:
        raise ValueError(f"unknown tensor-parallel style {name!r}; known styles: {sorted(STYLES)}")
    if name == "module":
        raise ValueError(
            f"style 'module' is the module's own: call its `{MODULE_STYLE_METHOD}(sequence_parallel=...)`, not "
            "translate_style"
        )
    style = canonical_style(name)
    stream: Any = Shard(1) if sequence_parallel else Replicate()
    # Under sequence parallelism the stream stays a DTensor between regions (so HF code reading `.shape` sees the
    # global sequence length); without it every activation is a plain local tensor, as in transformers.
    # a region's colwise input arrives replicated; the output head's is the stream (sequence-sharded under SP)
    colwise_input = stream if role == "head" else Replicate()
    if style == "colwise":
        return ColwiseParallel(input_layouts=colwise_input)
    if style == "colwise_rep":
        return ColwiseParallel(input_layouts=colwise_input, output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel)
    if style in ("rowwise_rep", "embedding_rowwise"):  # an embedding's vocabulary shard sums like a rowwise output
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream, use_local_output=not sequence_parallel)
    if style == "local_rowwise":
        return _LocalRowwise()
    if style == "gather":
        return _SumOutput()
    if style == "packed_colwise":
        return _Packed(dim=0)
    if style == "packed_rowwise":
        return _Packed(dim=1, reduce_output=stream, keep_dtensor=sequence_parallel)
    if style == "embedding_colwise":
        return _EmbeddingColwise(output_layout=stream, keep_dtensor=sequence_parallel)
    if style == "sequence_parallel":
        return SequenceParallel(sequence_dim=1, use_local_output=False)
    if style == "replicated_with_grad_allreduce":
        return _ReplicatedGradAllReduce()
    if style == "sequence_gather" and sequence_parallel:
        return _SequenceGather()
    return _Replicate()


class _Replicate(ParallelStyle):
    """`replicate`: the module is left as it is (full parameters, local tensors in and out)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class _SequenceGather(ParallelStyle):
    """`sequence_gather` under sequence parallelism: the module (its parameters whole, plain tensors, the same on
    every tp rank) runs on the whole sequence. Its `Shard(1)` DTensor inputs (positional or keyword) are all-gathered
    to plain `[B, S, ...]` tensors, and its plain `[B, S, ...]` output leaves as this rank's `Shard(1)` slice (the
    backward all-gathers the slices' gradients). Every tp rank computes the same thing on the same tokens (as without
    sequence parallelism), so its parameters' gradients are identical on the tp ranks and need no reduction. Used
    where a module needs whole sequences or whole-batch statistics (an MoE's routing, load and per-sequence terms,
    all-to-alls over ep) or is a cheap projection outside any region (an MTP fusion)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        gathered: list[torch.Size] = []  # the [B, S] of this call's gathered inputs (outputs sliced back to match)

        def gather(t: Any) -> Any:
            if isinstance(t, DTensor) and t.device_mesh == device_mesh and t.placements == (Shard(1),):
                gathered.append(t.shape[:2])
                return t.redistribute(placements=[Replicate()]).to_local()
            return t

        def pre(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            gathered.clear()
            return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}

        def slice_back(t: torch.Tensor) -> torch.Tensor:
            # only `[B, S, ...]` activations like the gathered inputs (not router logits `[B*S, E]` or a mask)
            if isinstance(t, DTensor) or not t.is_floating_point() or t.dim() < 3 or t.shape[:2] not in gathered:
                return t
            full = DTensor.from_local(t, device_mesh, [Replicate()], run_check=False)
            return full.redistribute(placements=[Shard(1)])

        def post(_mod: nn.Module, _args: Any, output: Any) -> Any:
            return _map_tensors(output, slice_back)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post)
        return module


class _SumOutput(ParallelStyle):
    """`gather` / `all_reduce`: the module's output is each rank's partial sum; sum it over tp in the forward. The
    backward is the identity: the summed output is replicated, so its gradient already is the whole gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
            return _map_tensors(output, lambda t: _AllReduceForward.apply(t, group))

        module.register_forward_hook(hook)
        return module


class _LocalRowwise(ParallelStyle):
    """`local_rowwise`: rowwise sharding whose output stays this rank's partial sum (a plain tensor); the replicated
    bias enters the partial sums so that their sum (the `gather` parent's) counts it once (DTensor's `Partial`
    output of a linear). The incoming gradient is the replicated gradient of the summed output, hence
    `grad_placements=Replicate`."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"local_rowwise shards nn.Linear modules, not {type(module).__name__}")

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = Replicate() if pname == "bias" else Shard(1)
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def pre(_mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
            return (x, *inputs[1:])

        def post(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> torch.Tensor:
            assert isinstance(outputs, DTensor)
            return outputs.redistribute(placements=[Partial()]).to_local(grad_placements=[Replicate()])

        return distribute_module(module, device_mesh, partition, pre, post)  # type: ignore[arg-type]


class _Packed(ParallelStyle):
    """`packed_colwise` (dim 0) / `packed_rowwise` (dim 1) for an nn.Linear whose weight packs `parts` equal blocks
    along `dim` (gate_up: [gate; up]): each rank holds its slice of every block, so the model's own `chunk` on the
    local output (or input) keeps gate and up slices paired. The weight is a DTensor `_StridedShard`, which gathers
    back to the packed full tensor (`full_tensor()`, DCP), and the Linear's own forward runs on DTensors: DTensor
    propagates `_StridedShard` through the matmul (a colwise output keeps the strided layout; a rowwise output is a
    `Partial` sum, its replicated bias added once as in torch's `RowwiseParallel`)."""

    def __init__(self, *, dim: int, parts: int = 2, reduce_output: Any = None, keep_dtensor: bool = False) -> None:
        super().__init__()
        self.dim, self.parts, self.reduce_output, self.keep_dtensor = dim, parts, reduce_output, keep_dtensor

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor.placement_types import _StridedShard

        if not isinstance(module, nn.Linear):
            raise ValueError(f"packed styles shard nn.Linear modules, not {type(module).__name__}")
        dim, parts = self.dim, self.parts

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                if dim == 1 and pname == "bias":
                    placement: Any = Replicate()
                else:
                    placement = _StridedShard(dim=0 if pname == "bias" else dim, split_factor=parts)
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def pre(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = inputs[0]
            if dim == 0:  # the replicated input (its gradient, a Partial sum, is all-reduced by DTensor)
                if isinstance(x, DTensor):
                    x = x.redistribute(placements=[Replicate()])
                else:
                    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            elif not isinstance(x, DTensor):  # this rank's slice of every packed part of the input features
                x = DTensor.from_local(x, mesh, [_StridedShard(dim=x.dim() - 1, split_factor=parts)], run_check=False)
            return (x, *inputs[1:])

        def post(mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> Any:
            if dim == 0:
                return out.to_local()
            summed = out.redistribute(placements=[self.reduce_output or Replicate()])
            return summed if self.keep_dtensor else summed.to_local()

        return distribute_module(module, device_mesh, partition, pre, post)  # type: ignore[arg-type]


class _EmbeddingColwise(ParallelStyle):
    """`embedding_colwise`: weight Shard(1); each rank looks up its slice of every vector, then the slices are
    gathered (to the sequence-sharded stream under sequence parallelism)."""

    def __init__(self, *, output_layout: Any, keep_dtensor: bool) -> None:
        super().__init__()
        self.output_layout, self.keep_dtensor = output_layout, keep_dtensor

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(1)])))

        def pre(_mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x, *inputs[1:])

        def post(_mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> Any:
            out = out.redistribute(placements=[self.output_layout])
            return out if self.keep_dtensor else out.to_local()

        return distribute_module(module, device_mesh, partition, pre, post)  # type: ignore[arg-type]


class _ReplicatedGradAllReduce(ParallelStyle):
    """`replicated_with_grad_allreduce`: a norm inside a TP region that normalizes along an unsharded axis of sharded
    data (Qwen3's per-head q/k norms see only this rank's heads). Parameters become Replicate DTensors and the
    input is labelled as sharded on dim 0, so DTensor makes the parameter gradient the sum over ranks (Partial,
    which `apply_tensor_parallel` reduces to Replicate after accumulation)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(DTensor.from_local(param, mesh, [Replicate()])))

        def pre(_mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return (DTensor.from_local(inputs[0], mesh, [Shard(0)], run_check=False), *inputs[1:])

        def post(_mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local()

        return distribute_module(module, device_mesh, partition, pre, post)  # type: ignore[arg-type]


def enter_region(module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Make `module` (an attention or MLP whose projections are colwise) take its input once for all of them.

    Its first tensor argument (positional or keyword, in call order: the hidden states) becomes a `Replicate`
    DTensor: a plain replicated tensor is wrapped, a sequence-sharded `Shard(1)` DTensor (sequence parallelism) is
    all-gathered. Each projection's input gradient is then a `Partial` that accumulates on this one DTensor and is
    reduced once per region in the backward (one all-reduce, or one reduce-scatter under sequence parallelism),
    instead of once per projection.
    """

    def convert(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            if t.device_mesh == device_mesh and t.placements == (Shard(1),):
                return t.redistribute(placements=[Replicate()])
            return t
        return DTensor.from_local(t, device_mesh, [Replicate()], run_check=False)

    def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                return (*args[:i], convert(a), *args[i + 1 :]), kwargs
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return args, {**kwargs, key: convert(value)}
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


class ShardSequence(ParallelStyle):
    """Under sequence parallelism, the output of an unsharded input embedding enters the stream: keep this rank's
    sequence shard, as a `Shard(1)` DTensor (backward: the gradients of the shards are all-gathered)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_mod: nn.Module, _inputs: Any, output: torch.Tensor) -> DTensor:
            check_sequence_divisible(output, device_mesh.size())
            full = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return full.redistribute(placements=[Shard(1)])

        module.register_forward_hook(hook)
        return module


def check_sequence_divisible(hidden: torch.Tensor, tp: int) -> None:
    """Sequence parallelism needs equal sequence shards: refuse a sequence length that tp does not divide."""
    if hidden.dim() < 2 or hidden.shape[1] % tp:
        raise ValueError(
            f"sequence parallelism shards dim 1 of the hidden states {tuple(hidden.shape)} over tp={tp}: the "
            f"sequence length must be a multiple of {tp} (pad the batch to a multiple of tp)"
        )


def _map_tensors(output: Any, fn: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple):
        return type(output)(_map_tensors(o, fn) for o in output)
    return output


class _AllReduceForward(torch.autograd.Function):
    """Sum over the group in the forward; identity backward (the result is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    """Identity forward; sum the gradient over the group (a replicated input used by a sharded computation)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
