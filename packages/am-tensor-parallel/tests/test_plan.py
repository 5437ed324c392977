"""Plans and validation without a process group: declared plans read as transformers reads them, patterns matched,
and every problem listed in one error before any collective."""

from __future__ import annotations

import pytest
import torch
from _tp_models import TOY_PLAN, SegmentedToy, Toy, hf_model
from torch import nn

from am_tensor_parallel import (
    STYLES,
    UNSUPPORTED_STYLES,
    declared_plan,
    experts_whole,
    layer_pattern,
    match_plan,
    plan_tensor_parallel,
    shard_segments,
    tp_problems,
    translate_style,
)


@pytest.mark.parametrize("arch", ["Llama", "Qwen2", "Mistral", "Qwen3", "Gemma", "Starcoder2", "Phi3", "Granite"])
def test_declared_plan_is_transformers_plan(arch: str) -> None:
    """The class `_tp_plan`, the base model's `config.base_model_tp_plan` under `model.` and `embed_tokens` made
    vocabulary-parallel: exactly what transformers merges (`model.tp_plan`)."""
    model = hf_model(arch)
    plan = declared_plan(model)
    assert plan == dict(model.tp_plan)
    assert plan is not None
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.embed_tokens"] == "embedding_rowwise"
    assert tp_problems(model, 2) == []


