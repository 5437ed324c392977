"""routing_problems: shape/dtype checks of router outputs, without reading tensor values.

Contract: well-formed inputs give no problem; each malformed aspect is named (the experts raise them all at once,
see test_experts.py); the check never syncs with the device (it works on meta tensors).
"""

from __future__ import annotations

import torch

from am_moe import routing_problems


def test_well_formed_inputs_have_no_problem() -> None:
    problems = routing_problems(
        torch.zeros(5, 8),
        torch.zeros(5, 2, dtype=torch.int32),
        torch.zeros(5, 2, dtype=torch.bfloat16),
        torch.ones(5, dtype=torch.bool),
        num_experts=4,
        hidden_size=8,
    )
    assert problems == []


def test_metadata_only() -> None:
    meta = {"device": "meta"}
    problems = routing_problems(
        torch.empty(5, 8, **meta),
        torch.empty(5, 5, dtype=torch.long, **meta),
        torch.empty(5, 5, **meta),
        None,
        num_experts=4,
        hidden_size=8,
    )
    assert problems == [
        "top_k=5 is larger than the number of experts (4): a token cannot pick more distinct experts than exist"
    ]


def test_zero_top_k_and_device_mismatch() -> None:
    problems = routing_problems(
        torch.zeros(3, 8),
        torch.zeros(3, 0, dtype=torch.long),
        torch.zeros(3, 0, device="meta"),
        None,
        num_experts=4,
        hidden_size=8,
    )
    assert any("at least one expert" in p for p in problems)
    assert any("different devices" in p for p in problems)
