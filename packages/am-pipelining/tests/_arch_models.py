"""Tiny transformers causal LMs of many architectures, built from config (hidden 16, vocab 64, 2 layers, eager).

Each architecture's forward-level features are switched on with non-trivial values (Granite's multipliers, Cohere's
logit scale, Gemma's soft-capping, sliding windows shorter than the sequence, RoPE scaling), so a pipeline forward
that drops one gives another loss. `ARCHS` maps a case name to (model_type, config overrides, expected refusal):
the refusal is None when the pipeline must reproduce the model, else a phrase its error must contain. Dropout
probabilities are zero so the reference is deterministic.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 64
SEQ = 8

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_SLIDING = ["sliding_attention", "full_attention"]

ARCHS: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "llama": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, None),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "layer_types": _SLIDING}, None),
    "qwen3": ("qwen3", {}, None),
    "mistral-sliding": ("mistral", {"sliding_window": 4}, None),
    "phi3": ("phi3", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}, None),
    "granite": (
        "granite",
        {"embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3},
        None,
    ),
    "granitemoe": ("granitemoe", {"embedding_multiplier": 6.0, "logits_scaling": 4.0, "num_local_experts": 2}, None),
    "olmo2": ("olmo2", {}, None),
    "olmo3": ("olmo3", {"sliding_window": 4, "layer_types": _SLIDING}, None),
    "stablelm": ("stablelm", {"partial_rotary_factor": 0.5, "hidden_dropout": 0.0}, None),
    "gemma": ("gemma", {}, None),
    "gemma2": (
        "gemma2",
        {
            "final_logit_softcapping": 2.0,
            "attn_logit_softcapping": 5.0,
            "sliding_window": 4,
            "query_pre_attn_scalar": 8,
        },
        None,
    ),
    "gemma3-text": (
        "gemma3_text",
        {"final_logit_softcapping": 2.0, "sliding_window": 4, "layer_types": _SLIDING, "query_pre_attn_scalar": 8},
        None,
    ),
    "cohere": ("cohere", {"logit_scale": 0.25}, None),
    "cohere2": ("cohere2", {"logit_scale": 0.25, "sliding_window": 4, "layer_types": _SLIDING}, None),
    "starcoder2": ("starcoder2", {"residual_dropout": 0.0, "embedding_dropout": 0.0}, None),
    "qwen3-moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, None),
    # Refused, naming the feature:
    "phi": ("phi", {"resid_pdrop": 0.0, "embd_pdrop": 0.1}, "final_layernorm"),
    "gemma3-bidirectional": ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional attention"),
    "llama-unknown-logit-scale": ("llama", {"output_logits_scale": 3.0}, "config.output_logits_scale=3.0"),
}

BUFFER_ARCHS: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 16,
            }
        },
        None,
    ),
}
"""Extra architectures for the buffer tests only."""


def build_uninitialised(name: str) -> nn.Module:
    """The tiny causal LM of case `name` (or of `BUFFER_ARCHS`) as transformers builds it (any device context)."""
    import transformers

    model_type, overrides, _ = ARCHS[name] if name in ARCHS else BUFFER_ARCHS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**_BASE, **overrides})
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config)


def build(name: str, *, seed: int = 0) -> nn.Module:
    """The tiny causal LM of case `name`, fp32, train mode, random non-trivial weights (bit-identical per seed)."""
    torch.manual_seed(seed)
    model = build_uninitialised(name)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name or "layernorm" in param_name:
                param.uniform_(0.8, 1.2)  # non-trivial norms so their grads are informative
            else:
                param.normal_(0.0, 0.2)
    return model.float().train()


def batch(batch_size: int, *, seed: int = 100) -> dict[str, torch.Tensor]:
    """input_ids [B, S] and labels [B, S] (the next tokens)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, SEQ + 1), generator=generator)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
