"""Tensor parallelism on real gloo processes: TP=2 against the single-process model, for HF architectures built from
their configs with the plans transformers declares, and for a toy model exercising the remaining styles.

One group of 2 processes for the whole module. Every case builds the model twice from the same seed (reference and
TP), feeds both the same batch, and returns the TP model's logits, loss and full (gathered) gradients; the tests
compare them with the single-process model computed in the pytest process.
Oracle: fp32, 1e-5 (TP computes the same products; only reductions are split over two ranks and re-summed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tp_dist import case_result, run_cases, run_group
from _tp_models import (
    ARCHS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    SEGMENTS,
    TOY_PLAN,
    VOCAB,
    GatherToy,
    SegmentedToy,
    Toy,
    hf_model,
)
from torch.distributed.tensor import DTensor

from am_tensor_parallel import (
    apply_tensor_parallel,
    count_collective_bytes,
    plan_tensor_parallel,
    vocab_parallel_cross_entropy,
)

# fp32: the sharded matmuls compute the same products; reductions split over 2 ranks are re-summed (a few ulps).
TOL = 1e-5
TP = 2
BATCH, SEQ = 2, 8
SP_ARCHS = ["Llama", "Qwen3", "Gemma", "Starcoder2", "Phi3"]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored positions
    return ids, labels


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _hf_step(arch: str, mesh: Any = None, **options: Any) -> dict[str, Any]:
    """Forward with labels (the model's own loss over gathered logits), backward; full logits, loss, gradients."""
    model = hf_model(arch)
    ids, labels = _batch()
    result: dict[str, Any] = {}
    if mesh is not None:
        plan = apply_tensor_parallel(model, mesh, **options)
        result["plan"] = plan.describe()
        attn = model.model.layers[0].self_attn
        if "q_proj" in dict(attn.named_children()):
            result["q_local"] = attn.q_proj.weight.to_local().shape[0]
            result["k_local"] = attn.k_proj.weight.to_local().shape[0]
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    result.update(logits=out.logits.detach(), loss=out.loss.detach(), grads=_grads(model))
    result["tied"] = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return result


def _loss_parallel_step(arch: str, mesh: Any) -> dict[str, Any]:
    model = hf_model(arch)
    apply_tensor_parallel(model, mesh, loss_parallel=True, sequence_parallel=True)
    ids, labels = _batch()
    logits = model(input_ids=ids).logits  # [B, S, V/tp]: this rank's vocabulary slice
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    loss = vocab_parallel_cross_entropy(logits, shifted, mesh=mesh)
    loss.backward()
    return {"local_logits": logits.detach(), "loss": loss.detach(), "grads": _grads(model)}


def _toy_step(mesh: Any = None) -> dict[str, Any]:
    model = Toy()
    ids, _ = _batch()
    result: dict[str, Any] = {}
    if mesh is not None:
        plan = apply_tensor_parallel(model, mesh, plan=TOY_PLAN)
        result["num_heads"] = model.attn.num_heads
        result["head_counts"] = {k: dict(v) for k, v in plan.head_counts.items()}
    logits = model(ids)
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    logits.backward(grad)
    result.update(logits=logits.detach(), grads=_grads(model))
    return result


def _segmented_step(mesh: Any = None) -> dict[str, Any]:
    """The toy whose mixer shards itself ("module" style); its shards' gradients gathered with gather_segments."""
    from am_tensor_parallel import gather_segments

    model = SegmentedToy()
    ids, _ = _batch()
    result: dict[str, Any] = {}
    if mesh is not None:
        plan = apply_tensor_parallel(model, mesh)
        result["styles"] = dict(plan.styles)
        result["local_packed_rows"] = model.mix.packed.weight.shape[0]
    logits = model(ids)
    logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)))
    grads = _grads(model)
    if mesh is not None:
        group = mesh.get_group()
        for name, dim in (("mix.packed.weight", 0), ("mix.packed.bias", 0), ("mix.down.weight", 1)):
            grads[name] = gather_segments(grads[name], SEGMENTS, group=group, dim=dim)
    result.update(logits=logits.detach(), grads=grads)
    return result


def _gather_toy_step(mesh: Any = None) -> dict[str, Any]:
    """The toy with a `sequence_gather` module, under sequence parallelism when `mesh` is given."""
    model = GatherToy()
    ids, _ = _batch()
    result: dict[str, Any] = {}
    if mesh is not None:
        plan = apply_tensor_parallel(model, mesh, sequence_parallel=True)
        result["styles"], result["norms"] = dict(plan.styles), list(plan.norms)
        result["mix_is_plain"] = not isinstance(model.whole.mix.weight, DTensor)
    logits = model(ids)
    logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)))
    result.update(logits=logits.detach(), grads=_grads(model))
    return result


