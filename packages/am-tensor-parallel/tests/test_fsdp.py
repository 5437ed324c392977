"""FSDP2 over dp on top of TP DTensors (4 gloo ranks: dp=2 x tp=2, tp innermost), with and without sequence
parallelism: gradients equal the single-process model's on the whole batch (fp32, 1e-5).

Each dp rank takes its half of the batch; FSDP2 averages the gradients over dp, which equals the single-process
mean loss's gradients because both halves have the same number of labelled tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tp_dist import case_result, run_cases, run_group
from _tp_models import VOCAB, hf_model
from torch.distributed.tensor import DTensor

from am_tensor_parallel import apply_tensor_parallel

TOL = 1e-5  # fp32; reductions over dp and tp re-summed in another order
BATCH, SEQ = 4, 8


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")

    def case(sequence_parallel: bool) -> Any:
        def run() -> dict[str, Any]:
            model = hf_model("Llama")
            apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            ids = _batch()[dp_rank * BATCH // 2 : (dp_rank + 1) * BATCH // 2]
            model(input_ids=ids, labels=ids).loss.backward()
            q_proj = model.model.layers[0].self_attn.q_proj.weight
            return {
                "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters() if isinstance(p.grad, DTensor)},
                "q_mesh": q_proj.device_mesh.mesh_dim_names,
            }

        return run

    return run_cases({"fsdp_tp": case(False), "fsdp_sp": case(True)})


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(4, _worker, timeout=400)


@pytest.mark.parametrize("name", ["fsdp_tp", "fsdp_sp"])
def test_fsdp2_on_tensor_parallel_equals_single_process(results: Any, name: str) -> None:
    reference = hf_model("Llama")
    ids = _batch()
    reference(input_ids=ids, labels=ids).loss.backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for rank in range(4):
        got = case_result(results, name, rank)
        assert got["q_mesh"] == ("dp", "tp")  # 2-D: FSDP2 over dp outside, TP innermost
        assert set(got["grads"]) == set(expected)
        for param, grad in expected.items():
            torch.testing.assert_close(got["grads"][param], grad, rtol=TOL, atol=TOL, msg=param)