def test_experts_whole_drops_expert_tp_and_runs_the_moe_block_whole() -> None:
    """Mixtral's declared plan cuts each expert's matrices over tp (`moe_tp_experts`, parameter patterns, refused
    here); `experts_whole` drops them and makes the block holding the experts `sequence_gather`, which validates."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    declared = declared_plan(model)
    assert declared is not None
    assert declared["model.layers.*.mlp.experts"] == "moe_tp_experts"
    assert any("moe_tp_experts" in p for p in tp_problems(model, 2))
    whole = experts_whole(declared)
    assert not any(".experts" in key for key in whole), whole
    assert whole["model.layers.*.mlp"] == "sequence_gather"
    assert {k: v for k, v in whole.items() if k != "model.layers.*.mlp"} == {
        k: v for k, v in declared.items() if ".experts" not in k
    }
    assert tp_problems(model, 2, whole, sequence_parallel=True, loss_parallel=True) == []
    assert experts_whole(TOY_PLAN) == TOY_PLAN  # no expert TP: unchanged


def test_layer_pattern_and_matching() -> None:
    assert layer_pattern("model.layers.11.mlp.w1") == "model.layers.*.mlp.w1"
    model = hf_model("Llama")
    styles, unmatched = match_plan(
        model,
        {
            "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.1.mlp": "gather",
            "model.layers.*.mlp.experts": "colwise",
        },
    )
    assert styles == {
        "model.layers.0.mlp.up_proj": "colwise",
        "model.layers.1.mlp": "gather",
        "model.layers.1.mlp.up_proj": "colwise",
    }
    assert unmatched == ["model.layers.*.mlp.experts"]


def test_every_problem_in_one_error() -> None:
    """Heads, KV heads, intermediate size and vocabulary that tp=3 does not divide, an unknown and an unsupported
    style, a pattern matching nothing: all named at once."""
    model = hf_model("Llama", num_attention_heads=4, num_key_value_heads=2, intermediate_size=50)
    plan = {
        **declared_plan(model),
        "model.layers.*.mlp.act_fn": "no_such_style",  # type: ignore[dict-item]
        "model.layers.*.mlp.experts": "moe_tp_experts",
        "model.layers.*.block_sparse_moe": "colwise",
    }
    with pytest.raises(ValueError, match=r"cannot apply tensor parallelism \(tp=3\) to LlamaForCausalLM") as info:
        plan_tensor_parallel(model, tp=3, plan=plan)
    message = str(info.value)
    assert "4 attention heads cannot be split over tp=3" in message
    assert "2 key/value heads cannot be split over tp=3" in message
    assert "replicating KV heads is not supported" in message
    assert "model.layers.0.mlp.up_proj: 'colwise' splits its 50 output features over tp=3" in message
    assert "model.embed_tokens: 'embedding_rowwise' splits its 64 vocabulary entries over tp=3" in message
    assert "lm_head: 'colwise_gather_output' splits its 64 output features" in message
    assert "unknown style 'no_such_style'" in message
    assert "'moe_tp_experts' is not supported: experts are sharded by expert parallelism" in message
    assert "'model.layers.*.block_sparse_moe' ('colwise') matches no module" in message
    assert tp_problems(model, 2) == []  # 50 = 2 x 25


def test_model_without_a_plan() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    problems = tp_problems(model, 2)
    assert len(problems) == 1
    assert "Sequential declares no tensor-parallel plan" in problems[0]
    assert "pass plan=" in problems[0]
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        plan_tensor_parallel(model, tp=2)
    assert "tp must be a positive int" in tp_problems(model, 0)[0]


def test_tied_embeddings_need_the_same_sharding() -> None:
    model = hf_model("Gemma")
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    plan = {**declared_plan(model), "model.embed_tokens": "replicate"}  # type: ignore[dict-item]
    problems = tp_problems(model, 2, plan)
    assert any("share one weight (tied embeddings)" in p for p in problems), problems
    assert plan_tensor_parallel(model, tp=2).tied == ("model.embed_tokens", "lm_head")


def test_module_kinds_and_fused_qkv() -> None:
    model = hf_model("Phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    problems = tp_problems(
        model,
        2,
        {"model.layers.*.self_attn.qkv_proj": "colwise", "model.norm": "rowwise", "lm_head": "embedding_rowwise"},
    )
    assert any("fused q/k/v projection sharded 'colwise'" in p for p in problems), problems
    assert any("model.norm: style 'rowwise' shards nn.Linear modules" in p for p in problems), problems
    assert any("lm_head: style 'embedding_rowwise' shards nn.Embedding modules" in p for p in problems), problems
    problems = tp_problems(model, 2, {**declared_plan(model), "model.norm": "sequence_parallel"})  # type: ignore[dict-item]
    assert problems == [
        "model.norm: style 'sequence_parallel' needs sequence_parallel=True (its output is a sequence shard)"
    ]


def test_sequence_and_loss_parallel_options() -> None:
    model = hf_model("Qwen3")
    plan = plan_tensor_parallel(model, tp=2, sequence_parallel=True, loss_parallel=True)
    assert plan.styles["lm_head"] == "colwise"  # the head keeps its vocabulary shard
    assert "model.layers.0.post_attention_layernorm" in plan.norms
    assert "model.layers.0.self_attn.q_norm" not in plan.norms  # inside the attention region: per-head norm style
    assert plan.styles["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert plan.region_inputs[:2] == ("model.layers.0.mlp", "model.layers.0.self_attn")
    problems = tp_problems(Toy(), 2, TOY_PLAN, sequence_parallel=True, loss_parallel=True)
    assert any("'gather' sums a replicated output" in p for p in problems), problems
    # the toy model has no get_output_embeddings(): neither option can find its head
    assert any(
        "needs an output head sharded by vocabulary ('colwise' or 'colwise_gather_output' on "
        "get_output_embeddings())" in p
        for p in problems
    ), problems
    assert any("sequence_parallel=True needs an output head in the plan" in p for p in problems), problems


def test_style_tables() -> None:
    assert {
        "colwise",
        "rowwise",
        "colwise_rep",
        "rowwise_rep",
        "local_colwise",
        "local_rowwise",
        "sequence_parallel",
        "replicate",
        "packed_colwise",
        "packed_rowwise",
        "colwise_gather_output",
        "rowwise_split_input",
        "embedding_rowwise",
        "replicated_with_grad_allreduce",
    } <= set(STYLES)
    assert not set(STYLES) & set(UNSUPPORTED_STYLES)


def test_meta_device_models_validate() -> None:
    with torch.device("meta"):
        model = hf_model("Llama")
    assert tp_problems(model, 2) == []


def test_module_style_and_validation_hook() -> None:
    """`{"": "module"}` names the module itself; its `tensor_parallel_problems` is called with tp and the sequence
    parallel flag and its problems are listed under its name; a "module" without `tensor_parallel_style` is refused."""
    model = SegmentedToy()
    assert declared_plan(model) == {"mix": "module"}
    assert tp_problems(model, 2) == []
    problems = tp_problems(model, 4)
    assert problems == ["mix: packed: segment 'a' (6) cannot be split over tp=4; choose a tp that divides it"]
    assert "mix: no sequence parallelism here" in tp_problems(model, 2, sequence_parallel=True)
    plain = nn.Sequential(nn.Linear(4, 4))
    assert tp_problems(plain, 2, plan={"0": "module"}) == [
        "0: style 'module' needs Linear.tensor_parallel_style(*, sequence_parallel) (the module's own ParallelStyle); "
        "it has none"
    ]
    with pytest.raises(ValueError, match="style 'module' is the module's own"):
        translate_style("module")


def test_shard_segments_takes_a_slice_of_every_segment() -> None:
    packed = torch.arange(10.0)  # a: 0..5, b: 6..9
    assert shard_segments(packed, {"a": 6, "b": 4}, tp=2, rank=0).tolist() == [0, 1, 2, 6, 7]
    assert shard_segments(packed, {"a": 6, "b": 4}, tp=2, rank=1).tolist() == [3, 4, 5, 8, 9]
    with pytest.raises(ValueError, match="segment 'a' \\(6\\) cannot be split over tp=4"):
        shard_segments(packed, {"a": 6, "b": 4}, tp=4, rank=0)
    with pytest.raises(ValueError, match="add up to 9"):
        shard_segments(packed, {"a": 6, "b": 3}, tp=1, rank=0)
