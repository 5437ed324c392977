"""The router load-balancing loss of transformers MoE models (issue 22, item 2): the trainer's objective is the
model's own `loss` (cross-entropy + router_aux_loss_coef x aux), exactly, however the global batch is split.

In-process oracles against transformers for Mixtral, Qwen2-MoE and OLMoE built tiny from config; multi-process
launches for the trainer end to end against the single process: Mixtral at dp 2 x cp 2 with two microbatches per
rank, Mixtral at pp 2 compiled, Qwen2-MoE at pp 2 activation-checkpointed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer.step_parts import RouterAuxLoss, TokenSumLoss, router_aux_spec

VOCAB = 64
COEF = 0.02


def _tiny(family: str, *, output_router_logits: bool = True) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=output_router_logits,
        router_aux_loss_coef=COEF, max_position_embeddings=64,
    )  # fmt: skip
    experts = {
        "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4}),
        "qwen2_moe": (
            "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
            {"num_experts": 4, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 24},
        ),
        "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", {"num_experts": 4}),
        "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 24}),
        "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", {"num_local_experts": 4}),
        "doge": ("DogeForCausalLM", "DogeConfig", {"num_experts": 4, "is_moe": True}),
    }  # fmt: skip
    model_name, config_name, sizes = experts[family]
    config = getattr(transformers, config_name)(**sizes, **common)
    cls = getattr(transformers, model_name)
    torch.manual_seed(0)
    return cls(config).train()


def _windows(rows: int = 4, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq + 1), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "granitemoe"])
def test_objective_and_gradient_equal_the_models_own_loss_however_the_batch_is_split(family: str) -> None:
    """CE (global token mean) + coef x aux, computed from pieces of the batch (2 "ranks" x 2 microbatches of one
    row: counts summed first, then each piece's share), equals transformers' loss on the whole batch, value and
    gradient; the imbalance is the worst layer's busiest expert over the mean, from the same top-k counts."""
    model = _tiny(family)
    assert router_aux_spec(model) == (4, 2, COEF, True)
    windows = _windows()
    inputs, labels = windows[:, :-1], windows[:, 1:]
    theirs = model(input_ids=windows[:, :-1], labels=windows[:, :-1].clone(), output_router_logits=True)
    # transformers shifts internally: its labels are the inputs; ours are pre-shifted (the last position has no
    # target in theirs), so compare on the windows' first seq positions with the last label ignored.
    labels = labels.clone()
    labels[:, -1] = -100
    ref_grads = torch.autograd.grad(theirs.loss, list(model.parameters()), allow_unused=True)

    router = RouterAuxLoss.for_model(model)
    assert router is not None
    assert router.coef == COEF
    ce = TokenSumLoss()
    ce.denominator = float((labels != -100).sum())
    pieces = []
    counts = None
    for row in range(inputs.shape[0]):  # 4 pieces: e.g. dp 2 x 2 microbatches of one row each
        out = model(input_ids=inputs[row : row + 1], output_router_logits=True)
        c, p = router.layer_stats(out.router_logits)
        counts = c if counts is None else counts + c
        pieces.append((ce(out.logits, labels[row : row + 1]), p))
    assert counts is not None
    global_counts = router.reduce(counts)
    shares = [router.share(global_counts, p) for _, p in pieces]
    objective = sum(loss + router.coef * share for (loss, _), share in zip(pieces, shares, strict=True))
    aux = sum(s.detach() for s in shares)
    torch.testing.assert_close(objective, theirs.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(aux, theirs.aux_loss, rtol=1e-6, atol=1e-7)
    grads = torch.autograd.grad(objective, list(model.parameters()), allow_unused=True)
    for name, ours, ref in zip([n for n, _ in model.named_parameters()], grads, ref_grads, strict=True):
        if ref is None:
            assert ours is None or not ours.abs().any(), name
            continue
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7, msg=name)
    # the imbalance from the same counts, per layer on the whole batch
    worst = 0.0
    for logits in theirs.router_logits:
        top = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices.reshape(-1)
        load = torch.bincount(top, minlength=4).double()
        worst = max(worst, float(load.max() / load.mean()))
    assert router.last_imbalance == pytest.approx(worst, rel=1e-12)


def test_a_model_whose_config_leaves_the_aux_loss_out_keeps_cross_entropy_but_reports_the_imbalance() -> None:
    """`output_router_logits=False`: transformers' loss is cross-entropy alone, so ours is too (coef 0); the
    router logits still give the expert imbalance. A model without a router has no spec."""
    model = _tiny("mixtral", output_router_logits=False)
    assert router_aux_spec(model) == (4, 2, COEF, False)
    router = RouterAuxLoss.for_model(model)
    assert router is not None
    assert router.coef == 0.0
    from trainer.models import build_model, preset_spec

    llama = build_model(
        preset_spec("llama", hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=False, vocab_size=None),
        seed=0,
    )
    assert router_aux_spec(llama) is None
    assert RouterAuxLoss.for_model(llama) is None


def _save_qwen2_moe(folder: Path) -> None:
    """Qwen2-MoE with a dense first layer (`mlp_only_layers=[0]`): at pp 2 the first stage holds no router."""
    import transformers

    config = transformers.Qwen2MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=24, mlp_only_layers=[0], output_router_logits=True,
        router_aux_loss_coef=COEF, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(str(folder))


class _SharedRuns:
    """The model folders and single-process runs, made once per session and shared by the tests that need them."""

    def __init__(self, savers: dict[str, Any]) -> None:
        self.savers = savers
        self.folders: dict[str, Path] = {}
        self.runs: dict[str, Any] = {}

    def folder(self, family: str, tmp_path: Path) -> Path:
        if family not in self.folders:
            self.folders[family] = tmp_path / family
            self.savers[family](self.folders[family])
        return self.folders[family]

    def single(self, family: str, tmp_path: Path) -> Any:
        from conftest import PARITY, launch, without_preset_sizes

        if family not in self.runs:
            args = [*without_preset_sizes(PARITY), "--model-path", str(self.folder(family, tmp_path))]
            self.runs[family] = launch(args, nproc=1, out=tmp_path / f"{family}-single").check()
        return self.runs[family]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_router_loss_at_pp2_equals_the_single_process(tmp_path: Path, family: str) -> None:
    """`--pp 2` trains on the model's own objective too (each stage holds its own layers; the global top-k counts
    of every layer come from a counting pass, each stage injects its routers' share of the gradient): every step's
    loss (incl. coef x aux), aux and expert imbalance, and the final weights, equal the single process's (fp32,
    1e-5). Qwen2-MoE's first stage holds only a dense layer, and its layers are activation-checkpointed (a
    recomputation inside backward must neither count nor carry a share again). Mixtral's layers are compiled
    (`--compile`: the router and layer hooks that count and carry the shares run inside the compiled layer call)."""
    from conftest import PARITY, launch, without_preset_sizes
    from test_parity import RTOL, assert_weights_close

    single = SHARED.single(family, tmp_path)
    args = [*without_preset_sizes(PARITY), "--model-path", str(SHARED.folder(family, tmp_path)), "--pp", "2"]
    args += ["--activation-checkpointing"] if family == "qwen2_moe" else ["--compile"]
    pp2 = launch(args, nproc=2, out=tmp_path / f"{family}-pp2").check()
    assert pp2.summary["plan"]["router_aux"] == {"num_experts": 4, "top_k": 2, "coef": COEF}
    assert pp2.summary["compile"] is (family == "mixtral")
    assert pp2.summary["aux_loss_coef"] == COEF
    for key in ("losses", "aux_losses", "expert_imbalance"):
        assert len(pp2.summary[key]) == 3, key
        assert pp2.summary[key] == pytest.approx(single.summary[key], rel=RTOL), key
    assert_weights_close(pp2.final_weights(), single.final_weights(), rtol=RTOL)


def test_router_loss_at_tp2_with_sequence_and_loss_parallel_equals_the_single_process(tmp_path: Path) -> None:
    """`--tp 2 --sequence-parallel --loss-parallel` on Mixtral (transformers' own plan with its experts whole: the
    MoE block `sequence_gather`, router and experts on whole sequences on every tp rank): every step's loss (incl.
    coef x aux), aux, expert imbalance and gradient norm, and the final weights, equal the single process's (fp32,
    1e-5); the aux is counted once per tp group."""
    from conftest import PARITY, launch, without_preset_sizes
    from test_parity import RTOL, assert_weights_close

    single = SHARED.single("mixtral", tmp_path)
    args = [*without_preset_sizes(PARITY), "--model-path", str(SHARED.folder("mixtral", tmp_path)), "--tp", "2"]
    tp2 = launch([*args, "--sequence-parallel", "--loss-parallel"], nproc=2, out=tmp_path / "mixtral-tp2").check()
    plan = tp2.summary["plan"]["tensor_parallel"]
    assert plan["styles"]["model.layers.0.mlp"] == "sequence_gather", plan
    assert not any("experts" in name for name in plan["styles"]), plan
    assert (plan["sequence_parallel"], plan["loss_parallel"], plan["styles"]["lm_head"]) == (True, True, "colwise")
    for key in ("losses", "aux_losses", "expert_imbalance", "grad_norms"):
        assert len(tp2.summary[key]) == 3, key
        assert tp2.summary[key] == pytest.approx(single.summary[key], rel=RTOL), key
    assert_weights_close(tp2.final_weights(), single.final_weights(), rtol=RTOL)


def _save_mixtral(folder: Path) -> None:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=COEF, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(str(folder))


def test_mixtral_trains_on_its_own_objective_at_dp2_cp2_with_microbatches_as_in_one_process(tmp_path: Path) -> None:
    """The trainer end to end on a Mixtral folder: step 1's loss is transformers' own `loss` (CE + 0.02 x aux) on
    the first global batch; dp 2 x cp 2 (4 ranks: each holds half of its dp rows' tokens, load-balanced) with two
    microbatches of one row per rank trains like one process with one microbatch of four (loss incl. aux, aux and
    imbalance within 1e-5 each step, the final weights too); aux and the expert imbalance are reported apart
    (summary.json, TensorBoard). (`--pp 2`: test_router_loss_at_pp2_equals_the_single_process.)
    Loading (issue 23 §1): the folder's per-expert files (`experts.{e}.w1/w2/w3.weight`, which transformers stacks
    and fuses on load) are read block by block: each of the 4 ranks reads only the files of its FSDP2 quarter of
    every stack, so the ranks' bytes add up to the folder's exactly once and none reads more than its quarter."""
    from conftest import PARITY, launch, without_preset_sizes
    from test_parity import RTOL, assert_weights_close
    from trainer.config import parse_args
    from trainer.data import BatchStream
    from trainer.models import build_model
    from trainer.validation import validate

    folder = SHARED.folder("mixtral", tmp_path)
    args = [*without_preset_sizes(PARITY), "--model-path", str(folder)]
    cfg = parse_args([*args, "--out", str(tmp_path / "oracle")])
    validated = validate(cfg, world_size=1)
    # validation holds the meta structure only (the folder is read block by block by the run): the oracle loads it
    model, corpus = build_model(validated.spec, seed=cfg.seed), validated.corpus
    inputs, labels = BatchStream(corpus.train, seq_len=cfg.seq_len, global_batch=cfg.global_batch).next_batch()
    with torch.no_grad():
        own = model.train()(input_ids=inputs, labels=labels, shift_labels=labels, output_router_logits=True)

    single = SHARED.single("mixtral", tmp_path)
    report = tmp_path / "loading"
    dp2 = launch(
        [*args, "--dp", "2", "--cp", "2", "--microbatch-size", "1"],
        nproc=4,
        out=tmp_path / "dp2cp2",
        env={"AM_TRAIN_MEMORY_REPORT": str(report)},
    ).check()
    _assert_each_rank_read_its_quarter(folder, report)
    layout = dp2.summary["layout"]
    assert (layout["dp"], layout["cp"], layout["microbatches"]) == (2, 2, 2)
    for run in (single, dp2):
        summary = run.summary
        assert summary["aux_loss_coef"] == COEF
        assert len(summary["aux_losses"]) == len(summary["losses"]) == 3
        assert summary["final_aux_loss"] == summary["aux_losses"][-1]
        assert summary["losses"][0] == pytest.approx(float(own.loss), rel=1e-5)
        assert summary["aux_losses"][0] == pytest.approx(float(own.aux_loss), rel=1e-5)
        imbalance = summary["expert_imbalance"]
        assert len(imbalance) == 3
        assert all(1.0 <= value <= 4.0 for value in imbalance)
    for key in ("losses", "aux_losses", "expert_imbalance"):
        assert dp2.summary[key] == pytest.approx(single.summary[key], rel=1e-5), key
    assert_weights_close(dp2.final_weights(), single.final_weights(), rtol=RTOL)
    tb = single.summary["tensorboard"]
    if tb is not None:  # tensorboard installed: the aux loss is its own scalar
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(tb)
        events.Reload()
        logged = [event.value for event in events.Scalars("train/aux_loss")]
        assert logged == pytest.approx(single.summary["aux_losses"], rel=1e-6)


def test_progress_shows_the_aux_loss_apart_from_the_loss(capsys) -> None:
    from trainer.progress import Progress

    progress = Progress(total_steps=2, start_step=0, tokens_per_step=10, enabled=True)
    progress.update(step=1, loss=2.5, lr=1e-3, expert_imbalance=1.5, aux_loss=2.03125)
    progress.close()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "loss=2.5000, aux_loss=2.0312, experts max/mean=1.50," in line, line


def test_a_router_loss_of_another_rule_is_refused_before_any_process_group() -> None:
    """Doge adds a router loss of its own (not the Switch-Transformer function the trainer reproduces): refused by
    validation with the way out, never trained on cross-entropy alone."""
    from trainer.step_parts import router_aux_problems
    from trainer.validation import _feature_model_problems

    model = _tiny("doge")
    assert router_aux_spec(model) is None
    assert RouterAuxLoss.for_model(model) is None
    (problem,) = router_aux_problems(model)
    assert problem.startswith(
        "DogeForCausalLM trains with a router auxiliary loss (config output_router_logits=true, "
        f"router_aux_loss_coef={COEF}) that is not transformers' Switch-Transformer load_balancing_loss_func"
    ), problem
    assert 'set "output_router_logits": false' in problem
    from trainer.config import parse_args

    assert _feature_model_problems(parse_args(["--pp", "1"]), model=model, plan=None) == [problem]
    assert router_aux_problems(_tiny("mixtral")) == []


SHARED = _SharedRuns({"mixtral": _save_mixtral, "qwen2_moe": _save_qwen2_moe})


def _assert_each_rank_read_its_quarter(folder: Path, report: Path) -> None:
    import json

    from am_model_io import LazyCheckpoint

    with LazyCheckpoint(folder) as checkpoint:
        stored = checkpoint.meta_state_dict()
    total = sum(t.numel() * t.element_size() for t in stored.values())
    experts = sum(t.numel() * t.element_size() for key, t in stored.items() if ".experts." in key)
    assert experts > 0.5 * total, (experts, total)  # so a rank reading every expert file would read > half
    read = [json.loads((report / f"memory_rank{r}.json").read_text())["checkpoint_bytes_read"] for r in range(4)]
    assert sum(read) == total, (read, total)  # every byte once: no rank reads another's block
    # FSDP2 splits each tensor's dim 0 (one expert per rank); uneven dims (e.g. 2 layers' norms) round to a row
    assert all(abs(r - total / 4) < 0.02 * total for r in read), (read, total)
