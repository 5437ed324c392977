"""Parity: every parallel layout trains exactly like the single-process run of the same model and data.

Contract: fp32, 3 steps; the loss of every step and every final weight (the HF-format export of the last
checkpoint) equal the single-process run's within `RTOL` relative. Weights are compared per tensor by the Frobenius
norm of the difference over the norm of the reference (an element-wise relative error is meaningless for values
that cross zero). The references are the trainer itself at world size 1: the model's own loss is checked against
an independent oracle in test_units.py.
"""

from __future__ import annotations

import pytest
import torch

RTOL = 1e-5  # fp32: the layouts differ only in summation order (pipeline p2p, FSDP2 reduce-scatter, ring merges)

CASES = [
    ("nemotron-pp2-1f1b", "nemotron"),  # Nemotron-H with MTP, 1F1B
    ("nemotron-pp2-interleaved", "nemotron"),  # 2 stages per rank, Interleaved1F1B
    ("nemotron-pp2-dp2", "nemotron"),  # pipeline x FSDP2
    ("gemma4-moe-cp2-dp2", "gemma4-moe"),  # model-owned CP, MoE, x FSDP2 (FSDP2 over the flattened dp x cp axis)
    ("llama-tied-pp2", "llama-tied"),  # HF Llama, tied embeddings split across two stages
    ("nemotron-cp2", "nemotron"),  # Nemotron-H under CP: ring attention, Mamba2 state passing, MTP targets
    ("nemotron-pp2-cp2", "nemotron"),  # pipeline x CP (4 ranks): each stage runs its layers under the CP group
    ("gemma4-pp2-cp2", "gemma4"),  # Gemma 4 dense: pipeline (tied head across stages) x CP, sliding + full attention
    ("gemma4-moe-pp2", "gemma4-moe"),  # Gemma 4 MoE through the pipeline (padding mask passed to every stage)
    ("gemma4-moe-dp2-ep2", "gemma4-moe"),  # expert parallelism: each rank holds 2 of the 4 experts, all-to-all
    ("nemotron-pp2-dp2-ep2", "nemotron"),  # pipeline x EP (4 ranks): the MoE stage's experts over its dp ranks
    ("nemotron-dp2-ep2-cp2", "nemotron"),  # EP over the cp ranks, experts FSDP2-sharded over dp (4 ranks)
    ("nemotron-dp2-ep2", "nemotron"),  # EP over the dp ranks, Nemotron-H's balancing recipe
    ("gemma4-moe-aux-dp2-ep2", "gemma4-moe-aux"),  # EP, Gemma 4 MoE with the three aux loss terms on
    ("nemotron-dp2-ep2-ac", "nemotron"),  # EP x activation checkpointing (the all-to-all recomputed), balancing
    ("gemma4-moe-aux-dp2-ep2-ac", "gemma4-moe-aux"),  # the same for Gemma 4 MoE with its aux terms
    *[
        ("llama-tied-tp2", "llama-tied"),  # HF Llama's own base_model_tp_plan, vocabulary-parallel tied embedding
        ("nemotron-tp2", "nemotron"),  # attention / MLP by features, Mamba2 by heads and groups (plain shards), MTP
        ("gemma4-tp2-dp2", "gemma4"),  # FSDP2 over dp on top of the TP DTensors: 2-D (dp_cp, tp) parameters
        ("nemotron-pp2-tp2", "nemotron"),  # each pipeline stage sharded over its own tp group
        ("gemma4-moe-dp2-tp2-ep2", "gemma4-moe"),  # attention over tp, whole experts over ep (carved out of dp)
    ],
]
TP_CASES = CASES[-5:]


def assert_weights_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, rtol: float) -> None:
    assert actual.keys() == expected.keys(), f"different tensors: {sorted(actual.keys() ^ expected.keys())}"
    failures = []
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, f"{name}: {got.dtype} vs {want.dtype}"
        assert got.shape == want.shape, f"{name}: {tuple(got.shape)} vs {tuple(want.shape)}"
        error = (got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)
        if error > rtol:
            failures.append(f"{name}: relative error {error.item():.2e}")
    assert not failures, "weights differ from the single-process run:\n" + "\n".join(failures)


@pytest.mark.parametrize(("case", "reference"), CASES, ids=[case for case, _ in CASES])
def test_parallel_run_equals_single_process(runs, case: str, reference: str) -> None:
    """Loss at every step and the final weights equal the single-process run (fp32, RTOL)."""
    parallel, single = runs.get(case).check(), runs.get(reference).check()
    got, want = torch.tensor(parallel.summary["losses"]), torch.tensor(single.summary["losses"])
    assert got.shape == want.shape == (3,)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0)
    assert_weights_close(parallel.final_weights(), single.final_weights(), rtol=RTOL)


