"""Issue 22 item 6: any transformers causal LM trains at --pp 1 through `--model-path`.

A sweep of real transformers architectures, built tiny from their configs and saved as HF folders: validation
accepts each one at --pp 1 (dp, FSDP2 need no decoder layers) with SDPA where its class supports it and eager
otherwise, and refuses --pp 2 / --activation-checkpointing / --compile up front, with a hint the CLI can follow, only
for the models whose decoder layers am-pipelining cannot find. One launch pair proves a model that was refused before
(GPTNeoX: `gpt_neox.layers`) trains, and that its dp 2 run (FSDP2 grouped by transformers' `_no_split_modules`)
equals the single-process run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import PARITY, launch, without_preset_sizes
from trainer.config import parse_args
from trainer.validation import BadInput, validate

FOLDER = ["--seq-len", "16", "--global-batch", "4", "--steps", "1"]


def _config(name: str) -> Any:
    """A tiny config of architecture `name` (hidden 32, 2 layers, the byte vocabulary)."""
    import transformers as t

    small = dict(vocab_size=256, bos_token_id=1, eos_token_id=2)
    return {
        "gpt_neox": lambda: t.GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, **small
        ),
        "falcon": lambda: t.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **small),
        "gemma2": lambda: t.Gemma2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            **small,
        ),
        "xglm": lambda: t.XGLMConfig(d_model=32, num_layers=2, attention_heads=4, ffn_dim=64, **small),
        "gpt2": lambda: t.GPT2Config(n_embd=32, n_layer=2, n_head=4, **small),
        "opt": lambda: t.OPTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32, **small
        ),
        "bloom": lambda: t.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **small),
        "gptj": lambda: t.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, **small),
        "mpt": lambda: t.MptConfig(d_model=32, n_layers=2, n_heads=4, **small),
        "qwen2": lambda: t.Qwen2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            **small,
        ),
        # MoE folders whose per-expert files transformers stacks (and fuses) on load: read block by block too
        "mixtral": lambda: t.MixtralConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            **small,
        ),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=24,
            **small,
        ),
        "olmoe": lambda: t.OlmoeConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            **small,
        ),
        # fused tensors transformers cuts apart on load (a WeightConverter re-indexing rows): read by blocks too
        "hrm_text": lambda: t.HrmTextConfig(  # Chunk(0): gate_up_proj -> gate / up, gqkv_proj -> gate / q / k / v
            hidden_size=32,
            num_hidden_layers=4,
            num_layers_per_stack=2,
            num_attention_heads=4,
            head_dim=8,
            intermediate_size=48,
            H_cycles=1,
            L_cycles=1,
            **small,
        ),
        "inkling2_text": lambda: t.Inkling2TextConfig(  # Interleave(1): experts' w13_weight -> gate_up_proj
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=8,
            sliding_window_size=8,
            d_rel=4,
            rel_extent=8,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_layers_per_attn_res_block=1,
            unpadded_vocab_size=256,
            **small,
        ),
    }[name]()


# architecture -> (class, attention it is loaded with, whether am-pipelining finds its decoder layers)
SWEEP = {
    "gpt_neox": ("GPTNeoXForCausalLM", "sdpa", False),
    "falcon": ("FalconForCausalLM", "sdpa", False),
    "gemma2": ("Gemma2ForCausalLM", "eager", True),
    "xglm": ("XGLMForCausalLM", "eager", True),
    "gpt2": ("GPT2LMHeadModel", "sdpa", False),
    "opt": ("OPTForCausalLM", "sdpa", False),
    "bloom": ("BloomForCausalLM", "eager", False),
    "gptj": ("GPTJForCausalLM", "eager", False),
    "mpt": ("MptForCausalLM", "eager", False),
    "qwen2": ("Qwen2ForCausalLM", "sdpa", True),
    "mixtral": ("MixtralForCausalLM", "sdpa", True),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "sdpa", True),
    "olmoe": ("OlmoeForCausalLM", "sdpa", True),
    "hrm_text": ("HrmTextForCausalLM", "sdpa", False),  # two stacks of layers (H and L modules)
    "inkling2_text": ("Inkling2ForCausalLM", "eager", True),
}


def _folder(name: str, root: Path) -> Path:
    import transformers

    folder = root / name
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(_config(name)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("any_lm")


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_any_causal_lm_is_accepted_at_pp1_with_the_attention_it_supports(folders: Path, name: str) -> None:
    """Accepted at --pp 1, loaded with SDPA where the class supports it (else eager), and the model validate()
    returns computes a finite loss and gradients (what the trainer's step does with it)."""
    from trainer.models import attn_implementation
    from trainer.parallel import decoder_layers, fsdp_grouping

    class_name, attention, layers_found = SWEEP[name]
    cfg = parse_args([*FOLDER, "--model-path", str(_folder(name, folders)), "--out", str(folders / f"out-{name}")])
    validated = validate(cfg, world_size=1)
    model, plan = validated.model, validated.plan
    assert (type(model).__name__, attn_implementation(model), plan.pipeline) == (class_name, attention, None)
    assert plan.attn_implementation == attention
    assert (decoder_layers(model) is not None) == layers_found
    # FSDP2 groups: the decoder layers where found, else transformers' own layer classes
    assert fsdp_grouping(model) == ("decoder layers" if layers_found else "_no_split_modules")
    # validation built it on the meta device; the run gives it the folder's weights (each rank its own blocks)
    assert all(p.is_meta for p in model.parameters())
    assert validated.spec.materialize is not None
    validated.spec.materialize(model, 0, torch.device("cpu"))
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(str(folders / name), dtype=torch.float32)
    expected = reference.state_dict()
    actual = model.state_dict()
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), f"{name}: {key} differs from transformers' own load"
    ids = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model.eval()(input_ids=ids).logits, reference.eval()(input_ids=ids).logits)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("options", "world_size", "need", "fix"),
    [
        (["--pp", "2"], 2, "--pp 2 cuts the stages between them", "run it with --pp 1"),
        (["--activation-checkpointing"], 1, "--activation-checkpointing wraps each", "no --activation-checkpointing"),
        (["--compile"], 1, "--compile compiles each", "run it with no --compile"),
    ],
    ids=["pp2", "activation-checkpointing", "compile"],
)
@pytest.mark.parametrize("name", ["gpt_neox", "falcon", "opt"])
def test_per_layer_features_are_refused_up_front_with_a_hint_the_cli_can_follow(
    folders: Path, name: str, options: list[str], world_size: int, need: str, fix: str
) -> None:
    """Only a feature that works on the decoder layers needs them; its refusal names the option to drop, not an API
    argument (am-pipelining's own message says "Pass module_names_per_stage explicitly")."""
    args = [*FOLDER, "--model-path", str(_folder(name, folders)), "--out", str(folders / "refused"), *options]
    with pytest.raises(BadInput) as info:
        validate(parse_args(args), world_size=world_size)
    message = str(info.value)
    assert f"{SWEEP[name][0]}: its decoder layers cannot be found" in message, message
    assert need in message, message
    assert fix in message, message
    assert "module_names_per_stage" not in message


