"""Tiny models shared by the unit tests and the FSDP2 worker (a uniquely named module: tests are not a package)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

# 1 + 2**-12 (and its multiples) needs 13 mantissa bits: bf16 (8 bits) rounds it, fp32 holds it exactly.
UNROUNDABLE = 1.0 + 2.0**-12


def bf16_would_round(tensor: torch.Tensor) -> bool:
    return not torch.equal(tensor.to(torch.bfloat16).float(), tensor)


class Router(nn.Module):
    """MoE-router-like: a gate weight and an fp32 score-correction bias that must never be rounded."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden))
        self.register_buffer("e_score_correction_bias", UNROUNDABLE + 2.0**-12 * torch.arange(experts).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x.float() @ self.weight.float().T
        return scores + self.e_score_correction_bias


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class Block(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.router = Router(hidden, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(x))
        return x + h * self.router(h).softmax(-1).mean(-1, keepdim=True).to(h.dtype)


class ToyLM(nn.Module):
    """embed -> blocks -> final norm -> lm_head, with a RoPE buffer and an integer step buffer."""

    _keep_in_fp32_modules_strict: ClassVar[list[str] | tuple[str, ...] | set[str] | None] = [
        "router.e_score_correction_bias"
    ]
    _keep_in_fp32_modules: ClassVar[list[str] | tuple[str, ...] | set[str] | None] = ["norm"]

    def __init__(self, hidden: int = 8, vocab: int = 16, layers: int = 2, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, experts) for _ in range(layers))
        self.rotary_emb = RotaryEmbedding(hidden)
        self.final_norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("step", torch.tensor(7, dtype=torch.int64))
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn_like(param) * 0.5 + UNROUNDABLE)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.final_norm(h).to(self.lm_head.weight.dtype))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached clones of every parameter and buffer, by name."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {name: t.detach().clone() for name, t in tensors.items()}
