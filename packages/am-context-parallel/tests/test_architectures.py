"""Every transformers architecture under CP=2: exact against the single process, or refused with a clear error.

Contract (issue 22 item 1): ring CP runs only where the package can show that every attention layer of the model
goes through the ring. Each architecture is built tiny from its config (seeded, the same on every rank), sharded
with `make_cp_batch_and_ctx(mesh, batch, model=model)` and run forward and backward inside the returned context on
one 2-rank gloo group (ONE launch for every case); each rank first runs the same model on the whole batch with
plain HF attention as the reference. A verdict is either "exact" (logits on the real tokens and the CP-summed
gradients equal the reference) or "refused" (a ValueError before anything ran, or a RuntimeError at the first
forward, naming the model class and the fix). A model that would be silently wrong (HF Falcon, whose attention calls
`F.scaled_dot_product_attention` itself) must be refused, both up front and, when the up-front check is bypassed,
by the ring-call count of its first forward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cp_dist import case_result, run_cases, run_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from am_context_parallel import (
    LoadBalancedLayout,
    RingAttentionContext,
    all_reduce_cp_gradients,
    cp_attention_problems,
    cp_token_mean_loss,
    current_ring_context,
    make_cp_batch_and_ctx,
)

transformers = pytest.importorskip("transformers")

# fp32: CP changes only the order of fp32 sums (ring merges through the log-sum-exp, gradients summed over ranks).
LOGIT_ATOL = 1e-4
GRAD_RTOL = 1e-4  # relative to the largest entry of each gradient
# absolute floor: a gradient that is 0 in exact arithmetic (a key bias: the softmax cancels it) carries only rounding
GRAD_ATOL = 1e-6
VOCAB, SEQ = 64, 13  # 13 tokens: CP=2 pads to 16, so padding and document ids are exercised too

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
# name -> (config class, model class, config overrides); every causal LM family transformers offers that builds tiny
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "sliding_window": 6}),  # soft-capping
    "Gemma2-nosoftcap": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 8, "sliding_window": 6, "attn_logit_softcapping": None, "final_logit_softcapping": None},
    ),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "sliding_window": 6}),
    "Phi": ("PhiConfig", "PhiForCausalLM", {}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "StableLm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "Olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "Granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "Cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "Starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "Qwen2Moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    ),
    "GPTNeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "GPT2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}),
    "OPT": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    "Falcon": ("FalconConfig", "FalconForCausalLM", {}),
    "Bloom": ("BloomConfig", "BloomForCausalLM", {"n_layer": 2, "n_head": 4}),
    "GPTJ": ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4}),
    "CodeGen": ("CodeGenConfig", "CodeGenForCausalLM", {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4}),
    "MPT": ("MptConfig", "MptForCausalLM", {"d_model": 32, "n_layers": 2, "n_heads": 4}),
    "XGLM": ("XGLMConfig", "XGLMForCausalLM", {"d_model": 32, "ffn_dim": 64, "num_layers": 2, "attention_heads": 4}),
}
# Must be refused: their attention never reaches transformers' registry (the issue's Falcon first), or soft-caps.
MUST_REFUSE = {"Falcon", "Bloom", "GPTJ", "CodeGen", "MPT", "XGLM", "Gemma2"}
# Must be exact: the registry-dispatching families named in the issue.
MUST_BE_EXACT = {"Llama", "Mistral", "Qwen2", "Gemma2-nosoftcap", "Gemma3", "Phi3", "GPTNeoX", "GPT2", "OPT"}


def _model(name: str) -> nn.Module:
    config_name, model_name, overrides = ARCHITECTURES[name]
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    kwargs = {**COMMON, **overrides}
    torch.manual_seed(1234)
    for implementation in ("sdpa", "eager"):  # sdpa where the family supports it (the trainer's choice), else eager
        config = config_class(**kwargs)
        config._attn_implementation = implementation
        try:
            model = model_class(config).float()
        except ValueError:
            continue
        return model.eval()  # dropout off: the verdict is about attention, not about random masks
    raise AssertionError(f"{name}: neither sdpa nor eager builds")


def _batch() -> dict[str, torch.Tensor]:
    """2 rows of 13 tokens, row 1 right-padded by 3; labels already shifted, -100 on padding and the last token."""
    gen = torch.Generator().manual_seed(7)
    input_ids = torch.randint(1, VOCAB, (2, SEQ), generator=gen)
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[1, 10:] = 0
    input_ids[1, 10:] = 0
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:]
    labels[attention_mask == 0] = -100
    labels[1, 9] = -100
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The single process: the whole batch with the model's own attention and masks, token-mean cross entropy."""
    batch = _batch()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100).backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _verdict(name: str, mesh: Any) -> dict[str, Any]:
    model = _model(name)
    expected_logits, expected_grads = _reference(model)
    group = mesh["cp"].get_group()
    try:
        ctx, batch = make_cp_batch_and_ctx(mesh, _batch(), model=model)
        with ctx():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss, _ = cp_token_mean_loss(logits, batch["labels"], group=group)
            loss.backward()
    except (ValueError, RuntimeError, NotImplementedError) as error:
        return {"verdict": "refused", "error": f"{type(error).__name__}: {error}"}
    all_reduce_cp_gradients(model, group=group)
    full = ctx.unshard(logits.detach(), seq_dim=1)
    real = _batch()["attention_mask"].bool()
    grads = _grads(model)
    # how far each gradient is from its tolerance, GRAD_ATOL + GRAD_RTOL x its largest entry (< 1: within it)
    errors = {
        n: ((grads[n] - g).abs().max() / (GRAD_ATOL + GRAD_RTOL * g.abs().max())).item()
        for n, g in expected_grads.items()
        if n in grads
    }
    worst = max(errors, key=errors.__getitem__)
    return {
        "verdict": "exact",
        "logit_err": (full[real] - expected_logits[real]).abs().max().item(),
        "grad_err": errors[worst],
        "worst_grad": worst,
        "missing_grads": sorted(set(expected_grads) - set(grads)),
    }


