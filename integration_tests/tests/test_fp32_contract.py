"""fp32 contract: after bf16 storage (`--dtype bf16-pure`: the default, mixed precision, stores everything in fp32)
and the FSDP2 wrap, every fp32-pinned tensor is fp32 and holds its loaded value.

Nemotron-H pins the Mamba `_fp32_params` (A_log, dt_bias, D: FSDP2-sharded parameters in a group of their own) and
the router's `e_score_correction_bias` (buffers). The trainer (AM_TRAIN_FP32_REPORT) dumps, on every rank, each
pinned tensor gathered from its shards right after the wrap; the reference values come from building the same
seeded model in this process.
"""

from __future__ import annotations

import torch
from conftest import TINY, launch
from trainer.models import build_model, preset_spec


def test_pinned_tensors_are_fp32_and_exact_after_fsdp2_wrap(tmp_path) -> None:
    report = tmp_path / "fp32"
    args = ["--model", "nemotron", "--dp", "2", "--dtype", "bf16-pure", *TINY, "--steps", "1", "--no-progress"]
    launch(args, nproc=2, out=tmp_path / "run", env={"AM_TRAIN_FP32_REPORT": str(report)}).check()

    spec = preset_spec("nemotron", hidden_size=32, num_layers=4, mtp_depths=1, tie_embeddings=False, vocab_size=None)
    reference = build_model(spec, seed=1234)  # the trainer's default --seed
    loaded = dict(reference.named_parameters()) | dict(reference.named_buffers())
    for rank in range(2):
        facts = torch.load(report / f"fp32_rank{rank}.pt", weights_only=False)
        assert facts.pop("_violations") == []
        pinned = {name: fact for name, fact in facts.items()}
        kinds = {name.rsplit(".", 1)[-1] for name in pinned}
        assert {"A_log", "dt_bias", "D", "e_score_correction_bias"} <= kinds, kinds
        for name, fact in pinned.items():
            assert fact["dtype"] == "torch.float32", f"{name} is {fact['dtype']}"
            if "_fp32_params" in name:
                assert fact["dtensor"], f"{name} is not FSDP2-sharded"
            assert torch.equal(fact["value"], loaded[name]), f"{name} changed"
