"""MTP loss semantics (depth k predicts t+k+2, packed boundaries masked, sum × scaling / D) against references
computed independently here, plus PipelineCausalLMLoss on tensor and tuple outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _models import declare_output_names
from torch import nn

from am_model_contract import ModelContract, PipelineContract, conventional_contract
from am_pipelining import (
    MTPLossConfig,
    PipelineCausalLMLoss,
    StageOutput,
    calculate_mtp_loss,
    get_mtp_loss_scaling_factor,
    roll_tensor,
    shift_packed_tensor,
)

IGN = -100


def _sum_ce(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")


def _targets_by_definition(tokens, seq_ids, depth):
    """Targets of MTP depth k (0-based) from the raw token stream: position t predicts token t+k+2 of the same
    sequence. `tokens` has S+1 entries; the main labels are tokens[1:]."""
    seq = len(tokens) - 1
    out = []
    for t in range(seq):
        src = t + depth + 2
        ok = src <= seq and src - 1 < seq and seq_ids[src - 1] == seq_ids[t]
        out.append(tokens[src] if ok else IGN)
    return out


def test_worked_example_of_the_reference():
    labels = torch.arange(1, 9).unsqueeze(0)
    seq_idx = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    captured = []

    def capture(logits, targets):
        captured.append(targets.clone())
        return logits.sum() * 0

    calculate_mtp_loss(capture, mtp_per_depth_logits=[torch.zeros(1, 8, 4)] * 2, labels=labels, seq_idx=seq_idx)
    assert captured[0].tolist() == [[2, 3, 4, IGN, 6, 7, 8, IGN]]
    assert captured[1].tolist() == [[3, 4, IGN, IGN, 7, 8, IGN, IGN]]


def test_three_packed_sequences_match_the_definition_and_cu_seqlens_agrees():
    tokens = list(range(10, 20))  # S + 1 = 10 tokens -> S = 9
    widths = [3, 2, 4]
    seq_ids = [i for i, w in enumerate(widths) for _ in range(w)]
    labels = torch.tensor(tokens[1:]).unsqueeze(0)
    captured = []

    def capture(logits, targets):
        captured.append(targets.clone())
        return logits.sum() * 0

    logits = [torch.zeros(1, 9, 4)] * 3
    calculate_mtp_loss(capture, mtp_per_depth_logits=logits, labels=labels, seq_idx=torch.tensor([seq_ids]))
    for depth in range(3):
        assert captured[depth][0].tolist() == _targets_by_definition(tokens, seq_ids, depth)
    from_cu = []
    calculate_mtp_loss(
        lambda lg, t: from_cu.append(t.clone()) or lg.sum() * 0,
        mtp_per_depth_logits=logits,
        labels=labels,
        cu_seqlens=torch.tensor([0, 3, 5, 9]),
    )
    assert all(torch.equal(a, b) for a, b in zip(captured, from_cu, strict=True))


def test_mtp_value_is_sum_times_scaling_over_depths_with_lm_head():
    torch.manual_seed(0)
    head = nn.Linear(6, 11, bias=False)
    model = nn.Module()
    model.lm_head = head
    hidden = [torch.randn(2, 5, 6, requires_grad=True) for _ in range(2)]
    labels = torch.randint(0, 11, (2, 5))
    out = calculate_mtp_loss(
        _sum_ce, mtp_per_depth_h=hidden, labels=labels, model=model, scaling_factor=0.25, return_per_depth=True
    )
    manual = []
    for k, h in enumerate(hidden):
        target = torch.full_like(labels, IGN)
        target[:, : 5 - (k + 1)] = labels[:, k + 1 :]
        manual.append(_sum_ce(head(h), target))
    torch.testing.assert_close(out.loss, sum(manual) * 0.25 / 2)
    torch.testing.assert_close(torch.stack(out.per_depth_losses), torch.stack(manual))
    out.loss.backward()
    assert head.weight.grad is not None
    assert hidden[1].grad is not None


def test_mtp_argument_errors():
    labels = torch.zeros(1, 4, dtype=torch.long)
    logits = [torch.zeros(1, 4, 3)]
    with pytest.raises(ValueError, match="exactly one of"):
        calculate_mtp_loss(_sum_ce, labels=labels)
    with pytest.raises(ValueError, match=r"seq_idx\.shape"):
        calculate_mtp_loss(_sum_ce, mtp_per_depth_logits=logits, labels=labels, seq_idx=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cannot be combined"):
        calculate_mtp_loss(
            _sum_ce, mtp_per_depth_logits=logits, labels=labels, mtp_per_depth_targets=[labels], seq_idx=labels
        )
    with pytest.raises(ValueError, match="MTP target tensors"):
        calculate_mtp_loss(_sum_ce, mtp_per_depth_logits=logits, labels=labels, mtp_per_depth_targets=[labels] * 2)
    with pytest.raises(ValueError, match="lm_head module not found"):
        calculate_mtp_loss(_sum_ce, mtp_per_depth_h=[torch.zeros(1, 4, 2)], labels=labels, model=nn.Module())


def test_roll_tensor_zero_fills():
    t = torch.tensor([[1, 2, 3, 4]])
    assert roll_tensor(t, -1).tolist() == [[2, 3, 4, 0]]
    assert roll_tensor(roll_tensor(t, -1), -1).tolist() == roll_tensor(t, -2).tolist() == [[3, 4, 0, 0]]
    assert roll_tensor(t, 1).tolist() == [[0, 1, 2, 3]]
    assert roll_tensor(t, 0).tolist() == t.tolist()


def test_shift_packed_tensor_respects_boundaries_and_layouts():
    t = torch.arange(1, 9).reshape(1, 8)
    seq_idx = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    assert shift_packed_tensor(t, depth=1, seq_idx=seq_idx, fill_value=-1).tolist() == [[2, 3, 4, -1, 6, 7, 8, -1]]
    assert shift_packed_tensor(t, depth=2).tolist() == [[3, 4, 5, 6, 7, 8, 0, 0]]
    emb = torch.arange(16.0).reshape(1, 8, 2)
    shifted = shift_packed_tensor(emb, depth=1, seq_idx=seq_idx)
    assert shifted[0, 0].tolist() == emb[0, 1].tolist()
    assert shifted[0, 3].tolist() == [0.0, 0.0]
    seq_first = t.t().contiguous()  # [S, B]
    assert shift_packed_tensor(seq_first, depth=1, batch_dim=1, seq_dim=0).t().tolist() == [[2, 3, 4, 5, 6, 7, 8, 0]]
    with pytest.raises(ValueError, match="depth must be positive"):
        shift_packed_tensor(t, depth=0)
    with pytest.raises(ValueError, match="batch and sequence"):
        shift_packed_tensor(torch.zeros(3), depth=1)
    with pytest.raises(ValueError, match="must differ"):
        shift_packed_tensor(t, depth=1, batch_dim=1, seq_dim=1)
    with pytest.raises(ValueError, match=r"\(B, S\)"):
        shift_packed_tensor(t, depth=1, seq_idx=torch.zeros(1, 3))


class _MTPModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lm_head = nn.Linear(4, 7, bias=False)
        self.mtp_config = type("C", (), {"loss_scaling_factor": 0.5})()


def test_pipeline_loss_on_tensor_and_tuple_outputs():
    model = _MTPModel()
    assert get_mtp_loss_scaling_factor(model) == 0.5
    assert get_mtp_loss_scaling_factor(nn.Module()) == 0.1
    logits = torch.randn(2, 5, 7)
    h1 = torch.randn(2, 5, 4)
    labels = torch.randint(0, 7, (2, 5))
    loss_fn = PipelineCausalLMLoss(_sum_ce, model)
    torch.testing.assert_close(loss_fn(logits, labels), _sum_ce(logits, labels))
    expected = _sum_ce(logits, labels) + calculate_mtp_loss(
        _sum_ce, mtp_per_depth_h=[h1], labels=labels, model=model, scaling_factor=0.5
    )
    torch.testing.assert_close(loss_fn((logits, h1), labels), expected)
    assert list(loss_fn.parameters()) == [], "the loss must not own the stage's parameters"
    override = MTPLossConfig(scaling_factor=2.0).build(_sum_ce, model)
    expected_override = _sum_ce(logits, labels) + calculate_mtp_loss(
        _sum_ce, mtp_per_depth_h=[h1], labels=labels, model=model, scaling_factor=2.0
    )
    torch.testing.assert_close(override((logits, h1), labels), expected_override)
    model.eval()
    torch.testing.assert_close(loss_fn((logits, h1), labels), _sum_ce(logits, labels))


class _DeclaredMTPModel(_MTPModel):
    """Declares its last-stage tuple, like Nemotron: logits, D MTP hidden states, packed-sequence ids."""

    def am_contract(self) -> ModelContract:
        return ModelContract(pp=PipelineContract(output_names=("logits", "mtp_per_depth_h", "seq_idx")))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_pipeline_loss_reads_declared_outputs_by_name(dtype):
    """The trailing seq_idx is found by its declared name, whatever its dtype (nothing is guessed)."""
    model = _DeclaredMTPModel()
    logits, h1, h2 = torch.randn(1, 8, 7), torch.randn(1, 8, 4), torch.randn(1, 8, 4)
    labels = torch.randint(0, 7, (1, 8))
    seq_idx = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]], dtype=dtype)
    got = PipelineCausalLMLoss(_sum_ce, model)((logits, h1, h2, seq_idx), labels)
    expected = _sum_ce(logits, labels) + calculate_mtp_loss(
        _sum_ce, mtp_per_depth_h=[h1, h2], labels=labels, model=model, scaling_factor=0.5, seq_idx=seq_idx
    )
    torch.testing.assert_close(got, expected)
    named = StageOutput(logits, mtp_per_depth_h=(h1, h2), seq_idx=seq_idx)
    torch.testing.assert_close(PipelineCausalLMLoss(_sum_ce, _MTPModel())(named, labels), expected)
    with pytest.raises(ValueError, match="returned 1 tensors but pipeline_output_names"):
        PipelineCausalLMLoss(_sum_ce, model)((logits,), labels)


def test_grad_reduce_group_is_refused_not_ignored():
    """Upstream's grad_reduce_group stays in the signatures, but a value we cannot honour is an error."""
    labels = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="grad_reduce_group is not supported"):
        calculate_mtp_loss(
            lambda logits, target: logits.sum(),
            mtp_per_depth_logits=[torch.zeros(1, 4, 8)],
            labels=labels,
            grad_reduce_group=object(),
        )
    with pytest.raises(ValueError, match="grad_reduce_group is not supported"):
        PipelineCausalLMLoss(lambda logits, target: logits.sum(), None, grad_reduce_group=object())
    with pytest.raises(ValueError, match="grad_reduce_group is not supported"):
        MTPLossConfig().build(lambda logits, target: logits.sum(), None, grad_reduce_group=object())
    assert isinstance(MTPLossConfig().build(lambda logits, target: logits.sum(), None), PipelineCausalLMLoss)