def test_per_layer_features_still_run_where_the_layers_are_found(folders: Path) -> None:
    """Gemma2 (eager attention, layers at model.layers) keeps --activation-checkpointing."""
    args = [*FOLDER, "--model-path", str(_folder("gemma2", folders)), "--out", str(folders / "ac")]
    model = validate(parse_args([*args, "--activation-checkpointing"]), world_size=1).model
    assert type(model).__name__ == "Gemma2ForCausalLM"


def test_a_model_without_any_known_layers_is_one_fsdp_group() -> None:
    from trainer.parallel import _layer_modules, fsdp_grouping, layer_notes

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    assert (fsdp_grouping(model), _layer_modules(model)) == ("root", [])
    (note,) = layer_notes(model, grouping=fsdp_grouping(model))
    assert "Sequential: am-pipelining cannot find its decoder layers" in note
    assert "FSDP2 one group for the whole model" in note


def test_a_model_refused_before_trains_and_dp2_equals_single_process(tmp_path: Path) -> None:
    """GPTNeoX (refused for its layers before issue 22) trains at --pp 1, and its dp 2 run, FSDP2-sharded with one
    group per GPTNeoXLayer, has the single-process loss at every step and the same final weights (fp32)."""
    folder = _folder("gpt_neox", tmp_path)
    args = [*without_preset_sizes(PARITY), "--model-path", str(folder)]
    single = launch(args, nproc=1, out=tmp_path / "single").check()
    dp2 = launch([*args, "--dp", "2"], nproc=2, out=tmp_path / "dp2").check()
    assert "GPTNeoXForCausalLM: am-pipelining cannot find its decoder layers" in single.output
    assert (single.summary["attn_implementation"], dp2.summary["attn_implementation"]) == ("sdpa", "sdpa")
    assert (single.summary["fsdp_groups"], dp2.summary["fsdp_groups"]) == (None, "_no_split_modules")
    assert single.summary["layout"]["layers"] is None
    got, want = torch.tensor(dp2.summary["losses"]), torch.tensor(single.summary["losses"])
    assert want.shape == (3,)
    assert bool(torch.isfinite(want).all())
    assert want[0] != want[-1]  # it trains
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    expected, actual = single.final_weights(), dp2.final_weights()
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        error = (actual[key].double() - tensor.double()).norm() / tensor.double().norm().clamp(min=1e-30)
        assert error <= 1e-5, f"{key}: relative error {error.item():.2e}"