@pytest.mark.parametrize("reference", ["nemotron", "gemma4-moe", "llama-tied", "gemma4"])
def test_single_process_run_learns(runs, reference: str) -> None:
    """The reference runs really train: finite losses that change from step to step and non-zero gradients (a parity
    test against a run that does nothing would prove nothing)."""
    import math

    run = runs.get(reference).check()
    assert all(math.isfinite(loss) for loss in run.summary["losses"])
    assert all(norm > 0 for norm in run.summary["grad_norms"])
    assert len(set(run.summary["losses"])) == len(run.summary["losses"])


@pytest.mark.parametrize(
    ("case", "pp", "cp"), [("nemotron-cp2", 1, 2), ("nemotron-pp2-cp2", 2, 2), ("gemma4-pp2-cp2", 2, 2)]
)
def test_summary_records_the_cp_size_and_layout(runs, case: str, pp: int, cp: int) -> None:
    """summary.json's layout names the CP size and the CP layout that ran (both models use the contiguous one)."""
    layout = runs.get(case).check().summary["layout"]
    assert (layout["pp"], layout["dp"], layout["cp"]) == (pp, 1, cp)
    assert layout["cp_layout"] == "contiguous"


def test_summary_records_no_cp_layout_without_cp(runs) -> None:
    assert runs.get("nemotron").check().summary["layout"]["cp_layout"] is None


EP_CASES = [("gemma4-moe-dp2-ep2", "gemma4-moe", 1, 2, 1), ("nemotron-pp2-dp2-ep2", "nemotron", 2, 2, 1)]
EP_CASES += [("nemotron-dp2-ep2-cp2", "nemotron", 1, 2, 2)]


@pytest.mark.parametrize(("case", "reference", "pp", "dp", "cp"), EP_CASES, ids=[c[0] for c in EP_CASES])
def test_ep_summary_records_ep_and_the_global_expert_load(runs, case: str, reference: str, pp: int, dp: int, cp: int):
    """summary.json's layout and mesh name ep (no extra ranks: pp x dp x cp); the expert load imbalance of every
    step is the global batch's (counts summed over the data ranks, the worst layer over the pipeline stages), so it
    equals the single-process run's exactly (integer counts of the same routing)."""
    summary, single = runs.get(case).check().summary, runs.get(reference).check().summary
    layout = summary["layout"]
    assert (layout["pp"], layout["dp"], layout["cp"], layout["ep"]) == (pp, dp, cp, 2)
    assert summary["mesh"] == {"pp": pp, "dp": dp, "cp": cp, "ep": 2}
    assert single["layout"]["ep"] == 1
    imbalance = summary["expert_imbalance"]
    assert len(imbalance) == 3
    assert all(value >= 1.0 for value in imbalance), imbalance
    assert imbalance == single["expert_imbalance"]


def test_a_model_without_experts_records_no_expert_load(runs) -> None:
    assert runs.get("llama-tied").check().summary["expert_imbalance"] is None


EP_EXPORTS = [("gemma4-moe-dp2-ep2", "Gemma4ForCausalLM"), ("nemotron-pp2-dp2-ep2", "NemotronHForCausalLM")]


@pytest.mark.parametrize(("case", "hf_class"), EP_EXPORTS, ids=[case for case, _ in EP_EXPORTS])
def test_ep_export_loads_in_transformers_with_equal_logits(runs, case: str, hf_class: str) -> None:
    """The HF-format export of an EP run (experts gathered from their (expert_dp, ep) shards back to the file's
    keys: per expert for Nemotron-H, stacked for Gemma 4) loads into transformers' own class with every tensor
    present, and its logits equal our model class's on the same folder (fp32). With the parity test above (the
    exported weights equal the single-process run's) this proves the export of an EP run is complete and right."""
    import transformers
    from trainer.models import build_model, folder_spec

    run = runs.get(case).check()
    root = run.out / "checkpoints"
    folder = root / (root / "latest").read_text().strip() / "model"
    hf, info = getattr(transformers, hf_class).from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"], info
    assert not info["mismatched_keys"], info
    ours = build_model(folder_spec(folder), seed=1)  # our registered class, every weight from the folder
    if case.startswith("nemotron"):
        experts = {key for key in run.final_weights() if ".experts." in key}
        assert {f"backbone.layers.3.mixer.experts.{e}.up_proj.weight" for e in range(4)} <= experts, sorted(experts)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, ours.eval()(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("case", "reference"), TP_CASES, ids=[case for case, _ in TP_CASES])