def _meta_step(arch: str, mesh: Any) -> dict[str, Any]:
    """TP (with sequence parallelism) applied on the meta device, then each rank gives its own shards storage and
    the reference's values (torch's own split, no communication), as a trainer materializing per rank does; the
    forward refuses to run before `reduce_partial_grads`, then the step equals the single process."""
    from torch.distributed.tensor import distribute_tensor

    from am_tensor_parallel import reduce_partial_grads

    reference = hf_model(arch)
    with torch.device("meta"):
        model = hf_model(arch)
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    model.to_empty(device="cpu")
    values = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if isinstance(tensor, DTensor):
                tensor.to_local().copy_(
                    distribute_tensor(values[name], mesh, tensor.placements, src_data_rank=None).to_local()
                )
            else:
                tensor.copy_(values[name])
    ids, labels = _batch()
    try:
        model(input_ids=ids, labels=labels)
        refused = "no error"
    except RuntimeError as exc:
        refused = str(exc)
    reduced = reduce_partial_grads(model)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return {"refused": refused, "reduced": reduced, "loss": out.loss.detach(), "grads": _grads(model)}


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    cases: dict[str, Any] = {}
    for arch in ARCHS:
        cases[f"tp/{arch}"] = lambda arch=arch: _hf_step(arch, mesh)
    for arch in SP_ARCHS:
        cases[f"sp/{arch}"] = lambda arch=arch: _hf_step(arch, mesh, sequence_parallel=True)
    cases["loss_parallel/Llama"] = lambda: _loss_parallel_step("Llama", mesh)
    cases["toy"] = lambda: _toy_step(mesh)
    cases["segmented"] = lambda: _segmented_step(mesh)
    cases["sequence_gather"] = lambda: _gather_toy_step(mesh)
    cases["meta/Qwen3"] = lambda: _meta_step("Qwen3", mesh)

    def bytes_case() -> dict[str, Any]:
        found = {}
        for sp in (False, True):
            model = hf_model("Llama", num_hidden_layers=1)
            apply_tensor_parallel(model, mesh, sequence_parallel=sp)
            ids, labels = _batch()
            with count_collective_bytes() as stats:
                model(input_ids=ids, labels=labels).loss.backward()
            found[sp] = dict(stats.bytes)
        return found

    cases["bytes"] = bytes_case

    def odd_sequence_case() -> str:
        model = hf_model("Llama")
        apply_tensor_parallel(model, mesh, sequence_parallel=True)
        try:
            model(input_ids=torch.zeros(1, 7, dtype=torch.long))
        except ValueError as exc:
            return str(exc)
        return "no error"

    cases["odd_sequence"] = odd_sequence_case

    def bad_mesh_case() -> str:
        try:
            model = hf_model("Llama", num_key_value_heads=4)
            apply_tensor_parallel(model, mesh, plan=plan_tensor_parallel(model, tp=4))
        except ValueError as exc:
            return str(exc)
        return "no error"

    cases["bad_mesh"] = bad_mesh_case
    return run_cases(cases)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(TP, _worker, timeout=400)


def _check(got: dict[str, Any], expected: dict[str, Any]) -> None:
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=TOL, atol=TOL)
    assert set(got["grads"]) == set(expected["grads"])
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tp2_equals_single_process(results: Any, arch: str) -> None:
    """Logits, loss and every gathered gradient of TP=2 equal the single-process model's (fp32, 1e-5)."""
    expected = _hf_step(arch)
    for rank in range(TP):
        got = case_result(results, f"tp/{arch}", rank)
        torch.testing.assert_close(got["logits"], expected["logits"], rtol=TOL, atol=TOL)
        _check(got, expected)
        assert got["tied"] == expected["tied"]  # tied embeddings stay one parameter
        if "q_local" in got:  # heads sharded: each rank projects HEADS / tp query and KV_HEADS / tp kv heads
            assert got["q_local"] == HEADS // TP * HEAD_DIM
            assert got["k_local"] == KV_HEADS // TP * HEAD_DIM


@pytest.mark.parametrize("arch", SP_ARCHS)
def test_sequence_parallel_equals_single_process(results: Any, arch: str) -> None:
    expected = _hf_step(arch)
    for rank in range(TP):
        got = case_result(results, f"sp/{arch}", rank)
        torch.testing.assert_close(got["logits"], expected["logits"], rtol=TOL, atol=TOL)
        _check(got, expected)
        assert got["plan"]["sequence_parallel"]
        assert "model.norm" in got["plan"]["norms"]
        assert "model.layers.0.input_layernorm" in got["plan"]["norms"]