def test_a_fused_checkpoint_at_dp2_equals_single_process_and_each_rank_reads_its_half(tmp_path: Path) -> None:
    """HRM-Text, whose files hold fused `gate_up_proj` / `gqkv_proj` tensors transformers chunks on load (loaded
    whole on every rank before): its dp 2 run equals the single process (losses, final weights, fp32), and each
    rank reads only its FSDP2 rows of every fused tensor: the two ranks' bytes add up to the folder's exactly once,
    neither reads more than its half plus one row of each tensor."""
    import json

    from am_model_io import LazyCheckpoint

    folder = _folder("hrm_text", tmp_path)
    args = [*without_preset_sizes(PARITY), "--model-path", str(folder)]
    single = launch(args, nproc=1, out=tmp_path / "single").check()
    report = tmp_path / "loading"
    dp2 = launch(
        [*args, "--dp", "2"], nproc=2, out=tmp_path / "dp2", env={"AM_TRAIN_MEMORY_REPORT": str(report)}
    ).check()
    got, want = torch.tensor(dp2.summary["losses"]), torch.tensor(single.summary["losses"])
    assert bool(torch.isfinite(want).all())
    assert want[0] != want[-1]  # it trains
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    expected, actual = single.final_weights(), dp2.final_weights()
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        error = (actual[key].double() - tensor.double()).norm() / tensor.double().norm().clamp(min=1e-30)
        assert error <= 1e-5, f"{key}: relative error {error.item():.2e}"
    with LazyCheckpoint(folder) as checkpoint:
        stored = checkpoint.meta_state_dict()
    total = sum(t.numel() * t.element_size() for t in stored.values())
    slack = sum(t[0].numel() * t.element_size() for t in stored.values() if t.dim())  # one row of each tensor
    read = [json.loads((report / f"memory_rank{r}.json").read_text())["checkpoint_bytes_read"] for r in range(2)]
    assert sum(read) == total, (read, total)  # every byte once: no rank reads the other's rows
    assert all(r <= total / 2 + slack for r in read), (read, total)


@pytest.mark.parametrize("name", ["gemma2", "xglm", "bloom"])
def test_an_eager_only_model_is_still_refused_under_cp(folders: Path, name: str) -> None:
    """The eager fallback is for --cp 1: a class without SDPA cannot run the ring (am-capabilities' rule, asked up
    front with am-context-parallel's attention check), so --cp 2 is refused before any process group, as before."""
    args = [*FOLDER, "--model-path", str(_folder(name, folders)), "--out", str(folders / "cp"), "--cp", "2"]
    with pytest.raises(BadInput) as info:
        validate(parse_args(args), world_size=2)
    expected = f"cp_size=2: {SWEEP[name][0]} cannot use context parallelism: it declares neither `_supports_sdpa"
    assert expected in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["hrm_text", "inkling2_text"])