def _falcon_bypassing_the_upfront_check(mesh: Any) -> str:
    """A context built by hand (no sharder, so no up-front check, and no routing) around HF Falcon, which then runs
    its own SDPA with its own local mask: its first forward is counted and refused."""
    model = _model("Falcon")
    layout = LoadBalancedLayout(cp_size=2, cp_rank=dist.get_rank())
    ctx = RingAttentionContext(
        group=mesh["cp"].get_group(),
        layout=layout,
        positions=layout.local_indices(16),
        doc_ids=None,
        seq_len=16,
        padded_len=16,
        model=model,
    )
    ids = layout.shard(_batch()["input_ids"], seq_dim=1, pad_value=1)
    try:
        with torch.no_grad(), ctx():
            model(input_ids=ids, position_ids=ctx.positions.expand(2, -1))
    except RuntimeError as error:
        return str(error)
    return "no error"


class _SelfAttendingBlock(nn.Module):
    """A block outside transformers: causal attention through the ring (`ring=True`, inside a CP context) or through
    its own `F.scaled_dot_product_attention` call (nothing the package could route)."""

    def __init__(self, *, ring: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.ring = ring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        ctx = current_ring_context()
        if self.ring and ctx is not None:
            out = ctx.attention(q, k, v, causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + out.transpose(1, 2).reshape(x.shape)


class _CustomModel(nn.Module):
    def __init__(self, rings: list[bool]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList(_SelfAttendingBlock(ring=ring) for ring in rings)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        del position_ids  # no position embedding: attention alone orders the tokens
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _custom_model(mesh: Any, rings: list[bool]) -> dict[str, Any]:
    """A non-transformers model: blocks that call the ring pass; one block that attends by itself is refused."""
    model = _CustomModel(rings)
    batch = {"input_ids": _batch()["input_ids"][:1, :12], "labels": _batch()["labels"][:1, :12]}
    expected = model(batch["input_ids"]).detach()
    ctx, batch = make_cp_batch_and_ctx(mesh, batch, model=model)
    try:
        with torch.no_grad(), ctx():
            local = model(batch["input_ids"])
    except RuntimeError as error:
        return {"error": str(error)}
    return {"err": (ctx.unshard(local, seq_dim=1) - expected).abs().max().item()}


def _blocks_without_the_model_forward(mesh: Any) -> str:
    """A caller that runs the blocks itself (not `model(...)`): the count is checked when the context closes."""
    model = _CustomModel([True, False])
    batch = {"input_ids": _batch()["input_ids"][:1, :12], "labels": _batch()["labels"][:1, :12]}
    ctx, batch = make_cp_batch_and_ctx(mesh, batch, model=model)
    try:
        with torch.no_grad(), ctx():
            x = model.embed(batch["input_ids"])
            for layer in model.layers:
                x = layer(x)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    del rank
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    cases: dict[str, Any] = {name: (lambda name=name: _verdict(name, mesh)) for name in ARCHITECTURES}
    cases["falcon_bypassed"] = lambda: _falcon_bypassing_the_upfront_check(mesh)
    cases["custom_ring"] = lambda: _custom_model(mesh, [True, True])
    cases["custom_one_local_block"] = lambda: _custom_model(mesh, [True, False])
    cases["blocks_without_the_model_forward"] = lambda: _blocks_without_the_model_forward(mesh)
    cases["barrier"] = lambda: dist.barrier()
    return run_cases(cases)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(2, _worker, timeout=400.0)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_is_exact_or_refused(results: list[dict[str, Any]], name: str) -> None:
    """Verdict per architecture: exact against the single process, or refused naming the model and the fix."""
    for rank in range(2):
        out = case_result(results, name, rank)
        model_class = ARCHITECTURES[name][1]
        if out["verdict"] == "refused":
            assert name not in MUST_BE_EXACT, f"{name} was refused: {out['error']}"
            assert model_class in out["error"], out["error"]
            assert "cp=1" in out["error"], out["error"]  # the fix is named
        else:
            assert name not in MUST_REFUSE, f"{name} ran under CP but must be refused"
            assert out["logit_err"] < LOGIT_ATOL, f"{name}: logits off by {out['logit_err']}"
            assert out["grad_err"] < 1.0, f"{name}: {out['worst_grad']} gradient {out['grad_err']} x its tolerance"
            assert out["missing_grads"] == []


def test_falcon_is_refused_up_front_without_a_process_group() -> None:
    """The issue's case: HF Falcon calls SDPA itself; the refusal needs no collective and names what to do."""
    (problem,) = cp_attention_problems(_model("Falcon"))
    for needle in ("FalconForCausalLM", "ALL_ATTENTION_FUNCTIONS", "cp=1"):
        assert needle in problem, problem


def test_a_bypassed_up_front_check_is_caught_by_the_ring_call_count(results: list[dict[str, Any]]) -> None:
    for rank in range(2):
        message = case_result(results, "falcon_bypassed", rank)
        assert "FalconForCausalLM" in message, message
        assert "0 of the 2 blocks of 'transformer.h' called ring attention" in message, message
        assert "ring calls per block [0, 0]" in message, message


def test_a_model_outside_transformers_is_checked_by_its_ring_calls(results: list[dict[str, Any]]) -> None:
    for rank in range(2):
        assert case_result(results, "custom_ring", rank)["err"] < LOGIT_ATOL
        message = case_result(results, "custom_one_local_block", rank)["error"]
        assert "_CustomModel" in message, message
        assert "1 of the 2 blocks of 'layers'" in message, message
        assert "blocks [1] made none" in message, message


def test_blocks_run_without_the_model_forward_are_checked_when_the_context_closes(
    results: list[dict[str, Any]],
) -> None:
    for rank in range(2):
        message = case_result(results, "blocks_without_the_model_forward", rank)
        assert "blocks [1] made none" in message, message
