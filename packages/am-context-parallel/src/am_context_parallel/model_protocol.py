"""What a model declares to get the contiguous ring path, read from its contract (am-model-contract).

What it is for: a model that runs its own CP attention on contiguous shards (Gemma 4; Nemotron-H, whose Mamba2
recurrence passes state from rank to rank) declares it in its contract — data, never a function put into a batch:

    class MyModel(nn.Module):
        def am_contract(self) -> ModelContract:
            return ModelContract(cp=ContextParallelContract(
                layout="contiguous",                    # required: selects the contiguous ring path
                options=self.get_cp_options,            # optional: () -> ContiguousCPOptions, what differs
                problems=self.cp_problems,              # optional: what it cannot honour under CP (any layout)
            ))

        def get_cp_options(self) -> ContiguousCPOptions:
            return ContiguousCPOptions(kernel=my_kernel_for_device, extra_seq_keys={"mtp_labels": (1, -100)})

        def cp_problems(self, *, seq_len: int, local_seq_len: int, cp_size: int) -> list[str]:
            return ["S_local=2 tokens per rank is shorter than the conv halo (3); ..."]  # [] when it can run

`model_cp_problems(model, seq_len=, cp_size=)` is the one caller of `problems`: a trainer runs it in its up-front
validation, with every other check, so the problems are listed at once; the model keeps its forward-time check as the
last line of defence (it must use the same rule).

`make_cp_batch_and_ctx(mesh, batch, *, model=model)` reads the options through `model_cp_options(model)` and calls the
generic contiguous sharder (`batch.contiguous_shard`), which returns the `RingAttentionContext`
itself (layout, global positions, document ids, lengths). The model's layers then read the entered context
(`current_ring_context()`: `ctx.attention(q, k, v, causal=, sliding_window=, scale=)`, `ctx.group`,
`ctx.layout.cp_rank`, `ctx.doc_ids`, `ctx.positions`); per-layer facts such as sliding windows are passed at call time.
What it must not do: import a model package, read a model's attributes other than through `contract_of`, or shard
anything (batch.py does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from am_model_contract import CP_LAYOUTS, contract_of

from .kernels import AttentionKernel

__all__ = ["CP_LAYOUTS", "ContiguousCPOptions", "cp_local_seq_len", "model_cp_options", "model_cp_problems"]

_PRIMARY_KEYS = ("input_ids", "inputs_embeds")


@dataclass(frozen=True)
class ContiguousCPOptions:
    """What a model's contiguous CP path needs beyond the defaults (returned by `model.get_cp_options()`).

    Args:
        kernel: the ring's per-chunk kernel: an `AttentionKernel`, or a function of the batch's device returning
            one (e.g. a block-sparse kernel on the CPU). None: `select_kernel(q.device)` at the first attention call.
        route_hf_attention: route transformers' `sdpa`/`eager` attention to the ring while the context is entered.
            False by default: a model that owns its CP attention calls the context itself, and modules it does
            not shard (a vision tower on whole images) keep their own attention.
        extra_seq_keys: model batch keys to pad and shard with the sequence, `{key: (seq_dim, pad_value)}` (batch
            dim 0). They join the upstream keys the contiguous shard always handles (input_ids, inputs_embeds,
            labels, position_ids, padding_mask, `_packed_seq_ids`, mm_token_type_ids, per_layer_inputs, loss_mask).
        pad_multiple: sequences are padded to a multiple of `pad_multiple · C` (2 · C by default, as upstream).
        primary_keys: which of input_ids / inputs_embeds the model accepts under CP (a model that embeds its own
            shard — per-layer inputs, image positions — needs the token ids).

    Raises:
        ValueError: listing every invalid field.
    """

    kernel: AttentionKernel | Callable[[torch.device], AttentionKernel] | None = None
    route_hf_attention: bool = False
    extra_seq_keys: Mapping[str, tuple[int, Any]] = field(default_factory=dict)
    pad_multiple: int = 2
    primary_keys: tuple[str, ...] = _PRIMARY_KEYS

    def __post_init__(self) -> None:
        problems = []
        if self.kernel is not None and not callable(self.kernel) and not isinstance(self.kernel, AttentionKernel):
            problems.append(f"kernel must be an AttentionKernel or a function of the device; got {self.kernel!r}")
        if not isinstance(self.route_hf_attention, bool):
            problems.append(f"route_hf_attention must be a bool; got {self.route_hf_attention!r}")
        if isinstance(self.pad_multiple, bool) or not isinstance(self.pad_multiple, int) or self.pad_multiple < 1:
            problems.append(f"pad_multiple must be an int >= 1; got {self.pad_multiple!r}")
        if not self.primary_keys or any(key not in _PRIMARY_KEYS for key in self.primary_keys):
            problems.append(
                f"primary_keys must be a non-empty subset of {list(_PRIMARY_KEYS)}; got {self.primary_keys!r}"
            )
        for key, spec in dict(self.extra_seq_keys).items():
            if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], int) and spec[0] >= 1):
                problems.append(
                    f"extra_seq_keys[{key!r}] must be (seq_dim >= 1, pad_value) with the batch on dim 0; got {spec!r}"
                )
        if problems:
            raise ValueError("invalid ContiguousCPOptions:\n  - " + "\n  - ".join(problems))

    def kernel_for(self, device: torch.device) -> AttentionKernel | None:
        """The per-chunk kernel for tensors on `device` (None: the ring selects one at its first call)."""
        if self.kernel is None or isinstance(self.kernel, AttentionKernel):
            return self.kernel
        kernel = self.kernel(device)
        if not isinstance(kernel, AttentionKernel):
            raise TypeError(f"ContiguousCPOptions.kernel({device}) returned {kernel!r}, not an AttentionKernel")
        return kernel


def model_cp_options(model: Any) -> ContiguousCPOptions | None:
    """The contiguous-CP options `model` declares, or None when it takes the default load-balanced path.

    Reads `contract_of(model).cp`: `layout` (one of `CP_LAYOUTS`; a model that declares nothing is "load_balanced")
    and, for "contiguous", `options()` (absent means `ContiguousCPOptions()`).

    Raises:
        TypeError: when `options()` returns something else than a `ContiguousCPOptions`.
    """
    cp = contract_of(model).cp
    if cp.layout != "contiguous":
        return None
    options = cp.options() if cp.options is not None else ContiguousCPOptions()
    if not isinstance(options, ContiguousCPOptions):
        raise TypeError(
            f"{type(model).__name__}'s contract cp.options() must return a ContiguousCPOptions; "
            f"got {type(options).__name__}"
        )
    return options


def cp_local_seq_len(model: Any, *, seq_len: int, cp_size: int) -> int:
    """Tokens per rank and sequence once `make_cp_batch_and_ctx` has padded `seq_len` tokens to a multiple of
    `pad_multiple · cp_size` (the model's contiguous options, else 2 as the load-balanced layout) and sharded them:
    the same on every rank. `seq_len` itself for `cp_size <= 1`."""
    if cp_size <= 1:
        return seq_len
    options = model_cp_options(model)
    unit = (options.pad_multiple if options is not None else 2) * cp_size
    return -(-seq_len // unit) * unit // cp_size


def model_cp_problems(model: Any, *, seq_len: int, cp_size: int) -> list[str]:
    """Everything `model` declares it cannot honour under context parallelism for sequences of `seq_len` tokens (before
    padding) over `cp_size` ranks: its contract's `cp.problems(*, seq_len, local_seq_len, cp_size)` (None means
    nothing), called with `local_seq_len = cp_local_seq_len(...)`. Pure: no collective, no batch, so a
    trainer lists these with its other up-front checks. Empty for `cp_size <= 1`.

    Raises:
        TypeError: when the hook returns something else than a list of strings.
    """
    hook = contract_of(model).cp.problems
    if cp_size <= 1 or hook is None:
        return []
    local = cp_local_seq_len(model, seq_len=seq_len, cp_size=cp_size)
    problems = hook(seq_len=seq_len, local_seq_len=local, cp_size=cp_size)
    if not isinstance(problems, list) or not all(isinstance(problem, str) for problem in problems):
        raise TypeError(
            f"{type(model).__name__}'s contract cp.problems(...) must return a list of strings (one per problem); "
            f"got {problems!r}"
        )
    return problems