def test_fused_tensors_transformers_splits_are_read_row_block_by_row_block(folders: Path, name: str) -> None:
    """HRM-Text's fused `gate_up_proj` / `gqkv_proj` (transformers `Chunk(0)`) and Inkling 2's interleaved expert
    `w13_weight` (`Interleave(1)`) are no longer a reason to load the folder whole: `header_sources` maps each
    target to rows of its file tensor, and in FSDP-like row splits over 2 and 3 ranks along every dim (across the
    interleaved halves too) the blocks each rank reads make exactly the tensors transformers' `from_pretrained`
    loads, every parameter, while each rank reads only its own rows (at most its rounded-up share of the tensor)."""
    import transformers
    from trainer.build import _Reindexed, header_sources

    from am_model_io import LazyCheckpoint

    folder = _folder(name, folders)
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sources, info = header_sources(folder, meta)
    assert not any(info.values()), info
    fused = {target: entry[0] for target, entry in sources.items() if isinstance(entry[0], _Reindexed)}
    assert fused, "no fused tensor found: the conversion is no longer exercised"
    expected = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
    assert set(sources) == set(expected)  # nothing left to a whole load
    for ranks in (2, 3):
        for target, source in fused.items():
            full = expected[target]
            for dim in range(full.dim()):
                blocks = []
                for rows in torch.arange(full.shape[dim]).chunk(ranks):
                    offset = tuple(int(rows[0]) if d == dim else 0 for d in range(full.dim()))
                    shape = tuple(rows.numel() if d == dim else n for d, n in enumerate(full.shape))
                    with LazyCheckpoint(folder) as checkpoint:
                        blocks.append(checkpoint.read_indexed(source.key, source.index(offset, shape)))
                        share = -(-full.shape[dim] // ranks) * full.numel() // full.shape[dim]
                        assert checkpoint.bytes_read <= share * full.element_size(), (target, dim, ranks)
                assert torch.equal(torch.cat(blocks, dim=dim), full), f"{name} {target}: dim {dim} over {ranks} ranks"


def test_a_converter_chain_is_read_as_transformers_applies_it_and_a_transpose_is_not() -> None:
    """Inkling's `mlp.w13_dn.weight` chain (`Interleave(0)` then `Chunk(0)` into gate / up) and the `shared_w13`
    one along dim 1 give, row for row, what transformers' converter makes of a real tensor; a `Transpose` (Qwen3-VL
    MoE's experts) is no re-indexing of rows: None, so such a folder stays on the whole-load path."""
    from trainer.build import _reindexed
    from transformers.core_model_loading import Chunk, Interleave, Transpose, WeightConverter

    model = torch.nn.Linear(2, 2)  # the converters read no parameter
    fused = torch.randn(12, 6)
    cases = [
        ("mlp.w13_dn.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Interleave(dim=0), Chunk(dim=0)], 0),
        ("shared_w13_weight", ["gate_proj", "up_proj"], [Interleave(dim=1), Chunk(dim=1)], 1),
        ("w13_weight", ["gate_up_proj"], [Interleave(dim=0, inverse=True)], 0),
    ]
    for source, targets, operations, dim in cases:
        converter = WeightConverter(source_patterns=source, target_patterns=targets, operations=operations)
        key = f"layers.0.{source}"
        name = f"layers.0.{targets[0]}"
        reference = WeightConverter(source_patterns=source, target_patterns=targets, operations=operations)
        reference.add_tensor(name, key, source, lambda: fused)
        want = reference.convert(name, model=model)
        found = _reindexed(key, name, source, converter, model, tuple(fused.shape))
        assert found is not None
        assert [part.name for part in found] == list(want)
        for part in found:
            assert part.dim == dim
            assert part.shape == tuple(want[part.name].shape)
            assert torch.equal(fused.index_select(dim, part.rows), want[part.name]), (source, part.name)
    transpose = WeightConverter("mlp.experts.down_proj", "mlp.experts.down_proj", operations=[Transpose(1, 2)])
    key = "layers.0.mlp.experts.down_proj"
    assert _reindexed(key, key, "mlp.experts.down_proj", transpose, model, (4, 6, 8)) is None


@pytest.mark.parametrize("name", ["hrm_text", "inkling2_text"])
def test_the_streamed_export_writes_fused_tensors_as_save_pretrained(folders: Path, name: str) -> None:
    """The trainer's HF export hands its layout one model tensor at a time; a file tensor transformers cuts into
    several (HRM-Text's `gqkv_proj`: gate / q / k / v) is written once all its parts have come, equal to what
    `save_pretrained` writes (it was written once per part, and refused as a repeated key)."""
    import transformers
    from trainer.export import transformers_file_layout

    from am_model_io import read_safetensors_folder

    folder = _folder(name, folders)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    layout = transformers_file_layout(model)
    written: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        for file_key, value in layout.to_file({key: tensor}).items():
            assert file_key not in written, f"{file_key} written twice"
            written[file_key] = value
    expected = read_safetensors_folder(folder)
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(written[key], tensor), key
