"""`--tp`: its options' parity with the single process, and what tensor parallelism refuses, before any
collective, in the user's terms.

The parity of the plain TP layouts with the single process (loss every step, final weights) is in test_parity.py
(its CASES); exact resume at tp 2 in test_resume.py. Here: the layouts with `--sequence-parallel` and
`--loss-parallel` (sharing test_parity's single-process references through the session's run cache), composed with
dp, cp and activation checkpointing (an HF plan, Mixtral's with its router loss: test_router_aux.py); in-process
`validate()` refusals (no process group) and one launch by hand proving exit code 2 on every rank before the
rendezvous.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_bad_input import EXIT_BAD_INPUT, _launch_ranks_by_hand
from test_parity import RTOL, assert_weights_close
from trainer.config import parse_args
from trainer.validation import BadInput, validate

TINY = ["--hidden-size", "32", "--layers", "4", "--seq-len", "16", "--global-batch", "4", "--steps", "1"]


# (case, single-process reference, layout (pp, dp, cp, tp)): test_parity's references, conftest's launches
SP_CASES = [
    ("nemotron-dp2-tp2-sp-lp-ac", "nemotron", (1, 2, 1, 2)),  # Mamba2 / MoE / MTP under SP, FSDP2 over dp, AC
    ("gemma4-moe-cp2-tp2-sp-lp", "gemma4-moe", (1, 1, 2, 2)),  # MoE whole; ring attention per head; tied head
]


@pytest.mark.parametrize(("case", "reference", "layout"), SP_CASES, ids=[case for case, _, _ in SP_CASES])
def test_sequence_and_loss_parallel_equal_single_process(runs, case: str, reference: str, layout: tuple) -> None:
    """`--sequence-parallel --loss-parallel` (with dp, cp or activation checkpointing): the loss of every step, the
    gradient norm of every step and every final weight equal the single-process run's (fp32, RTOL); summary.json
    records the layout, both options in the plan, the norms that ran on sequence shards and the `colwise` head."""
    parallel, single = runs.get(case).check(), runs.get(reference).check()
    for key in ("losses", "grad_norms"):
        got, want = torch.tensor(parallel.summary[key]), torch.tensor(single.summary[key])
        assert got.shape == want.shape == (3,), key
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0, msg=key)
    assert_weights_close(parallel.final_weights(), single.final_weights(), rtol=RTOL)
    summary = parallel.summary
    assert tuple(summary["layout"][axis] for axis in ("pp", "dp", "cp", "tp")) == layout
    plan = summary["plan"]["tensor_parallel"]
    assert plan["sequence_parallel"], plan
    assert plan["loss_parallel"], plan
    assert plan["norms"], plan  # the stream's norms ran on sequence shards
    assert plan["styles"]["lm_head"] == "colwise", plan  # the head keeps its vocabulary shard
    assert "sequence_gather" in plan["styles"].values(), plan  # routed experts whole, on whole sequences
    assert summary["activation_checkpointing"] == case.endswith("-ac")


def test_a_nemotron_folder_under_tp_loads_each_rank_its_shards(runs, tmp_path: Path) -> None:
    """`--model-path` at --tp 2 (issue 23 §1 (f)): TP is applied on the meta model, then each rank reads its own
    blocks of the attention / MLP / embedding / head (DTensor slices) and each Mamba2 mixer's head shard (read whole
    one mixer at a time and cut by the mixer's `tensor_parallel_shard_state`); the folder holds the seeded preset's
    values, so the run equals the single-process preset run (loss and grad norm every step, final weights) and no
    rank reads the whole folder."""
    import json

    from conftest import PARITY, launch, without_preset_sizes
    from trainer.models import build_model, preset_spec

    spec = preset_spec("nemotron", hidden_size=32, num_layers=4, mtp_depths=1, tie_embeddings=False, vocab_size=None)
    spec.save(build_model(spec, seed=1234), tmp_path / "nemotron")  # the trainer's default --seed
    report = tmp_path / "memory"
    args = [*without_preset_sizes(PARITY), "--model-path", str(tmp_path / "nemotron"), "--tp", "2"]
    tp = launch(args, nproc=2, out=tmp_path / "tp2", env={"AM_TRAIN_MEMORY_REPORT": str(report)}).check()
    single = runs.get("nemotron").check()
    for key in ("losses", "grad_norms"):
        got, want = torch.tensor(tp.summary[key]), torch.tensor(single.summary[key])
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0, msg=key)
    assert_weights_close(tp.final_weights(), single.final_weights(), rtol=RTOL)
    stored = sum(f.stat().st_size for f in (tmp_path / "nemotron").glob("*.safetensors"))
    for rank in range(2):
        read = json.loads((report / f"memory_rank{rank}.json").read_text())["checkpoint_bytes_read"]
        assert 0 < read < 0.9 * stored, (rank, read, stored)


def _refusal(args: list[str], *, world_size: int) -> str:
    with pytest.raises(BadInput) as info:
        validate(parse_args(args), world_size=world_size)
    return str(info.value)


def test_sizes_that_do_not_divide_are_each_named() -> None:
    """Nemotron-H at tp 3: attention heads, KV heads, the MLP's intermediate features, the vocabulary, the Mamba2
    heads and groups: every one is named (am-tensor-parallel's rule, read from the model on the meta device)."""
    text = _refusal(["--model", "nemotron", *TINY, "--tp", "3"], world_size=3)
    expected = [
        "--tp 3: NemotronHForCausalLM: model.layers.1.mixer: 4 attention heads cannot be split over tp=3",
        "--tp 3: NemotronHForCausalLM: model.layers.1.mixer: 2 key/value heads cannot be split over tp=3",
        "model.layers.2.mixer.up_proj: 'colwise' splits its 64 output features over tp=3: not divisible",
        "model.embed_tokens: 'embedding_rowwise' splits its 256 vocabulary entries over tp=3: not divisible",
        "model.layers.0.mixer: Mamba2 has 4 heads, which cannot be split over tp=3",
        "model.layers.0.mixer: Mamba2 has n_groups=2 B/C groups, which cannot be split exactly over tp=3",
    ]
    missing = [line for line in expected if line not in text]
    assert not missing, f"not reported: {missing}\n{text}"


def test_kv_heads_are_not_replicated_and_experts_follow_the_ep_rule() -> None:
    """tp 4 divides Nemotron-H's 4 query heads but not its 2 KV heads (never replicated): refused. Under TP the
    experts stay whole (ep splits them), so their rule is ep's: --ep 3 is refused against dp x cp and the experts."""
    text = _refusal(["--model", "nemotron", *TINY, "--tp", "4"], world_size=4)
    assert "2 key/value heads cannot be split over tp=4" in text, text
    assert "attention heads cannot be split" not in text, text
    text = _refusal(["--model", "gemma4-moe", *TINY, "--tp", "2", "--dp", "3", "--ep", "3"], world_size=6)
    assert "ep_size=3: Gemma4ForCausalLM cannot use expert parallelism" in text, text
    assert "--tp 2" not in text, text  # tp 2 itself is fine for Gemma 4 MoE: its attention and head split


def test_world_size_must_be_pp_x_dp_x_cp_x_tp() -> None:
    text = _refusal(["--model", "llama", *TINY, "--tp", "2", "--dp", "2"], world_size=2)
    assert "the world size is 2 but pp x dp x cp x tp = 1 x 2 x 1 x 2 = 4" in text, text


def test_features_not_supported_with_tp_are_refused_up_front() -> None:
    """Compile is not run under TP; --sequence-parallel / --loss-parallel need --tp > 1, --pp 1 and (SP) a sequence
    length divisible by tp: each is refused with the way out."""
    args = ["--model", "llama", *TINY, "--tp", "2", "--compile"]
    text = _refusal(args, world_size=2)
    assert "--tp 2: --compile is not run over DTensor (TP) layers" in text, text
    text = _refusal(["--model", "llama", *TINY, "--sequence-parallel", "--loss-parallel"], world_size=1)
    assert "--sequence-parallel shards over the tp ranks, but --tp is 1: add --tp N (N > 1)" in text, text
    assert "--loss-parallel shards over the tp ranks, but --tp is 1" in text, text
    args = ["--model", "nemotron", *TINY, "--seq-len", "15", "--tp", "2", "--pp", "2", "--sequence-parallel"]
    text = _refusal(args, world_size=4)
    assert "--sequence-parallel with --pp 2: the pipeline's stage boundaries carry whole plain tensors" in text, text
    assert "--seq-len 15 is not a multiple of 2" in text, text


def test_a_model_without_a_plan_is_refused(tmp_path: Path) -> None:
    """An HF architecture that declares no TP plan (GPT-2: no `base_model_tp_plan`) is refused at tp 2."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    args = ["--model-path", str(tmp_path / "gpt2"), "--seq-len", "16", "--global-batch", "4", "--steps", "1"]
    text = _refusal([*args, "--tp", "2"], world_size=2)
    assert "--tp 2: GPT2LMHeadModel: GPT2LMHeadModel declares no tensor-parallel plan" in text, text
    assert "run with tp=1" in text, text


def test_bad_tp_exits_2_on_every_rank_before_any_collective(tmp_path: Path) -> None:
    """Two ranks launched by hand with --tp 4: the world size and the KV heads / Mamba2 groups are refused in one
    message, exit code 2 on both ranks, and no rank reached the rendezvous."""
    args = ["--model", "nemotron", *TINY, "--tp", "4", "--no-progress", "--out", str(tmp_path / "out")]
    (code0, out0), (code1, out1) = _launch_ranks_by_hand(args, world_size=2)
    assert (code0, code1) == (EXIT_BAD_INPUT, EXIT_BAD_INPUT), out0[-3000:] + out1[-3000:]
    assert "Traceback" not in out0 + out1
    assert out0.count("refusing to start") == 1
    assert "refusing to start" not in out1
    assert "the world size is 2 but pp x dp x cp x tp = 1 x 1 x 1 x 4 = 4" in out0, out0
    assert "2 key/value heads cannot be split over tp=4" in out0, out0
    assert "n_groups=2 B/C groups, which cannot be split exactly over tp=4" in out0, out0