def _with_loss(model, loss):
    """`model`'s conventional contract with `loss` as its declared training-loss rule (`pp.loss`)."""
    contract = conventional_contract(model)
    return dataclasses.replace(contract, pp=dataclasses.replace(contract.pp, loss=loss))


class _OwnLossModel(_MTPModel):
    """A stage module that owns its training-loss rule (`combined_loss`, declared in its contract as `pp.loss`): here
    the generic rule with every MTP depth weighted 3x, so a result computed without the hook differs."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def am_contract(self):
        return _with_loss(self, self.combined_loss)

    def combined_loss(self, output, labels, *, loss_fn, labels_shifted, seq_idx, scaling_factor, ignore_index):
        self.calls.append(
            {"labels_shifted": labels_shifted, "seq_idx": seq_idx, "scaling": scaling_factor, "ignore": ignore_index}
        )
        logits, *mtp = output
        scaling = 3 * (self.mtp_config.loss_scaling_factor if scaling_factor is None else scaling_factor)
        return loss_fn(logits, labels) + calculate_mtp_loss(
            loss_fn, mtp_per_depth_h=mtp, labels=labels, model=self, scaling_factor=scaling, seq_idx=seq_idx
        )


def test_pipeline_loss_calls_the_models_combined_loss_hook():
    """One rule: a model with `combined_loss` computes the pipeline's loss (labels already shifted, the stage's
    seq_idx tail or the cu_seqlens ids, the configured scaling and ignore_index handed on)."""
    model = _OwnLossModel()
    declare_output_names(model, ("logits", "mtp_per_depth_h", "seq_idx"))
    logits, h1 = torch.randn(1, 8, 7), torch.randn(1, 8, 4)
    labels = torch.randint(0, 7, (1, 8))
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    plain = _MTPModel()
    declare_output_names(plain, ("logits", "mtp_per_depth_h", "seq_idx"))
    generic = PipelineCausalLMLoss(_sum_ce, plain)((logits, h1, seq_idx), labels)

    got = PipelineCausalLMLoss(_sum_ce, model)((logits, h1, seq_idx), labels)
    expected = model.combined_loss(
        (logits, h1),
        labels,
        loss_fn=_sum_ce,
        labels_shifted=True,
        seq_idx=seq_idx,
        scaling_factor=None,
        ignore_index=IGN,
    )
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, generic), "the hook's rule, not the generic one"
    first = model.calls[0]
    assert first["labels_shifted"] is True
    assert first["scaling"] is None
    assert first["ignore"] == IGN
    assert torch.equal(first["seq_idx"], seq_idx)

    declare_output_names(model, ("logits", "mtp_per_depth_h"))  # no seq_idx tail: ids come from cu_seqlens
    packed = PipelineCausalLMLoss(_sum_ce, model, scaling_factor=2.0, ignore_index=-1)
    packed.cu_seqlens = torch.tensor([0, 3, 8])
    got = packed((logits, h1), labels)
    call = model.calls[-1]
    assert call["scaling"] == 2.0
    assert call["ignore"] == -1
    assert call["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    expected = model.combined_loss(
        (logits, h1), labels, loss_fn=_sum_ce, labels_shifted=True, seq_idx=seq_idx, scaling_factor=2.0, ignore_index=-1
    )
    torch.testing.assert_close(got, expected)


def test_pipeline_loss_uses_given_mtp_targets_instead_of_rolling_the_labels():
    """Precomputed MTP targets (context parallelism: computed on the whole sequence before sharding) replace the
    targets rolled from the local labels, in the generic rule and through the model's hook."""
    model = _MTPModel()
    logits, h1 = torch.randn(1, 8, 7), torch.randn(1, 8, 4)
    labels = torch.randint(0, 7, (1, 8))
    targets = torch.randint(0, 7, (1, 8))  # e.g. the next rank's labels reach the last positions
    loss = PipelineCausalLMLoss(_sum_ce, model)
    got = loss((logits, h1), labels, mtp_per_depth_targets=[targets])
    expected = _sum_ce(logits, labels) + 0.5 * _sum_ce(model.lm_head(h1), targets)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, loss((logits, h1), labels)), "rolled targets differ from the given ones"

    class _Hook(_MTPModel):
        def am_contract(self):
            return _with_loss(self, self.combined_loss)

        def combined_loss(self, output, labels, *, mtp_per_depth_targets=None, seq_idx=None, **options):
            self.seen = (mtp_per_depth_targets, seq_idx)
            return output[0].sum()

    hooked = _Hook()
    declare_output_names(hooked, ("logits", "mtp_per_depth_h", "seq_idx"))
    seq_idx = torch.zeros(1, 8, dtype=torch.int32)
    PipelineCausalLMLoss(_sum_ce, hooked)((logits, h1, seq_idx), labels, mtp_per_depth_targets=[targets])
    given, seen_seq_idx = hooked.seen
    assert len(given) == 1
    assert torch.equal(given[0], targets)
    assert seen_seq_idx is None, "the targets already respect documents"


def test_the_mtp_term_is_am_context_parallels_one_implementation() -> None:
    """calculate_mtp_loss is a caller of am_context_parallel.mtp_loss (the models call it too): same objects, and
    the same value as calling it directly with the shared target rule."""
    import am_context_parallel
    import am_pipelining

    assert am_pipelining.MTPLossOutput is am_context_parallel.MTPLossOutput
    assert am_pipelining.shift_packed_tensor is am_context_parallel.shift_packed_tensor
    labels = torch.tensor([[1, 2, 3, 0, 1, 2]])
    logits = [torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    direct = am_context_parallel.mtp_loss(
        logits, am_context_parallel.mtp_targets(labels, 2), loss_fn=_sum_ce, scaling_factor=0.5
    )
    torch.testing.assert_close(
        calculate_mtp_loss(_sum_ce, mtp_per_depth_logits=logits, labels=labels, scaling_factor=0.5), direct.loss
    )
