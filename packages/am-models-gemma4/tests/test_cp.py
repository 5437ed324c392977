"""Context parallelism on real gloo ranks: loss and every gradient equal the CP=1 run.

One 4-rank group is launched for the whole module. Cases run on the 4-rank CP mesh and on a (dp=2, cp=2) mesh
(two independent 2-rank CP groups), for dense and MoE text models and for the VLM with images split across ranks,
with packed documents and sequence lengths that need CP padding. The reference is the same model run on the
unsharded batch in the same process; CP gradients are summed over the CP group (`all_reduce_cp_gradients`).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _g4_configs import IMAGE_TOKEN, LAYER_TYPES, image_inputs, perturb_, text_config, vlm_config
from _g4_dist import case_result, run_cases, run_group
from torch.distributed.device_mesh import init_device_mesh

from am_context_parallel import all_reduce_cp_gradients, count_ring_bytes, make_cp_batch_and_ctx
from am_models_gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from am_moe import expert_load

# fp32 with a different summation order (ring merge of partial softmaxes, gradients summed over ranks): measured
# worst relative gradient error ~2e-5 of the tensor's largest entry.
LOSS_ATOL = 2e-6
GRAD_RTOL = 5e-5
SEQ = 27  # not a multiple of 2C for C = 2 or 4: the shard pads


def _text_batch(seed: int) -> dict[str, torch.Tensor]:
    """Row 0: two packed documents (11 + 16 tokens); row 1: 22 tokens then 5 padding. Labels already shifted."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, IMAGE_TOKEN - 4, (2, SEQ), generator=gen)
    doc_ids = torch.zeros(2, SEQ, dtype=torch.long)
    doc_ids[0, :11], doc_ids[0, 11:] = 1, 2
    doc_ids[1, :22] = 1
    ids[1, 22:] = 0
    positions = torch.cat([torch.arange(11), torch.arange(16)]).unsqueeze(0).repeat(2, 1)
    positions[1] = torch.arange(SEQ)
    labels = torch.full_like(ids, -100)
    same_doc_next = (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, 1:] > 0)
    labels[:, :-1] = torch.where(same_doc_next, ids[:, 1:], -100)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "attention_mask": (doc_ids > 0).long(),
        "_packed_seq_ids": doc_ids,
    }


