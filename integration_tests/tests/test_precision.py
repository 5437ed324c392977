"""Precision: the default `--dtype bf16` is mixed precision (fp32 master weights and AdamW state, bf16 compute), so
updates smaller than a bf16 ulp still move the weights; `--dtype bf16-pure` (an opt-in, with a warning) stores bf16
and rounds them away.

Contract, checked on the HF export of the last checkpoint: with learning rate 1e-3 and no warm-up, every norm weight
(initialized to 1.0, where a bf16 step is 2^-8 below and 2^-7 above) has moved after 3 default steps, and is
bit-identical to its initial value after 3 bf16-pure steps. The initial values come from building the same seeded
model in this process.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, launch
from trainer.models import build_model, preset_spec

ARGS = ["--model", "llama", *TINY, "--lr", "1e-3", "--min-lr", "1e-3", "--warmup-steps", "0", "--no-progress"]
WARNING = "warning: --dtype bf16-pure stores weights and AdamW state in bf16"


@pytest.fixture(scope="module")
def initial_norms() -> dict[str, torch.Tensor]:
    spec = preset_spec("llama", hidden_size=32, num_layers=4, mtp_depths=0, tie_embeddings=False, vocab_size=None)
    model = build_model(spec, seed=1234)  # the trainer's default --seed
    norms = {name: p.detach().clone() for name, p in model.named_parameters() if "norm" in name}
    assert len(norms) == 9
    assert all(torch.all(t == 1.0) for t in norms.values())
    return norms


def test_default_mixed_precision_moves_every_norm_weight(tmp_path, initial_norms) -> None:
    run = launch(ARGS, nproc=1, out=tmp_path / "mixed").check()
    assert run.summary["dtype"] == "bf16"
    assert run.summary["precision"] == {"storage": "float32", "compute": "bfloat16", "reduce": "float32"}
    assert WARNING not in run.output
    weights = run.final_weights()
    assert all(w.dtype == torch.float32 for w in weights.values()), "fp32 master weights are what is exported"
    unchanged = [name for name, init in initial_norms.items() if torch.equal(weights[name], init)]
    assert not unchanged, f"norm weights never moved under mixed precision: {unchanged}"


def test_pure_bf16_is_an_opt_in_that_rounds_small_updates_away(tmp_path, initial_norms) -> None:
    run = launch([*ARGS, "--dtype", "bf16-pure"], nproc=1, out=tmp_path / "pure").check()
    assert run.summary["precision"] == {"storage": "bfloat16", "compute": "bfloat16", "reduce": "float32"}
    assert run.output.count(WARNING) == 1, run.output[-3000:]
    weights = run.final_weights()
    moved = [name for name, init in initial_norms.items() if not torch.equal(weights[name].float(), init)]
    assert not moved, f"expected bf16 storage to round these 1e-3 updates away: {moved}"
    assert weights["model.norm.weight"].dtype == torch.bfloat16
    assert run.summary["losses"][0] != run.summary["losses"][-1], "the run trained (other weights moved)"


@pytest.mark.parametrize("model", ["nemotron", "gemma4", "gemma4-moe"])
def test_every_preset_trains_under_the_default_mixed_precision(tmp_path, model: str) -> None:
    """The default `--dtype bf16` (fp32 storage, bf16 compute) runs each preset: fp32-pinned modules (final norms,
    routers) feed bf16 layers and heads, so a head that did not run in its compute dtype would fail here. (The parity
    tests run fp32; Llama's mixed run is above.)"""
    run = launch(["--model", model, *TINY, "--steps", "1", "--no-progress"], nproc=1, out=tmp_path / model).check()
    assert run.summary["precision"] == {"storage": "float32", "compute": "bfloat16", "reduce": "float32"}
    assert all(torch.isfinite(torch.tensor(run.summary["losses"])))
