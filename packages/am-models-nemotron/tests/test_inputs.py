"""The forward's packing and masking inputs (upstream's contract), resolved by `inputs.resolve_batch_layout`.

Oracles: each document run alone through the same model (a packed row must give every document the logits, MTP
hidden states, losses and gradients it gets alone — whatever spelling the packing comes in), and transformers'
NemotronH where it supports the case (packing through restarting position_ids on a model without Mamba layers —
its plain-PyTorch Mamba path does not reset at documents —, mask mappings built by transformers' own mask functions).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from am_nemotron_helpers import VOCAB, assert_close_rel, hf_model, randomize_, tiny_hf_config, tokens
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask

from am_models_nemotron import (
    NemotronHForCausalLM,
    NemotronHybridCache,
    NemotronStateDictAdapter,
    resolve_batch_layout,
)

# fp32; packed and alone run the same ops on differently sized tensors (summation order only).
RTOL = 1e-5
DOC_LENGTHS = (7, 12, 5)


@pytest.fixture(scope="module")
def model() -> NemotronHForCausalLM:
    """Every block kind, conv kernel 4 and scan chunk 8 (documents cross chunk edges), two MTP depths."""
    torch.manual_seed(0)
    return randomize_(NemotronHForCausalLM(tiny_hf_config("ME*M-", mtp_depths=2)), seed=2).train()


def _docs() -> list[torch.Tensor]:
    return [tokens(1, n, seed=10 + n) for n in DOC_LENGTHS]


def _token_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")


def _packings(docs: list[torch.Tensor]) -> dict[str, dict]:
    """Every spelling of the same packed row of three documents (the last one: two slots of padding between)."""
    lengths = [d.shape[1] for d in docs]
    packed = torch.cat(docs, dim=1)
    seq_idx = torch.cat([torch.full((1, n), 5 + i) for i, n in enumerate(lengths)], dim=1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {
        "seq_idx": {"input_ids": packed, "seq_idx": seq_idx},
        "_packed_seq_ids": {"input_ids": packed, "_packed_seq_ids": seq_idx - 4},
        "position_ids": {"input_ids": packed, "position_ids": positions},
        "thd_row": {"input_ids": packed, "qkv_format": "thd", "cu_seqlens": cu, "max_seqlen": max(lengths)},
        "thd_flat": {"input_ids": packed[0], "qkv_format": "thd", "cu_seqlens": cu[None], "max_seqlen": 12},
        "cu_seqlens_and_seq_idx": {"input_ids": packed, "cu_seqlens": cu, "seq_idx": seq_idx},
    }


@pytest.mark.parametrize("spelling", sorted(_packings(_docs())))
def test_packed_row_gives_each_document_its_logits_and_mtp_states_alone(model, spelling: str) -> None:
    docs = _docs()
    with torch.no_grad():
        out = model(**_packings(docs)[spelling])
        start = 0
        for doc in docs:
            alone = model(doc)
            span = slice(start, start + doc.shape[1])
            assert_close_rel(out.logits[:, span], alone.logits, rtol=RTOL, what=f"{spelling} logits")
            for depth, (h, h_alone) in enumerate(zip(out.mtp_per_depth_h, alone.mtp_per_depth_h, strict=True)):
                assert_close_rel(h[:, span], h_alone, rtol=RTOL, what=f"{spelling} MTP depth {depth}")
            start += doc.shape[1]
    assert out.logits.shape == (1, sum(DOC_LENGTHS), VOCAB)


def test_thd_padded_slots_change_no_real_token(model) -> None:
    """cu_seqlens_padded: each sequence gets a slot with padding after its real tokens; the padding is excluded
    from routing, zeroed for Mamba, never attended to and never a target."""
    docs = _docs()
    slots = [n + 2 for n in DOC_LENGTHS]
    row = torch.zeros(1, sum(slots) + 3, dtype=torch.long)  # + 3 tokens past the last slot
    real = torch.zeros_like(row, dtype=torch.bool)
    start = 0
    for doc, slot in zip(docs, slots, strict=True):
        row[:, start : start + doc.shape[1]] = doc
        real[:, start : start + doc.shape[1]] = True
        start += slot
    row[~real] = 17
    cu = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()])
    cu_padded = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()])
    kwargs = {"qkv_format": "thd", "cu_seqlens": cu, "cu_seqlens_padded": cu_padded, "max_seqlen": max(slots)}
    gates = [b.mixer.gate for b in [*model.model.layers.values(), *model.mtp.layers] if b.block_type == "moe"]
    routed: list[int] = []
    hooks = [g.register_forward_hook(lambda _m, args, _o: routed.append(args[0].shape[0])) for g in gates]
    try:
        with torch.no_grad():
            out = model(row, labels=row, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    assert routed == [sum(DOC_LENGTHS)] * len(gates)
    other = row.masked_fill(~real, 29)
    with torch.no_grad():
        out_other = model(other, labels=other, **kwargs)
        assert_close_rel(out_other.logits[real], out.logits[real], rtol=1e-6, what="other padding")
        assert_close_rel(out_other.loss, out.loss, rtol=1e-6, what="loss ignores padding")
        start = 0
        for doc, slot in zip(docs, slots, strict=True):
            span = slice(start, start + doc.shape[1])
            assert_close_rel(out.logits[:, span], model(doc).logits, rtol=RTOL, what="padded THD document")
            start += slot


def test_packed_losses_and_every_gradient_equal_the_sum_over_documents(model) -> None:
    """Token sums: the packed next-token loss (num_items_in_batch normalization) and the combined loss with MTP
    (the helper with a token-sum loss_fn) equal the sums of each document alone; so do all parameter gradients."""
    docs = _docs()
    packed = torch.cat(docs, dim=1)
    seq_idx = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)], dim=1)
    count = 100.0

    def step(ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(ids, labels=ids, num_items_in_batch=count, **kwargs)
        combined = model.combined_loss(out, ids, loss_fn=_token_sum, seq_idx=kwargs.get("seq_idx"))
        return out.loss, combined

    model.zero_grad()
    loss, combined = step(packed, seq_idx=seq_idx)
    (loss + combined).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    loss_alone = combined_alone = 0.0
    for doc in docs:
        a, b = step(doc)
        (a + b).backward()
        loss_alone, combined_alone = loss_alone + a, combined_alone + b
    assert_close_rel(loss, loss_alone, rtol=RTOL, what="next-token loss")
    assert_close_rel(combined, combined_alone, rtol=RTOL, what="combined loss")
    assert packed_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert_close_rel(packed_grads[name], param.grad, rtol=RTOL, what=f"grad {name}")


def test_position_id_packing_matches_transformers_without_mamba() -> None:
    """transformers derives documents from restarting position_ids for its attention mask; on a model without Mamba
    layers (its Mamba path does not reset) both implementations then compute the same packed logits."""
    hf = hf_model(tiny_hf_config("*E-*"), seed=3)
    ours = NemotronHForCausalLM(hf.config).eval()
    ours.load_state_dict(NemotronStateDictAdapter(ours.config).from_hf(hf.state_dict()))
    ids = torch.cat(_docs(), dim=1)
    positions = torch.cat([torch.arange(n) for n in DOC_LENGTHS])[None]
    with torch.no_grad():
        expected = hf(ids, position_ids=positions, use_cache=False).logits  # (a cache disables its packing)
        actual = ours(ids, position_ids=positions).logits
        unpacked = ours(ids).logits
    assert_close_rel(unpacked, hf(ids).logits, rtol=RTOL, what="unpacked")
    assert_close_rel(actual, expected, rtol=RTOL, what="position_ids packing")
    assert not torch.allclose(unpacked, expected, atol=1e-3)  # the packing matters


def test_causal_mask_mapping_from_transformers_mask_functions(model) -> None:
    """A left-padded batch: transformers' own masks passed as causal_mask_mapping (and as an attention_mask dict)
    give the logits of the plain 2-D attention_mask on real tokens."""
    ids = tokens(2, 11, seed=8)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    embeds = model.model.embed_tokens(ids)
    config = model.config
    config._attn_implementation = "sdpa"
    hf_masks = {
        "full_attention": create_causal_mask(
            config=config, inputs_embeds=embeds, attention_mask=mask, past_key_values=None, position_ids=None
        ),
        "linear_attention": create_recurrent_attention_mask(
            config=config, inputs_embeds=embeds, attention_mask=mask, past_key_values=None
        ),
    }
    assert hf_masks["full_attention"] is not None
    real = mask.bool()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits[real]
        mapped = model(ids, causal_mask_mapping=hf_masks, padding_mask=~real).logits[real]
        as_dict = model(ids, attention_mask=hf_masks, padding_mask=~real).logits[real]
        additive = torch.zeros(hf_masks["full_attention"].shape).masked_fill(
            ~hf_masks["full_attention"], torch.finfo(torch.float32).min
        )
        float_mask = model(ids, causal_mask_mapping={"full_attention": additive}, padding_mask=~real).logits[real]
        only_padding = model(ids, padding_mask=~real).logits[real]
    for what, actual in (("mapping", mapped), ("dict", as_dict), ("additive", float_mask), ("padding", only_padding)):
        assert_close_rel(actual, expected, rtol=RTOL, what=what)


def test_padding_is_never_a_target_nor_predicts_one(model) -> None:
    ids = tokens(2, 10, seed=9)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[0, :2] = 0  # left padding: position 1 (padding) would predict the first real token
    labels = ids.clone()
    masked = labels.masked_fill(mask == 0, -100)  # right padding: pads are the targets of and after position 6
    with torch.no_grad():
        loss = model(ids, attention_mask=mask, labels=labels).loss
        logits = model(ids, attention_mask=mask).logits
    targets = masked[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1))
    assert_close_rel(loss, expected, rtol=RTOL, what="loss")


def test_bad_inputs_are_refused_with_every_problem_listed(model) -> None:
    ids = tokens(1, 12)
    with pytest.raises(ValueError, match="qkv_format='thd' needs cu_seqlens"):
        model(ids, qkv_format="thd")
    with pytest.raises(ValueError, match="qkv_format='sbhd'"):
        model(ids, qkv_format="sbhd")
    with pytest.raises(ValueError, match=r"one packed row, but the batch has 2 rows"):
        model(tokens(2, 12), cu_seqlens=torch.tensor([0, 12]))
    with pytest.raises(ValueError, match=r"(?s)must start at 0.*max_seqlen"):
        model(ids, cu_seqlens=torch.tensor([1, 12]), cu_seqlens_padded=torch.tensor([0, 6, 12]), max_seqlen=3)
    with pytest.raises(ValueError, match="shorter than the longest sequence"):
        model(ids, cu_seqlens=torch.tensor([0, 4, 12]), max_seqlen=5)
    with pytest.raises(ValueError, match="seq_idx and cu_seqlens describe different document boundaries"):
        model(ids, seq_idx=torch.zeros(1, 12), cu_seqlens=torch.tensor([0, 4, 12]))
    with pytest.raises(ValueError, match=r"(?s)sliding_attention.*seq_idx has shape"):
        model(ids, causal_mask_mapping={"sliding_attention": torch.ones(1)}, seq_idx=torch.zeros(2, 3))
    cache = NemotronHybridCache(model.config, 1)
    model.eval()(ids[:, :4], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="cannot be combined with a generation cache"):
        model(ids[:, 4:], past_key_values=cache, use_cache=True, seq_idx=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]))
    model.train()
    with pytest.raises(ValueError, match="cache_position"):
        model.eval()(ids, use_cache=True, cache_position=torch.arange(1, 13))
    model.train()
    with pytest.raises(ValueError, match="cp_size=2"):
        model(ids, cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match=r"mtp_per_depth_input_ids: expected 2 tensors"):
        model(ids, mtp_per_depth_input_ids=[ids])
    emb = model.model.embed_tokens(ids)
    with pytest.raises(ValueError, match="not both"):
        model(ids, emb, emb, mtp_per_depth_input_ids=[ids, ids])
    with pytest.raises(TypeError, match="not_an_option"):
        model(ids, not_an_option=1)


def test_mtp_inputs_from_per_depth_ids_or_embeddings_equal_the_shifted_default(model) -> None:
    """CP-style per-depth ids (shifted before sharding) and precomputed embeddings give the default MTP states."""
    ids = tokens(2, 9, seed=4)
    shifted = [torch.cat([ids[:, d + 1 :], ids.new_zeros(2, d + 1)], dim=1) for d in range(2)]
    positions = [torch.arange(9).expand(2, 9)] * 2
    with torch.no_grad():
        default = model(ids).mtp_per_depth_h
        by_ids = model(ids, mtp_per_depth_input_ids=torch.stack(shifted, 1), mtp_per_depth_position_ids=positions)
        by_embeds = model(ids, *[model.model.embed_tokens(s) for s in shifted])
    for d in range(2):
        assert_close_rel(by_ids.mtp_per_depth_h[d], default[d], rtol=0, what="per-depth ids")
        assert_close_rel(by_embeds.mtp_per_depth_h[d], default[d], rtol=0, what="per-depth embeddings")


def test_layout_resolution_canonicalizes_documents_and_unions_padding() -> None:
    layout = resolve_batch_layout(
        batch=1,
        seqlen=8,
        device=torch.device("cpu"),
        packed_seq_ids=torch.tensor([[1, 1, 0, 2, 2, 0, 0, 1]]),
        attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]),
    )
    assert layout.seq_idx.tolist() == [[0, 0, 1, 2, 2, 3, 3, 4]]
    assert layout.padding_mask.tolist() == [[True, False, True, False, False, True, True, False]]
    assert layout.key_mask.tolist() == [[0, 1, 0, 1, 1, 0, 0, 1]]
    plain = resolve_batch_layout(batch=2, seqlen=4, device=torch.device("cpu"), position_ids=torch.arange(4))
    assert plain.seq_idx is None
    assert plain.padding_mask is None
