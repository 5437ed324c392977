"""Shared tiny configs and helpers for the am-models-nemotron tests.

A uniquely named module (not conftest) so suites of several packages can run in one pytest session. Models are tiny
(hidden 32, <= 6 layers, vocab 96, chunk 8) so the suite runs in well under two minutes on 2 CPU cores.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import NemotronHConfig
from transformers import NemotronHForCausalLM as HFNemotronH

VOCAB = 96


def tiny_hf_config(pattern: str, *, mtp_depths: int = 0, mtp_pattern: str = "*E", **overrides: Any) -> NemotronHConfig:
    """A tiny transformers NemotronHConfig from a pattern string (M mamba, * attention, - mlp, E moe)."""
    values: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "hybrid_override_pattern": pattern,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "ssm_state_size": 8,
        "n_groups": 2,
        "chunk_size": 8,
        "conv_kernel": 4,
        "n_routed_experts": 6,
        "num_experts_per_tok": 2,
        "n_group": 3,
        "topk_group": 2,
        "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 24,
        "routed_scaling_factor": 1.5,
        "num_nextn_predict_layers": mtp_depths,
        "mtp_hybrid_override_pattern": mtp_pattern,
        # transformers 5.23 clamps dt at time_step_min from below whatever time_step_limit says; spell the same
        # limit in the config so both implementations clamp identically.
        "time_step_limit": (0.001, math.inf),
        "pad_token_id": 0,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    values.update(overrides)
    return NemotronHConfig(**values)


@torch.no_grad()
def randomize_(model: torch.nn.Module, *, seed: int = 0) -> torch.nn.Module:
    """Give every weight a scale that makes each block matter to the logits (HF's init leaves Mamba layers nearly
    silent, which would make a parity test blind to them). dt_bias is kept away from transformers' dt clamp."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("dt_bias"):
            param.copy_(torch.empty(param.shape).uniform_(-3.0, 0.0, generator=gen))
        elif name.endswith("A_log"):
            param.copy_(torch.empty(param.shape).uniform_(-1.0, 1.5, generator=gen))
        elif name.endswith(".D") or param.dim() == 1:
            param.copy_(torch.empty(param.shape).uniform_(0.5, 1.5, generator=gen))
        else:
            fan_in = param.shape[-1]
            param.copy_(torch.randn(param.shape, generator=gen) * (1.2 / math.sqrt(fan_in)))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    return model


def hf_model(config: NemotronHConfig, *, seed: int = 0) -> HFNemotronH:
    torch.manual_seed(seed)
    return randomize_(HFNemotronH(config), seed=seed).eval()


def save_hf(model: HFNemotronH, folder: Path) -> Path:
    model.save_pretrained(str(folder))
    return folder


def tokens(batch: int, seqlen: int, *, seed: int = 0, low: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (batch, seqlen), generator=gen)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, what: str = "") -> None:
    """max |a - e| <= rtol * max |e| (relative to the tensor's scale: per-element relative error is meaningless for
    values that cross zero)."""
    scale = expected.abs().max().clamp(min=1e-12)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{what}: max abs err {err.item():.3e} > {rtol} x scale {scale.item():.3e}"
