"""Tiny random HF models and batches for the tests (hidden 16-32, vocab 64, 2-8 layers, seq 8).

Each factory seeds torch itself, so every rank builds bit-identical weights. Models use eager attention: it runs
the same code for every batch size, which keeps microbatch-vs-full-batch differences at fp32 rounding level.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from am_model_contract import ModelContract, PipelineContract, contract_of

VOCAB = 64
SEQ = 8
IMAGE_TOKEN = 60


def _finish(model: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                param.uniform_(0.8, 1.2)  # non-trivial norms so their grads are informative
            else:
                param.normal_(0.0, 0.2)
    return model.float().train()


def llama(layers: int = 4, *, tied: bool = False, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return _finish(LlamaForCausalLM(config), seed)


def qwen3(layers: int = 4, *, seed: int = 1) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return _finish(Qwen3ForCausalLM(config), seed)


def mistral(layers: int = 4, *, seed: int = 2) -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=4,  # shorter than SEQ, so the sliding mask really differs from the causal one
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return _finish(MistralForCausalLM(config), seed)


def _gemma4_text_config(layers: int, *, tied: bool, moe: bool = False) -> Any:
    from transformers import Gemma4TextConfig

    types = ["sliding_attention" if (i % 2 == 0) else "full_attention" for i in range(layers)]
    types[-1] = "full_attention"
    moe_kwargs: dict[str, Any] = (
        dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16) if moe else {}
    )
    return Gemma4TextConfig(
        **moe_kwargs,
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        global_head_dim=16,
        max_position_embeddings=64,
        sliding_window=4,
        layer_types=types,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )


def gemma4_text(layers: int = 4, *, tied: bool = True, seed: int = 3, moe: bool = False) -> nn.Module:
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    return _finish(Gemma4ForCausalLM(_gemma4_text_config(layers, tied=tied, moe=moe)), seed)


def gemma4_vlm(layers: int = 4, *, seed: int = 4, moe: bool = False) -> nn.Module:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        pooling_kernel_size=2,
        patch_size=2,
        position_embedding_size=16,
        attn_implementation="eager",
    )
    config = Gemma4Config(
        text_config=_gemma4_text_config(layers, tied=True, moe=moe),
        vision_config=vision,
        audio_config=None,
        image_token_id=IMAGE_TOKEN,
        video_token_id=61,
        audio_token_id=62,
        boi_token_id=58,
        eoi_token_id=59,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _finish(Gemma4ForConditionalGeneration(config), seed)


def mistral3_vlm(layers: int = 4, *, seed: int = 5) -> nn.Module:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=None,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    vision = PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=8,
        patch_size=2,
        num_channels=3,
        attn_implementation="eager",
    )
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        spatial_merge_size=2,
        vision_feature_layer=-1,
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _finish(Mistral3ForConditionalGeneration(config), seed)


FACTORIES = {
    "llama": llama,
    "llama_tied": lambda layers=4: llama(layers, tied=True),
    "qwen3": qwen3,
    "mistral": mistral,
    "gemma4": gemma4_text,
    "gemma4_vlm": gemma4_vlm,
    "mistral3_vlm": mistral3_vlm,
}


def batch(name: str, batch_size: int, *, seed: int = 100) -> dict[str, torch.Tensor]:
    """input_ids [B, S], labels [B, S] (next tokens) and, for VLMs, one image per sample."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 56, (batch_size, SEQ + 1), generator=generator)
    out: dict[str, torch.Tensor] = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    if name == "gemma4_vlm":
        # 4x4 patches of 2x2 pixels, pooled 2x2 -> 4 soft tokens per image.
        out["input_ids"][:, 1:5] = IMAGE_TOKEN
        out["pixel_values"] = torch.rand(batch_size, 16, 12, generator=generator)
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), dim=-1).reshape(16, 2)
        out["image_position_ids"] = grid.unsqueeze(0).repeat(batch_size, 1, 1)
    if name == "mistral3_vlm":
        # 8x8 image, 2x2 patches -> 4x4 patches, merged 2x2 -> 4 image tokens.
        out["input_ids"][:, 1:5] = IMAGE_TOKEN
        out["pixel_values"] = torch.rand(batch_size, 3, 8, 8, generator=generator)
        out["image_sizes"] = torch.tensor([[8, 8]] * batch_size)
    out["labels"] = torch.where(out["input_ids"] == IMAGE_TOKEN, -100, out["labels"])
    return out


