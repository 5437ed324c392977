"""Tiny models for the tests: HF architectures built from their configs (fp32, eager attention, 2 layers), and a
toy model whose attention reads its head count from an attribute and whose MLP uses the packed and local styles."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 48, 4, 2, 8
# Architectures whose transformers config declares a base_model_tp_plan: (config / model class prefix, extra config)
ARCHS: dict[str, dict[str, Any]] = {
    "Llama": {},
    "Qwen2": {},
    "Mistral": {},
    "Qwen3": {},  # per-head q/k norms: 'replicated_with_grad_allreduce'
    "Gemma": {},  # tied embeddings
    "Starcoder2": {},  # biases, LayerNorm, c_fc / c_proj
    # fused qkv / gate_up: 'colwise_gather_output' + 'rowwise_split_input'
    "Phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "Granite": {},
}


def hf_model(arch: str, *, seed: int = 0, **overrides: Any) -> nn.Module:
    import transformers

    config_cls = getattr(transformers, f"{arch}Config")
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "attn_implementation": "eager",
        **ARCHS.get(arch, {}),
        **overrides,
    }
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(config_cls(**kwargs)).float()
    # deterministic, non-trivial norm weights and biases (HF initializes them to 1 / 0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


class ToyAttention(nn.Module):
    """Reads `self.num_heads` in its reshape (no -1): TP must set the local head count."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HEAD_DIM
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.v_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class PackedMLP(nn.Module):
    """A fused [gate; up] projection split with `chunk` (packed_colwise), then a rowwise down projection."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTER)
        self.down_proj = nn.Linear(INTER, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.gate_up_proj(x)
        gate, up = packed.chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


class PackedMix(nn.Module):
    """A layer reading the packed activations [gate; up] as its input (packed_rowwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTER)
        self.mix = nn.Linear(2 * INTER, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(torch.tanh(self.gate_up_proj(x)))


class LocalMLP(nn.Module):
    """transformers 4.x local styles: local_colwise / local_rowwise children, summed by a 'gather' parent."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, INTER)
        self.down = nn.Linear(INTER, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Toy(nn.Module):
    """Every style HF models do not exercise here: head-count attributes, packed, local + gather, embedding_colwise."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.attn = ToyAttention()
        self.mlp = PackedMLP()
        self.mix = PackedMix()
        self.local = LocalMLP()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.attn(h)
        h = h + self.mlp(h)
        h = h + self.mix(h)
        h = h + self.local(h)
        return self.head(h)


TOY_PLAN = {
    "embed": "embedding_colwise",
    "attn.q_proj": "colwise",
    "attn.k_proj": "local_colwise",
    "attn.v_proj": "colwise",
    "attn.o_proj": "rowwise",
    "mlp.gate_up_proj": "packed_colwise",
    "mlp.down_proj": "rowwise",
    "mix.gate_up_proj": "packed_colwise",
    "mix.mix": "packed_rowwise",
    "local": "gather",
    "local.up": "local_colwise",
    "local.down": "local_rowwise",
    "head": "colwise_rep",
}


# A module that shards itself (plan style "module"): a packed projection [a | b] of unequal parts, split per segment
# (no DTensor placement describes it), and a down projection whose input columns are the same segments.
SEGMENTS = {"a": 6, "b": 4}


class SegmentedMix(nn.Module):
    """`down(cat(silu(a), b))` with `[a | b] = packed(x)`: x `[B, S, H]` -> `[B, S, H]`."""

    _tp_plan: ClassVar[dict[str, str]] = {"": "module"}  # "" = this module itself

    def __init__(self) -> None:
        super().__init__()
        self.segments = dict(SEGMENTS)
        self.packed = nn.Linear(HIDDEN, sum(SEGMENTS.values()))
        self.down = nn.Linear(sum(SEGMENTS.values()), HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.packed(x).split(list(self.segments.values()), dim=-1)
        return self.down(torch.cat([torch.nn.functional.silu(a), b], dim=-1))

    def tensor_parallel_problems(self, tp: int, *, sequence_parallel: bool = False) -> list[str]:
        from am_tensor_parallel import segment_sizes_problems

        problems = segment_sizes_problems(self.segments, tp, where="packed")
        return problems + (["no sequence parallelism here"] if sequence_parallel else [])

    def tensor_parallel_style(self, *, sequence_parallel: bool = False) -> Any:
        return _SegmentedStyle()


class _SegmentedStyle(ParallelStyle):
    """The toy's own layout, built from am-tensor-parallel's segment pieces."""

    def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        from am_tensor_parallel import SummedLinear, region_input, shard_segments

        mix: Any = module
        tp, rank = mesh.size(), mesh.get_local_rank()
        with torch.no_grad():
            for owner, name, dim in ((mix.packed, "weight", 0), (mix.packed, "bias", 0), (mix.down, "weight", 1)):
                local = shard_segments(getattr(owner, name), mix.segments, tp=tp, rank=rank, dim=dim)
                owner.register_parameter(name, nn.Parameter(local))
        mix.segments = {k: v // tp for k, v in mix.segments.items()}
        mix.register_forward_pre_hook(lambda _m, args: (region_input(args[0], mesh), *args[1:]))

        mix.down = SummedLinear.take(mix.down, mesh)  # the region's exit: partial products summed, bias once
        return mix


class SegmentedToy(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = SegmentedMix()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.mix(h))


class WholeSequence(nn.Module):
    """A module that needs whole sequences (a causal running mean over dim 1, as routing or per-sequence terms do)
    with a TP region inside: `mix(cummean(x)) + inner(gate)`; x, gate `[B, S, H]` (gate passed by keyword)."""

    _tp_plan: ClassVar[dict[str, str]] = {"": "sequence_gather", "inner.up": "colwise", "inner.down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(HIDDEN, HIDDEN)  # replicated: whole on every tp rank
        self.inner = nn.Sequential()
        self.inner.up, self.inner.down = nn.Linear(HIDDEN, INTER), nn.Linear(INTER, HIDDEN)

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device).view(1, -1, 1)
        inner = self.inner.down(torch.relu(self.inner.up(gate)))
        return self.mix(x.cumsum(dim=1) / steps) + inner


class GatherToy(nn.Module):
    """Embedding -> norm -> `WholeSequence` (residual) -> norm -> head: sequence parallelism around a
    `sequence_gather` module (the stream on shards, the module on whole sequences)."""

    _tp_plan: ClassVar[dict[str, str]] = {"lm_head": "colwise_rep"}

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm, self.final_norm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.whole = WholeSequence()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        normed = self.norm(h)
        h = h + self.whole(normed, gate=normed * 2)
        return self.lm_head(self.final_norm(h))