def test_tp_grad_norm_and_summary(runs, case: str, reference: str) -> None:
    """Under TP the global gradient norm of every step equals the single process's (DTensor shards through their
    mesh, whole parameters once, Mamba2's plain shards summed over tp), and summary.json records tp: the layout,
    the mesh (tp innermost) and the plan's styles."""
    summary, single = runs.get(case).check().summary, runs.get(reference).check().summary
    got, want = torch.tensor(summary["grad_norms"]), torch.tensor(single["grad_norms"])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0)
    assert summary["layout"]["tp"] == 2
    assert single["layout"]["tp"] == 1
    assert summary["mesh"]["tp"] == 2
    assert "tp" not in single["mesh"]
    mesh = summary["plan"]["mesh"]
    assert mesh["axes"][-1] == "tp"
    assert mesh["shape"][-1] == 2
    styles = summary["plan"]["tensor_parallel"]["styles"]
    assert {"colwise", "rowwise"} <= set(styles.values()), styles
    assert single["plan"]["tensor_parallel"] is None


# Every Nemotron-H run balances with its recipe (the default); these are issue 25's layouts, plus CP and PP x CP.
BALANCE_CASES = [
    ("nemotron-dp2-ep2", "nemotron"),
    ("nemotron-pp2-dp2-ep2", "nemotron"),
    ("gemma4-moe-aux-dp2-ep2", "gemma4-moe-aux"),
    ("nemotron-dp2-ep2-cp2", "nemotron"),
    ("nemotron-pp2-cp2", "nemotron"),
    # activation checkpointing: a recomputed forward that counted again would change the biases and double the terms
    ("nemotron-dp2-ep2-ac", "nemotron"),
    ("gemma4-moe-aux-dp2-ep2-ac", "gemma4-moe-aux"),
]
BIAS_KEY = "e_score_correction_bias"


@pytest.mark.parametrize(("case", "reference"), BALANCE_CASES, ids=[case for case, _ in BALANCE_CASES])
def test_load_balancing_equals_single_process(runs, case: str, reference: str) -> None:
    """With load balancing on (Nemotron-H's recipe: bias update 1e-3 + sequence aux 1e-4; Gemma 4 MoE: the
    batch, sequence and z-loss terms by flag), the router biases after 3 steps are bit-identical to the single
    process's (the update is a sign of global integer counts), the balancing terms of every step equal its within
    RTOL, and the run records what it applied (loss and weights: test_parallel_run_equals_single_process)."""
    parallel, single = runs.get(case).check().summary, runs.get(reference).check().summary
    assert parallel["moe_balancing"] == single["moe_balancing"]
    assert parallel["plan"]["moe_balancing"] == single["moe_balancing"]
    if reference == "nemotron":
        assert single["moe_balancing"] == {
            "bias_update_rate": 1e-3, "aux_loss_coeff": 0.0, "seq_aux_loss_coeff": 1e-4, "z_loss_coeff": 0.0
        }  # fmt: skip
        got, want = runs.get(case).final_weights(), runs.get(reference).final_weights()
        biases = [name for name in want if name.endswith(BIAS_KEY)]
        assert biases, sorted(want)
        for name in biases:
            assert got[name].dtype == torch.float32
            assert torch.equal(got[name], want[name]), f"{name}: {got[name]} vs {want[name]}"
            assert want[name].abs().max() > 0, f"{name} never moved: the bias update did not run"
    terms, want_terms = parallel["moe_aux_losses"], single["moe_aux_losses"]
    assert terms.keys() == want_terms.keys() == {"moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss"}
    for name, values in want_terms.items():
        torch.testing.assert_close(torch.tensor(terms[name]), torch.tensor(values), rtol=RTOL, atol=0)
    on = [name for name, values in want_terms.items() if any(v != 0 for v in values)]
    assert on == (["moe_seq_aux_loss"] if reference == "nemotron" else list(want_terms)), want_terms


@pytest.mark.parametrize("case", ["nemotron-dp2-ep2-ac", "gemma4-moe-aux-dp2-ep2-ac"])
def test_activation_checkpointing_under_expert_parallelism_is_recorded(runs, case: str) -> None:
    """The checkpointed EP runs really checkpointed (summary.json), at ep 2."""
    summary = runs.get(case).check().summary
    assert summary["activation_checkpointing"] is True
    assert summary["layout"]["ep"] == 2


def test_gemma4_moe_aux_terms_change_the_training(runs) -> None:
    """The terms reach the router: the same Gemma 4 MoE run with and without them ends with different router
    weights, and the run without them (its recipe: all off) records no terms."""
    with_terms, without = runs.get("gemma4-moe-aux").check(), runs.get("gemma4-moe").check()
    assert without.summary["moe_aux_losses"] is None
    assert without.summary["moe_balancing"] == dict.fromkeys(
        ("bias_update_rate", "aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff"), 0.0
    )
    got, want = with_terms.final_weights(), without.final_weights()
    routers = [name for name in want if "router" in name and name.endswith("weight")]
    assert routers
    assert all(not torch.equal(got[name], want[name]) for name in routers), routers
