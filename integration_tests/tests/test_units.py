"""In-process checks of the trainer's pieces (no process group): loss oracle, LR schedule, data, config, checkpoint
verification. Cheap; the multi-process behaviour is in the other test modules."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from trainer.checkpoint import verify_checkpoint
from trainer.config import find_problems, parse_args, pipeline_plan
from trainer.data import BatchStream, ByteTokenizer, load_tokens
from trainer.loop import TokenSumLoss, lr_at
from trainer.models import build_model, preset_spec


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_trainer_loss_equals_the_models_own_loss(family: str) -> None:
    """Oracle for the single-process reference: our global token mean on pre-shifted labels equals the model's own
    causal-LM loss (which shifts internally) on the same windows."""
    spec = preset_spec(family, hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=True, vocab_size=None)
    model = build_model(spec, seed=0)
    windows = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    inputs, labels = windows[:, :-1], windows[:, 1:]
    loss_fn = TokenSumLoss()
    loss_fn.denominator = float(labels.numel())
    ours = loss_fn(model(input_ids=inputs).logits, labels)
    theirs = model(input_ids=windows, labels=windows).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0.0)


def test_fsdp_groups_every_decoder_and_mtp_layer() -> None:
    """One FSDP2 group per decoder layer (am-pipelining's find_layers) and per MTP depth layer."""
    from trainer.parallel import _layer_modules

    from am_pipelining import find_layers

    spec = preset_spec("nemotron", hidden_size=32, num_layers=4, mtp_depths=1, tie_embeddings=False, vocab_size=None)
    model = build_model(spec, seed=0)
    decoder = find_layers(model)
    assert decoder.num_layers == 4
    groups = _layer_modules(model)
    mtp_layers = list(model.mtp.layers)
    assert mtp_layers, "the preset has MTP layers"
    assert groups == decoder.layers + mtp_layers


def _mtp_training_loss_by_hand(output, labels, lm_head, loss_fn, *, scaling: float, seq_idx=None) -> torch.Tensor:
    """The Nemotron training objective written out from its definition (independent of every package's loss code):
    next-token loss + scaling x mean over depths k of the loss of token t + k + 2 (labels are already shifted by one),
    a target past the end of the row or across a packed-document boundary being no target."""
    total = loss_fn(output.logits, labels)
    depths = list(output.mtp_per_depth_h)
    seq_len = labels.shape[1]
    positions = torch.arange(seq_len)
    depth_losses = []
    for k, hidden in enumerate(depths):
        shift = k + 1
        targets = torch.full_like(labels, -100)
        targets[:, : seq_len - shift] = labels[:, shift:]
        if seq_idx is not None:
            crosses = seq_idx[:, (positions + shift).clamp(max=seq_len - 1)] != seq_idx
            targets[crosses & (positions < seq_len - shift)] = -100
        depth_losses.append(loss_fn(lm_head(hidden), targets))
    return total + scaling * torch.stack(depth_losses).mean()


def test_nemotron_training_loss_is_the_models_combined_loss_and_counts_mtp_once() -> None:
    """The trainer's loss module (am-pipelining's PipelineCausalLMLoss, at pp = 1 and on the last stage) computes
    the Nemotron training objective — checked against the objective written out by hand, on the forward's output and
    on a last stage's tuple with its seq_idx tail — and the model's own `loss` is the next-token loss alone (MTP
    reported apart). The hand-written oracle tells a wrongly scaled MTP term apart (checked by mutating it)."""
    from am_pipelining import PipelineCausalLMLoss

    spec = preset_spec("nemotron", hidden_size=32, num_layers=4, mtp_depths=2, tie_embeddings=False, vocab_size=None)
    model = build_model(spec, seed=0).train()
    scaling = float(model.mtp_config.loss_scaling_factor)
    assert scaling > 0
    windows = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    inputs, labels = windows[:, :-1], windows[:, 1:]
    loss_fn = TokenSumLoss()
    loss_fn.denominator = float(labels.numel())
    output = model(input_ids=inputs)
    assert len(output.mtp_per_depth_h) == 2
    by_hand = _mtp_training_loss_by_hand(output, labels, model.lm_head, loss_fn, scaling=scaling)
    pipeline = PipelineCausalLMLoss(loss_fn, model=model)(output, labels)
    torch.testing.assert_close(pipeline, by_hand, rtol=1e-6, atol=0.0)
    for wrong in (0.0, 2 * scaling, scaling / 2):  # the mutation check: a mis-scaled MTP term is told apart
        mutated = _mtp_training_loss_by_hand(output, labels, model.lm_head, loss_fn, scaling=wrong)
        assert not torch.allclose(pipeline, mutated, rtol=1e-4, atol=0.0), wrong
    seq_idx = (torch.arange(16) >= 7).to(torch.int32).expand(2, 16)  # two packed documents per row
    stage_tuple = (output.logits, *output.mtp_per_depth_h, seq_idx)
    packed = PipelineCausalLMLoss(loss_fn, model=model)(stage_tuple, labels)
    packed_by_hand = _mtp_training_loss_by_hand(
        output, labels, model.lm_head, loss_fn, scaling=scaling, seq_idx=seq_idx
    )
    torch.testing.assert_close(packed, packed_by_hand, rtol=1e-6, atol=0.0)
    assert not torch.allclose(packed, by_hand, rtol=1e-4, atol=0.0)  # the document boundary really masks targets
    own = model(input_ids=windows, labels=windows)
    next_token = loss_fn(own.logits[:, :-1], labels)
    torch.testing.assert_close(own.loss, next_token, rtol=1e-6, atol=0.0)
    assert own.mtp_loss is not None


def test_lr_warms_up_then_decays_to_min_lr() -> None:
    cfg = parse_args(["--steps", "100", "--warmup-steps", "10", "--lr", "1e-3", "--min-lr", "1e-4"])
    assert lr_at(1, cfg) == pytest.approx(1e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    values = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_batch_stream_resumes_where_it_stopped() -> None:
    tokens = load_tokens(None, vocab_size=256)
    assert ByteTokenizer().decode(tokens[:9]) == "Genesis 1"
    first = BatchStream(tokens, seq_len=8, global_batch=2)
    first.next_batch()
    state = first.state_dict()
    expected = first.next_batch()
    second = BatchStream(tokens, seq_len=8, global_batch=2)
    second.load_state_dict(json.loads(json.dumps(state)))
    got = second.next_batch()
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    assert torch.equal(got[0][:, 1:], got[1][:, :-1])  # labels are the inputs shifted by one


def test_load_tokens_rejects_out_of_vocab_ids(tmp_path) -> None:
    path = tmp_path / "ids.pt"
    torch.save(torch.tensor([1, 2, 300]), path)
    with pytest.raises(ValueError, match=r"span \[1, 300\] but the model's vocabulary has 256"):
        load_tokens(path, vocab_size=256)


def test_find_problems_accepts_a_good_config_and_lists_every_bad_value() -> None:
    good = parse_args(["--pp", "2", "--dp", "2", "--global-batch", "8"])
    assert find_problems(good, world_size=4) == []
    bad = parse_args(["--pp", "0", "--dp", "3", "--global-batch", "8", "--schedule", "nope", "--lr", "-1"])
    problems = find_problems(bad, world_size=4)
    # pp, dp divisibility, lr (no world-size line: with pp=0 there is no meaningful product to compare). Schedule
    # rules are the pipeline plan's (test_pipeline_plan_*): with pp < 1 there is no pipeline to plan.
    assert len(problems) == 3, problems
    assert any("--pp=0" in p for p in problems)
    assert any("not divisible by --dp 3" in p for p in problems)
    assert pipeline_plan(bad, num_layers=4) == (None, [])


def test_pipeline_plan_runs_stages_per_rank_exactly() -> None:
    """8 layers, pp=2, --stages-per-rank 3: six stages (the old trainer turned this into 4)."""
    cfg = parse_args(["--pp", "2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "3", "--global-batch", "4"])
    plan, problems = pipeline_plan(cfg, num_layers=8)
    assert problems == []
    assert (plan.num_stages, plan.layers_per_stage, plan.n_microbatches) == (6, (2, 2, 1, 1, 1, 1), 4)


def test_pipeline_plan_names_every_problem_in_cli_terms() -> None:
    cfg = parse_args(["--pp", "2", "--stages-per-rank", "2", "--global-batch", "5", "--microbatch-size", "2"])
    plan, problems = pipeline_plan(cfg, num_layers=3)
    assert plan is None
    assert len(problems) == 3, problems
    text = "\n".join(problems)
    assert "requires exactly 1 stage per rank" in text
    assert "Number of stages (4) cannot exceed number of layers (3)" in text
    assert "(--global-batch 5 / --dp 1 = 5) is not divisible by --microbatch-size 2" in text
    single = parse_args(["--stages-per-rank", "2", "--schedule", "GPipe"])
    assert any("only apply with --pp > 1" in p for p in find_problems(single, world_size=1))


def test_verify_checkpoint_names_what_is_missing(tmp_path) -> None:
    assert verify_checkpoint(tmp_path / "nothing") == [f"checkpoint {tmp_path / 'nothing'} does not exist"]
    (tmp_path / "ckpt").mkdir()
    (problem,) = verify_checkpoint(tmp_path / "ckpt")
    assert "has no manifest.json: it is incomplete" in problem
    (tmp_path / "ckpt" / "manifest.json").write_text(json.dumps({"files": {"dcp/x": "0" * 64}}))
    assert verify_checkpoint(tmp_path / "ckpt") == [f"checkpoint {tmp_path / 'ckpt'}: dcp/x is missing"]


def test_cp_problems_name_the_sequence_length_and_the_layout_the_pipeline_needs() -> None:
    from trainer.config import cp_problems

    ok = parse_args(["--pp", "2", "--cp", "2", "--seq-len", "16"])
    assert cp_problems(ok, cp_layout="contiguous", pad_multiple=2) == []
    assert cp_problems(parse_args(["--seq-len", "18"]), cp_layout=None, pad_multiple=2) == [], "cp = 1: nothing"
    bad = parse_args(["--model", "llama", "--pp", "2", "--cp", "2", "--seq-len", "18"])
    problems = cp_problems(bad, cp_layout="load_balanced", pad_multiple=2)
    assert len(problems) == 2, problems
    assert "--seq-len 18 is not divisible by 4 (2 x --cp 2)" in problems[0]
    assert "use --seq-len 20" in problems[0]
    assert "--model llama uses the load_balanced layout" in problems[1]


def test_validate_lists_every_cp_problem_at_once_before_any_process_group() -> None:
    """`validate` (no process group) refuses pp x cp for a load-balanced model, a CP size that does not divide the
    sequence, and the rest of the run's problems, in ONE BadInput."""
    import torch.distributed as dist
    from trainer.loop import BadInput, validate

    cfg = parse_args([
        "--model", "llama", "--pp", "2", "--cp", "3", "--seq-len", "16", "--hidden-size", "32", "--layers", "4",
        "--global-batch", "4", "--lr", "-1",
    ])  # fmt: skip
    with pytest.raises(BadInput) as caught:
        validate(cfg, world_size=4)
    text = str(caught.value)
    assert "refusing to start (4 problems)" in text, text
    for expected in (
        "the world size is 4 but pp x dp x cp = 2 x 1 x 3 = 6",
        "--seq-len 16 is not divisible by 6 (2 x --cp 3)",
        "pipeline stages run context parallelism only for models that declare the contiguous CP layout",
        "--lr -1.0",
    ):
        assert expected in text, f"not reported: {expected}\n{text}"
    assert not dist.is_initialized()


def test_ep_problems_name_the_layout_in_cli_terms() -> None:
    """--ep is carved out of dp x cp: it must divide dp x cp (am-moe's `plan_expert_parallel`, in CLI terms, asked
    once by `expert_parallel_plan`, whose plan the run plan keeps), and it adds no processes (the world size stays
    pp x dp x cp)."""
    from trainer.config import expert_parallel_plan

    good = parse_args(["--dp", "2", "--cp", "2", "--ep", "4"])
    assert find_problems(good, world_size=4) == []
    plan, problems = expert_parallel_plan(parse_args(["--dp", "2", "--cp", "3", "--ep", "3"]))
    assert (problems, plan.ep, plan.expert_dp) == ([], 3, 2)
    (problem,) = expert_parallel_plan(parse_args(["--dp", "2", "--cp", "2", "--ep", "3"]))[1]
    assert "--ep 3 with --dp 2 x --cp 2: ep=3 must divide dp x cp = 4" in problem, problem
    assert "choose an --ep that divides 4" in problem
    assert find_problems(parse_args(["--ep", "0"]), world_size=1) == ["--ep=0: must be >= 1"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--model", "gemma4", "--dp", "2", "--ep", "2"],
            ["ep_size=2: Gemma4ForCausalLM cannot use expert parallelism"],
        ),
        (
            ["--model", "llama", "--dp", "2", "--ep", "2"],
            ["ep_size=2: LlamaForCausalLM cannot use expert parallelism: it has no `apply_expert_parallel(ep_mesh)`"],
        ),
        (
            ["--model", "gemma4-moe", "--dp", "3", "--global-batch", "3", "--ep", "3", "--lr", "-1"],
            ["(num_experts=4 not divisible by 3)", "--lr -1.0"],
        ),
        (
            ["--model", "nemotron", "--layers", "2", "--dp", "2", "--ep", "2"],  # "M*": no MoE layer
            [
                "ep_size=2: NemotronHForCausalLM cannot use expert parallelism: its capability declaration says "
                "supports_ep=False"
            ],
        ),
        (
            ["--model", "nemotron", "--layers", "4", "--dp", "2", "--ep", "4"],
            ["--ep 4 with --dp 2 x --cp 1: ep=4 must divide dp x cp = 2"],
        ),
    ],
    ids=["dense-gemma4", "llama", "experts-not-divisible", "nemotron-without-moe", "ep-not-dividing-dp-cp"],
)
def test_validate_refuses_every_ep_problem_before_any_process_group(args: list[str], expected: list[str]) -> None:
    """A model without expert parallelism, experts that do not split over ep (both am-capabilities' rules) and an ep
    that does not divide dp x cp are refused by `validate`, with the run's other problems, in ONE BadInput."""
    import torch.distributed as dist
    from trainer.loop import BadInput, validate

    cfg = parse_args(["--hidden-size", "32", "--layers", "2", "--seq-len", "16", *args])
    with pytest.raises(BadInput) as caught:
        validate(cfg, world_size=cfg.world_size)
    text = str(caught.value)
    assert f"refusing to start ({len(expected)} problem" in text, text
    for line in expected:
        assert line in text, f"not reported: {line}\n{text}"
    assert not dist.is_initialized()


@pytest.mark.parametrize("imbalance", [1.5, None], ids=["moe", "dense"])
def test_progress_shows_expert_load_imbalance_next_to_the_loss(capsys, imbalance: float | None) -> None:
    from trainer.progress import Progress

    progress = Progress(total_steps=2, start_step=0, tokens_per_step=10, enabled=True)
    progress.update(step=1, loss=2.5, lr=1e-3, expert_imbalance=imbalance)
    progress.close()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "loss=2.5000" in line, line
    if imbalance is None:
        assert "experts" not in line, line
    else:
        assert "loss=2.5000, experts max/mean=1.50," in line, line


# ------------------------------------------------------------------------------------------------------------------
# Issue 22: non-finite steps, non-finite weights and a full disk at checkpoint time, the command line
# ------------------------------------------------------------------------------------------------------------------


def test_step_guard_stops_at_a_non_finite_value_or_skips_within_its_budget() -> None:
    from trainer.guards import RunStopped, StepGuard

    strict = StepGuard(max_skips=0)
    assert strict.check(1, loss=2.5, grad_norm=0.7)
    with pytest.raises(RunStopped, match=r"^step 4: non-finite loss nan and gradient norm inf; .*--skip-nonfinite"):
        strict.check(4, loss=float("nan"), grad_norm=float("inf"))
    lenient = StepGuard(max_skips=2, skipped=[3])  # resumed: one skip already counted
    assert not lenient.check(5, loss=1.0, grad_norm=float("nan"))
    assert lenient.skipped == [3, 5]
    assert lenient.last_problem == "step 5: non-finite gradient norm nan"
    with pytest.raises(RunStopped, match=r"--skip-nonfinite-steps 2 allowed 2 skipped step\(s\) .*steps \[3, 5\]"):
        lenient.check(6, loss=float("-inf"), grad_norm=1.0)


def _llama_with_optimizer() -> tuple[object, torch.nn.Module, torch.optim.Optimizer]:
    spec = preset_spec("llama", hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=False, vocab_size=None)
    model = build_model(spec, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    optimizer.step()  # optimizer state exists, as in a checkpoint of a real run
    return spec, model, optimizer


def _save(tmp_path, step: int, spec, model, optimizer, *, export_hf=None):  # type: ignore[no-untyped-def]
    from trainer.checkpoint import save_checkpoint
    from trainer.export import make_hf_exporter

    return save_checkpoint(
        tmp_path / "out",
        step=step,
        model_parts=[model],
        optimizers=[optimizer],
        trainer_state={"losses": []},
        export_hf=export_hf or make_hf_exporter([model], file_layout=spec.file_layout),
    )


def test_no_checkpoint_of_non_finite_weights_latest_keeps_the_last_finite_one(tmp_path, one_rank_group) -> None:
    from trainer.guards import RunStopped

    spec, model, optimizer = _llama_with_optimizer()
    first = _save(tmp_path, 1, spec, model, optimizer)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(RunStopped, match=r"step 2: 1 weight tensor\(s\) hold NaN .*model.layers.1.mlp.up_proj.weight"):
        _save(tmp_path, 2, spec, model, optimizer)
    root = tmp_path / "out" / "checkpoints"
    assert (root / "latest").read_text() == first.name
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]


def test_a_checkpoint_the_disk_cannot_hold_says_no_space_with_the_sizes(tmp_path, one_rank_group, monkeypatch) -> None:
    """Up front (free bytes against the estimate; AM_TRAIN_DISK_FREE_BYTES is the quota seam), and when the write
    itself fails for want of space (/dev/full: torch's own `unexpected pos` error): "no space left on device", the
    partial folder removed, `latest` kept."""
    from trainer.guards import RunStopped, checkpoint_bytes_estimate

    spec, model, optimizer = _llama_with_optimizer()
    first = _save(tmp_path, 1, spec, model, optimizer)
    root = tmp_path / "out" / "checkpoints"
    written = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    estimate = checkpoint_bytes_estimate([model], [optimizer])
    assert 0.9 * written < estimate < 1.5 * written, (estimate, written)  # the estimate is the real size's order

    monkeypatch.setenv("AM_TRAIN_DISK_FREE_BYTES", "1000")
    with pytest.raises(RunStopped) as refused:
        _save(tmp_path, 2, spec, model, optimizer)
    message = str(refused.value)
    assert message.startswith("no space left on device: the checkpoint of step 2 needs about "), message
    assert "the disk has 1,000 bytes (0.0 MiB) free" in message, message
    assert "`latest` still names the previous checkpoint" in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    monkeypatch.delenv("AM_TRAIN_DISK_FREE_BYTES")

    if not Path("/dev/full").exists():
        pytest.skip("/dev/full (a device that answers every write with ENOSPC) is needed for the write failure")

    def export_onto_a_full_disk(folder: Path) -> None:
        folder.mkdir(parents=True)
        torch.save(model.state_dict(), "/dev/full")  # RuntimeError: [enforce fail at inline_container.cc] ...

    with pytest.raises(RunStopped, match=r"^no space left on device: the checkpoint of step 3") as failed:
        _save(tmp_path, 3, spec, model, optimizer, export_hf=export_onto_a_full_disk)
    assert "unexpected pos" in str(failed.value.__cause__)
    assert (root / "latest").read_text() == first.name
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"], "the partial step_3.tmp is gone"


def test_is_no_space_error_knows_enospc_and_torchs_short_write() -> None:
    import errno

    from trainer.guards import is_no_space_error

    assert is_no_space_error(OSError(errno.ENOSPC, "No space left on device"))
    assert is_no_space_error(RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598"))
    wrapped = RuntimeError("dcp failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert is_no_space_error(wrapped)
    assert not is_no_space_error(OSError(errno.EACCES, "Permission denied"))


def test_toml_switch_flags_help_defaults_and_negative_numbers(tmp_path) -> None:
    """A switch's flag name works in TOML (`no-progress = true`), `--help` shows no "(default: True)" for a switch,
    and `--lr -1e-3` reaches validation (which names it) instead of failing in argparse."""
    from trainer.config import build_parser

    run = tmp_path / "run.toml"
    run.write_text("no-progress = true\nno_tensorboard = true\nglobal-batch = 8\n")
    cfg = parse_args(["--config", str(run)])
    assert (cfg.progress, cfg.tensorboard, cfg.global_batch) == (False, "off", 8)
    run.write_text("no-progress = false\n")
    assert parse_args(["--config", str(run)]).progress is True
    help_text = " ".join(build_parser().format_help().split())
    assert "(default: True)" not in help_text
    assert "--no-progress no progress bar (default: a bar on rank 0)" in help_text
    assert "all replicas (default: 8)" in help_text, "options with a value keep their default"
    negative = parse_args(["--lr", "-1e-3", "--min-lr", "-2E-4", "--seed", "-3"])
    assert (negative.lr, negative.min_lr, negative.seed) == (-1e-3, -2e-4, -3)
    (problem,) = find_problems(negative, world_size=1)
    assert problem.startswith("--lr -0.001, --min-lr -0.0002, --warmup-steps 20: need lr > 0"), problem


def test_resuming_with_a_changed_lr_clip_decay_or_length_is_recorded_and_warned(tmp_path) -> None:
    """The README's rule: layout, data and model options must match (refused otherwise); the optimizer's numbers
    and --steps may change, and each change is named in a warning (the new checkpoints record the new values)."""
    from dataclasses import asdict

    from trainer.validation import _resume_mismatches, resume_changes

    saved = json.loads(json.dumps(asdict(parse_args(["--out", str(tmp_path)])), default=str))
    state = {"step": 40, "args": saved}
    changed = parse_args(
        ["--out", str(tmp_path), "--resume", "latest", "--lr", "1e-3", "--grad-clip", "0.5", "--weight-decay", "0",
         "--steps", "600"]
    )  # fmt: skip
    assert _resume_mismatches(changed, state) == []
    warnings = resume_changes(changed, state)
    assert [w.split(": ")[1].split(" changes")[0] for w in warnings] == ["steps", "lr", "weight_decay", "grad_clip"]
    assert (
        "lr changes from 0.003 (the checkpoint's run) to 0.001; the run continues with 0.001 from step 41"
        in (warnings[1])
    )
    assert resume_changes(parse_args(["--out", str(tmp_path), "--resume", "latest"]), state) == []
    # --hidden-size 64 given now, not given then (None: the preset's 64): the same model, no refusal
    assert _resume_mismatches(parse_args(["--resume", "latest", "--hidden-size", "64"]), state) == []
