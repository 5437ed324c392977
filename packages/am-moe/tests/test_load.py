"""Expert load statistics: per-layer tokens per expert, max / mean, reset; one read per step.

Contract: every `GroupedExperts` of a model accumulates its routed (token, k) pairs per expert across forwards
(micro-batches) until reset; `expert_load` reports them per layer by qualified name with the imbalance max / mean.
The cross-rank sum (`group=`) is checked on real processes in test_parallel.py.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from am_moe import GroupedExperts, expert_load, reset_expert_load


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = nn.ModuleList(
        [GroupedExperts(4, 8, 8, gated=False, activation="relu2", grouped_mm="loop") for _ in range(2)]
    )
    for layer in layers:
        layer.init_weights(std=0.1)
    return nn.ModuleDict({"layers": layers, "head": nn.Linear(8, 8)})


def test_counts_accumulate_until_reset() -> None:
    model = _model()
    first, second = model["layers"][0], model["layers"][1]
    x = torch.randn(6, 8)
    index = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [1, 2], [3, 0]])
    mask = torch.tensor([True, True, True, True, True, False])
    for _ in range(2):  # two micro-batches
        first(x, index, torch.ones(6, 2), token_mask=mask)
    second(x, torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1))
    load = expert_load(model)
    assert set(load.tokens_per_expert) == {"layers.0", "layers.1"}
    assert load.tokens_per_expert["layers.0"].tolist() == [8, 6, 4, 2]
    assert load.tokens_per_expert["layers.1"].tolist() == [6, 0, 0, 0]
    ratios = load.max_over_mean()
    assert ratios["layers.0"] == 8 / 5
    assert ratios["layers.1"] == 4.0
    assert load.max_imbalance() == 4.0
    assert load.tokens_per_expert["layers.0"].device.type == "cpu"

    again = expert_load(model, reset=True)  # reading does not reset unless asked
    assert again.tokens_per_expert["layers.0"].tolist() == [8, 6, 4, 2]
    after = expert_load(model)
    assert after.tokens_per_expert["layers.0"].tolist() == [0, 0, 0, 0]
    assert math.isnan(after.max_over_mean()["layers.0"])
    assert math.isnan(after.max_imbalance())


def test_reset_and_models_without_experts() -> None:
    model = _model()
    model["layers"][0](torch.randn(2, 8), torch.tensor([[1], [2]]), torch.ones(2, 1))
    reset_expert_load(model)
    assert expert_load(model).tokens_per_expert["layers.0"].sum().item() == 0
    empty = expert_load(nn.Linear(2, 2))
    assert empty.tokens_per_expert == {}
    assert empty.max_imbalance() is None