def media_kwargs(name: str, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in data.items() if k in ("pixel_values", "image_position_ids", "image_sizes")}


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def reference_forward(model: nn.Module, name: str, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF's own forward (unpatched) -> logits [B, S, V]."""
    return model(input_ids=data["input_ids"], **media_kwargs(name, data)).logits


# ----------------------------------------------------------------------------------------------------------------
# A non-HF model that declares every pipelining hook (proves they are honoured by duck typing), with one MTP depth.
# ----------------------------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class _Config:
    hidden_size = 16
    vocab_size = VOCAB


class _Inner(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(_Block(16) for _ in range(layers))
        self.norm = nn.LayerNorm(16)


class HookedMTPModel(nn.Module):
    """Keeps its own forward (`_pp_keep_self_forward`), adds `mtp` to the last stage through
    `customize_pipeline_stage_modules`, declares tuple outputs through `get_pipeline_stage_metas`, and takes an
    mRoPE-like kwarg `pos` [3, B, S] that must be chunked on dim 1 (`get_pipeline_kwargs_chunk_dims`)."""

    _pp_keep_self_forward = True

    def __init__(self, layers: int = 4, seed: int = 7) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = _Config()
        self.model = _Inner(layers)
        self.lm_head = nn.Linear(16, VOCAB, bias=False)
        self.mtp = _Block(16)
        self.hook_calls: list[str] = []

    def customize_pipeline_stage_modules(
        self, names: list[list[str]], *, layers_prefix: str, text_model: nn.Module
    ) -> list[list[str]]:
        self.hook_calls.append(f"customize:{layers_prefix}:{type(text_model).__name__}")
        return [*names[:-1], [*names[-1], "mtp"]]

    def get_pipeline_stage_metas(
        self, *, is_first: bool, microbatch_size: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        meta = torch.device("meta")
        hidden = torch.empty(microbatch_size, seq_len, 16, dtype=dtype, device=meta, requires_grad=True)
        inputs = (torch.empty(microbatch_size, seq_len, dtype=torch.long, device=meta),) if is_first else (hidden,)
        if self.lm_head is not None:
            logits = torch.empty(microbatch_size, seq_len, VOCAB, dtype=dtype, device=meta, requires_grad=True)
            return inputs, (logits, hidden)
        return inputs, (hidden,)

    def get_pipeline_kwargs_chunk_dims(self, kwargs: dict[str, Any]) -> dict[str, int]:
        return {"pos": 1} if "pos" in kwargs else {}

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> Any:
        inner = self.model
        if inner.embed_tokens is not None:
            h = inner.embed_tokens(x)
            if pos is not None:
                h = h + 0.01 * pos.float().sum(0).unsqueeze(-1)
        else:
            h = x
        layers = inner.layers.values() if isinstance(inner.layers, nn.ModuleDict) else inner.layers
        for layer in layers:
            h = layer(h)
        if inner.norm is None:
            return h
        h = inner.norm(h)
        logits = self.lm_head(h)
        return (logits, self.mtp(h)) if self.training else logits


class DeclaredMTPModel(HookedMTPModel):
    """`HookedMTPModel` whose last stage also returns packed-sequence ids (int64: nothing keys on the dtype) and
    declares its tuple in its contract (`pp.output_names`), as Nemotron does. Two packed sequences per row (halves)."""

    def am_contract(self) -> ModelContract:
        return ModelContract(
            pp=PipelineContract(keeps_own_forward=True, output_names=("logits", "mtp_per_depth_h", "seq_idx"))
        )

    def get_pipeline_stage_metas(
        self, *, is_first: bool, microbatch_size: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        inputs, outputs = super().get_pipeline_stage_metas(
            is_first=is_first, microbatch_size=microbatch_size, seq_len=seq_len, dtype=dtype
        )
        if self.lm_head is None:
            return inputs, outputs
        return inputs, (*outputs, torch.empty(microbatch_size, seq_len, dtype=torch.long, device="meta"))

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> Any:
        out = super().forward(x, pos)
        if not isinstance(out, tuple):
            return out
        batch, seq = out[0].shape[:2]
        seq_idx = (torch.arange(seq) >= seq // 2).long().expand(batch, seq)
        return (*out, seq_idx)


def declare_output_names(model: Any, names: tuple[str, ...]) -> Any:
    """Give one model instance a contract whose last-stage output names are `names` (the rest of its contract kept)."""
    contract = contract_of(model)
    declared = dataclasses.replace(contract, pp=dataclasses.replace(contract.pp, output_names=names))
    model.am_contract = lambda: declared
    return model