def test_tp_applied_on_the_meta_device_then_materialized_equals_single_process(results: Any) -> None:
    """A model sharded on the meta device (the real-size order: no rank holds the whole model), then given its
    shards: the same loss and gradients as the single process (Qwen3 with sequence parallelism: replicated norms and
    per-head q/k norms, whose partial gradients `reduce_partial_grads` sums once materialized; a forward before it
    is refused, never silently wrong)."""
    expected = _hf_step("Qwen3")
    for rank in range(TP):
        got = case_result(results, "meta/Qwen3", rank)
        assert "call am_tensor_parallel.reduce_partial_grads(model)" in got["refused"], got["refused"]
        assert got["reduced"] > 0  # the norms are replicated DTensors
        _check(got, expected)


def test_loss_parallel_equals_single_process(results: Any) -> None:
    """The head keeps its vocabulary shard; vocab_parallel_cross_entropy gives the model's own loss and gradients."""
    expected = _hf_step("Llama")
    shards = [case_result(results, "loss_parallel/Llama", rank) for rank in range(TP)]
    gathered = torch.cat([s["local_logits"] for s in shards], -1)
    torch.testing.assert_close(gathered, expected["logits"], rtol=TOL, atol=TOL)
    for got in shards:
        assert got["local_logits"].shape[-1] == VOCAB // TP
        _check(got, expected)


def test_toy_styles_equal_single_process(results: Any) -> None:
    """packed_colwise / packed_rowwise, local_colwise / local_rowwise under gather, embedding_colwise, colwise_rep,
    and an attention that reshapes with its `num_heads` attribute (set to the local head count)."""
    expected = _toy_step()
    for rank in range(TP):
        got = case_result(results, "toy", rank)
        assert got["num_heads"] == HEADS // TP
        assert got["head_counts"] == {"attn": {"num_heads": HEADS // TP}}
        torch.testing.assert_close(got["logits"], expected["logits"], rtol=TOL, atol=TOL)
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=TOL, atol=TOL, msg=name)


def test_sequence_gather_runs_a_module_on_whole_sequences(results: Any) -> None:
    """Under sequence parallelism a `sequence_gather` module (a causal running mean over the sequence: wrong on a
    shard) gets its positional and keyword inputs gathered, keeps plain whole parameters, runs its inner TP region
    with a replicated output, and hands back this rank's shard: logits and every gradient equal the single process."""
    expected = _gather_toy_step()
    for rank in range(TP):
        got = case_result(results, "sequence_gather", rank)
        assert got["styles"] == {
            "lm_head": "colwise_rep",
            "whole": "sequence_gather",
            "whole.inner.up": "colwise",
            "whole.inner.down": "rowwise",
        }
        assert got["norms"] == ["final_norm", "norm"]
        assert got["mix_is_plain"]
        torch.testing.assert_close(got["logits"], expected["logits"], rtol=TOL, atol=TOL)
        assert got["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=TOL, atol=TOL, msg=name)


def test_module_style_with_segments_equals_single_process(results: Any) -> None:
    """A module that shards itself (plan `{"": "module"}`): a packed projection of unequal segments split per segment
    (shard_segments), region_input / region_output around it; the gathered gradients equal the single process's."""
    expected = _segmented_step()
    for rank in range(TP):
        got = case_result(results, "segmented", rank)
        assert got["styles"] == {"mix": "module"}
        assert got["local_packed_rows"] == sum(SEGMENTS.values()) // TP
        torch.testing.assert_close(got["logits"], expected["logits"], rtol=TOL, atol=TOL)
        assert got["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=TOL, atol=TOL, msg=name)


def test_bytes_per_layer_match_the_formula(results: Any) -> None:
    """One Llama layer; activations [B, S, H] of A = 2*8*32*4 bytes, logits shard [B, S, V/tp] of G bytes.

    Without sequence parallelism (Megatron's 4 all-reduces per layer and step): forward, the attention and MLP
    outputs (2 A) and the vocabulary-parallel embedding (A); backward, the attention and MLP input gradients (one
    per region, not per projection: 2 A) and the head's input gradient (A); the head gathers its logits (G).
    With it, each all-reduce becomes a reduce-scatter of A plus an all-gather of A / tp, and the replicated norm
    weights' gradients (3 norms of H floats) are all-reduced."""
    act = BATCH * SEQ * 32 * 4
    logits_shard = BATCH * SEQ * VOCAB // TP * 4
    for rank in range(TP):
        got = case_result(results, "bytes", rank)
        assert got[False] == {"all_reduce": 6 * act, "all_gather": logits_shard}
        assert got[True] == {
            "reduce_scatter": 6 * act,
            "all_gather": 6 * act // TP + logits_shard,
            "all_reduce": 3 * 32 * 4,
        }


def test_sequence_length_not_divisible(results: Any) -> None:
    for rank in range(TP):
        assert "sequence length must be a multiple of 2" in case_result(results, "odd_sequence", rank)


def test_plan_for_another_tp_size(results: Any) -> None:
    for rank in range(TP):
        assert "the plan was made for tp=4" in case_result(results, "bad_mesh", rank)