def _vlm_batch(seed: int) -> dict[str, torch.Tensor]:
    """One row of 26 tokens with two images (4 soft tokens each) at 10..17, across the CP=2 shard boundary (14)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, IMAGE_TOKEN - 4, (1, 26), generator=gen)
    ids[0, 10:18] = IMAGE_TOKEN
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[labels == IMAGE_TOKEN] = -100
    pixel_values, positions = image_inputs(2, seed=seed)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixel_values, "image_position_ids": positions}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.item(), _grads(model)


def _cp_step(
    model: torch.nn.Module, mesh: Any, batch: dict[str, torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor], Any]:
    group = mesh["cp"].get_group()
    ctx, batch = make_cp_batch_and_ctx(mesh, dict(batch), model=model)
    with ctx(), count_ring_bytes() as stats:
        out = model(**batch)
        out.loss.backward()
    all_reduce_cp_gradients(model, group=group)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return float(loss), _grads(model), stats


def _compare(model: torch.nn.Module, mesh: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    ref_model = copy.deepcopy(model)
    ref_loss, ref_grads = _reference(ref_model, batch)
    cp_loss, cp_grads, stats = _cp_step(model, mesh, batch)
    worst = {}
    for name, ref in ref_grads.items():
        got = cp_grads.get(name)
        worst[name] = float("inf") if got is None else float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
    return {
        "loss": (cp_loss, ref_loss),
        "worst_grad": max(worst.items(), key=lambda kv: kv[1]),
        "missing_grads": sorted(set(ref_grads) - set(cp_grads)),
        "params": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "grad_max": {name: float(grad.abs().max()) for name, grad in cp_grads.items()},
        "num_grads": len(ref_grads),
        "sent_bytes": stats.forward_kv_bytes,
        "ring": (stats.calls, stats.setup_gathers),
    }


def _text_case(mesh: Any, *, moe: bool, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(text_config(moe=moe))
    perturb_(model, seed=seed)
    return _compare(model, mesh, _text_batch(seed))


def _vlm_case(mesh: Any, *, moe: bool, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(vlm_config(moe=moe))
    perturb_(model, seed=seed)
    return _compare(model, mesh, _vlm_batch(seed))


def _pipeline_layers_case(mesh: Any, *, seed: int, moe: bool = False) -> dict[str, Any]:
    """Layers called one by one as am-pipelining's stage forward calls them (no `attention_inputs`, a local mask
    or None, no padding_mask) inside the CP context: they must run the ring, not local attention on this rank's
    shard, and an MoE layer must keep the padding (the ring's document ids == 0) out of its experts.

    Returns the worst relative difference to the text model's own CP forward on the same shard, whether the
    per-expert routing counts are the same, and how many (token, k) pairs were routed.
    """
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(text_config(moe=moe))
    perturb_(model, seed=seed)
    text = model.model
    ctx, batch = make_cp_batch_and_ctx(mesh, _text_batch(seed), model=model)
    positions = batch["position_ids"]
    with ctx(), torch.no_grad():
        expected = text(
            input_ids=batch["input_ids"],
            position_ids=positions,
            padding_mask=batch["padding_mask"],
            _packed_seq_ids=batch["_packed_seq_ids"],
        ).last_hidden_state
        expected_load = expert_load(model, reset=True).tokens_per_expert
        hidden = text.embed_tokens(batch["input_ids"])
        local = torch.ones(1, 1, hidden.shape[1], hidden.shape[1], dtype=torch.bool).tril()  # a shard-local mask
        for key, layer in text.layers.items():
            kind = text.config.layer_types[int(key)]
            hidden = layer(
                hidden,
                None,
                shared_kv_states={},
                position_embeddings=text.rotary_emb(hidden, positions, kind),
                attention_mask=local if kind == "full_attention" else None,
                position_ids=positions,
                past_key_values=None,
            )
        got = text.norm(hidden)
        load = expert_load(model, reset=True).tokens_per_expert
    return {
        "diff": float((got - expected).abs().max() / expected.abs().max()),
        "same_load": load.keys() == expected_load.keys() and all(torch.equal(load[k], expected_load[k]) for k in load),
        "routed_pairs": sum(int(counts.sum()) for counts in load.values()),
        "real_tokens": int((~batch["padding_mask"].bool()).sum()),
    }


def _expect_error(make: Any, mesh: Any, batch: dict[str, torch.Tensor]) -> str:
    """The error every rank raises for an unsupported CP configuration (all ranks raise: no hang)."""
    model = make()
    ctx, batch = make_cp_batch_and_ctx(mesh, dict(batch), model=model)
    try:
        with ctx():
            model(**batch)
    except NotImplementedError as err:
        return str(err)
    return "no error"


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    cp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    cp2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    return run_cases(
        {
            "dense_cp2": lambda: _text_case(cp2, moe=False, seed=1),
            "moe_cp2": lambda: _text_case(cp2, moe=True, seed=2),
            "dense_cp4": lambda: _text_case(cp4, moe=False, seed=3),
            "moe_cp4": lambda: _text_case(cp4, moe=True, seed=4),
            "vlm_cp2": lambda: _vlm_case(cp2, moe=False, seed=5),
            "vlm_moe_cp2": lambda: _vlm_case(cp2, moe=True, seed=6),
            "pipeline_layers_cp4": lambda: _pipeline_layers_case(cp4, seed=7),
            "pipeline_layers_moe_cp4": lambda: _pipeline_layers_case(cp4, seed=10, moe=True),
            "dropout_cp2": lambda: _expect_error(
                lambda: Gemma4ForCausalLM(text_config(attention_dropout=0.1)), cp2, _text_batch(8)
            ),
            "vision_bidirectional_cp2": lambda: _expect_error(
                lambda: Gemma4ForConditionalGeneration(vlm_config(use_bidirectional_attention="vision")),
                cp2,
                {**_vlm_batch(9), "mm_token_type_ids": (_vlm_batch(9)["input_ids"] == IMAGE_TOKEN).long()},
            ),
        }
    )


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(4, _worker)


CASES = ["dense_cp2", "moe_cp2", "dense_cp4", "moe_cp4", "vlm_cp2", "vlm_moe_cp2"]


@pytest.mark.parametrize("case", CASES)
def test_cp_loss_and_gradients_match_cp1(results: list[dict[str, Any]], case: str) -> None:
    """Loss (global token mean) and every parameter gradient of the CP step equal the unsharded step."""
    for rank in range(4):
        got = case_result(results, case, rank)
        cp_loss, ref_loss = got["loss"]
        assert abs(cp_loss - ref_loss) <= LOSS_ATOL * max(1.0, abs(ref_loss)), (rank, cp_loss, ref_loss)
        assert not got["missing_grads"], f"rank {rank}: no CP gradient for {got['missing_grads']}"
        name, rel = got["worst_grad"]
        assert rel <= GRAD_RTOL, f"rank {rank}: gradient of {name} differs by {rel:.3g} (relative to its max)"


def test_embeddings_and_vision_tower_get_gradients_under_cp(results: list[dict[str, Any]]) -> None:
    """The model embeds its own shard and each rank runs the vision tower on the images, so every parameter of the
    embedding, the vision tower and the projector has a nonzero CP gradient on every rank (whose values
    `test_cp_loss_and_gradients_match_cp1` compares with the unsharded step)."""
    for rank in range(4):
        got = case_result(results, "vlm_cp2", rank)
        for prefix in ("model.language_model.embed_tokens.", "model.vision_tower.", "model.embed_vision."):
            params = [name for name in got["params"] if name.startswith(prefix)]
            assert params, f"no trainable parameters under {prefix}"
            no_grad = [name for name in params if not got["grad_max"].get(name)]
            assert not no_grad, f"rank {rank}: no (or an all-zero) CP gradient for {no_grad}"


def test_sliding_layers_fetch_only_the_neighbouring_chunk(results: list[dict[str, Any]]) -> None:
    """CP=4, 32 padded tokens (8 per rank), window 4: a sliding layer needs only the previous rank's K/V.

    Forward bytes rank r sends: 2 sliding layers × (1 if r < 3) + 2 full layers × (3 − r) K/V chunks, each chunk
    2 tensors of [B=2, Hkv, 8, d] fp32 (sliding: Hkv=2, d=8; full: Hkv=1, d=16 — both 1024 bytes).
    """
    chunk = 2 * 1024
    for rank in range(4):
        expected = 2 * (1 if rank < 3 else 0) * chunk + 2 * (3 - rank) * chunk
        assert case_result(results, "dense_cp4", rank)["sent_bytes"] == expected, rank


@pytest.mark.parametrize("case", ["dense_cp2", "moe_cp4", "vlm_cp2"])
def test_ring_is_set_up_once_per_step(results: list[dict[str, Any]], case: str) -> None:
    """Every attention layer of the step (forward and backward) reuses the setup the first layer gathered."""
    for rank in range(4):
        calls, setup_gathers = case_result(results, case, rank)["ring"]
        assert calls == len(LAYER_TYPES), (rank, calls)
        assert setup_gathers == 1, rank


def test_pipeline_stage_layer_calls_run_the_ring_under_cp(results: list[dict[str, Any]]) -> None:
    """am-pipelining calls the layers with transformers' (shard-local) masks; inside the CP context they must still
    attend across ranks — the same hidden states as the text model's CP forward, not local attention."""
    for rank in range(4):
        assert case_result(results, "pipeline_layers_cp4", rank)["diff"] <= 1e-6, rank


def test_pipeline_stage_moe_layers_keep_cp_padding_out_of_the_experts(results: list[dict[str, Any]]) -> None:
    """A stage forward passes no padding_mask under CP: the MoE layers take the padding (the sequence's own and the
    CP shard's) from the ring context's document ids, as the text model does — same hidden states, same per-expert
    routing counts, and only real tokens routed (top_k pairs each)."""
    top_k = text_config(moe=True).top_k_experts
    for rank in range(4):
        got = case_result(results, "pipeline_layers_moe_cp4", rank)
        assert got["diff"] <= 1e-6, rank
        assert got["same_load"], rank
        assert got["routed_pairs"] == top_k * got["real_tokens"] * len(LAYER_TYPES), (rank, got)


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("dropout_cp2", "attention_dropout=0.1 is not supported under context parallelism"),
        ("vision_bidirectional_cp2", "use_bidirectional_attention='vision') is not supported under context"),
    ],
)
def test_unsupported_cp_settings_raise_on_every_rank(results: list[dict[str, Any]], case: str, fragment: str) -> None:
    for rank in range(4):
        assert fragment in case_result(results, case, rank), rank
