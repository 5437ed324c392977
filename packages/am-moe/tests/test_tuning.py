"""`grouped_mm="auto"` chooses by measurement: once per process, the faster backend, reported with both timings.

Contract: where both `torch._grouped_mm` and the per-expert loop can run, the first forward times both on its own
rows (the timer is replaced here by a fixed one so the test does not depend on this machine's load) and keeps the
faster; later forwards and other modules of the same shapes reuse the choice without measuring; the measurement
leaves the module's gradients, load counters and the random stream untouched; whichever backend is chosen, outputs
and gradients equal the other backend's within fp32 tolerance; fake / meta inputs and inference mode are handled.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _moe_reference import random_routing

import am_moe.tuning as tuning
from am_moe import GroupedExperts, grouped_mm_auto_choices

# fp32: the same per-expert matmuls, grouped differently; a few ulps of values of order 1
FP32_TOL = 2e-6


class FakeClock:
    """Returns `seconds[backend]` for each timed call; the candidates are timed in `tuning.CANDIDATES` order."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.calls = seconds, 0

    def __call__(self, fn: Callable[[], None], device: str) -> float:
        torch.device(device)  # the real timer synchronises this device: it must be a device string torch parses
        fn()
        backend = tuning.CANDIDATES[self.calls % len(tuning.CANDIDATES)]
        self.calls += 1
        return self.seconds[backend]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "_CHOICES", {})


def _experts(backend: str = "auto", *, hidden: int = 16, inter: int = 12) -> GroupedExperts:
    torch.manual_seed(3)
    experts = GroupedExperts(8, hidden, inter, gated=True, activation="silu", grouped_mm=backend)
    experts.init_weights(std=0.2)
    return experts


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 16, generator=gen)
    index, weights = random_routing(20, 2, 8, generator=gen)
    return x, index, weights


@pytest.mark.parametrize(
    ("seconds", "winner"),
    [({"grouped_mm": 2.0, "loop": 1.0}, "loop"), ({"grouped_mm": 1.0, "loop": 3.0}, "grouped_mm")],
)
def test_auto_keeps_the_faster_backend_once_per_process(
    fresh: None, monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float], winner: str
) -> None:
    clock = FakeClock(seconds)
    monkeypatch.setattr(tuning, "_seconds", clock)
    experts = _experts()
    x, index, weights = _inputs()
    experts(x, index, weights)
    choice = experts.grouped_mm_choice
    assert choice is not None
    assert choice.backend == winner
    assert dict(choice.seconds) == seconds
    assert "measured (forward+backward on 40 rows" in choice.reason
    assert f"-> {winner}" in choice.reason
    assert "rule: torch._grouped_mm on cpu" in choice.reason
    assert clock.calls == tuning.REPEATS * len(tuning.CANDIDATES)
    assert grouped_mm_auto_choices() == {"cpu float32: 8 local experts, H=16, I=12, gated silu": choice}
    # the same module again, and another module of the same shapes: no new measurement, same choice
    experts(x, index, weights)
    other = _experts()
    other(x, index, weights)
    assert clock.calls == tuning.REPEATS * len(tuning.CANDIDATES)
    assert other.grouped_mm_choice == choice
    # other shapes are measured on their own
    _experts(hidden=32)(torch.randn(20, 32), index, weights)
    assert len(grouped_mm_auto_choices()) == 2


def test_measurement_changes_nothing_of_the_module(fresh: None) -> None:
    experts, twin = _experts(), _experts("grouped_mm")
    x, index, weights = _inputs()
    state = torch.get_rng_state()
    outs = [module(x.clone().requires_grad_(), index, weights) for module in (experts, twin)]
    assert torch.equal(torch.get_rng_state(), state)
    assert experts.grouped_mm_choice is not None  # it did measure
    assert experts.grouped_mm_choice.seconds
    assert experts.gate_up_proj.grad is None
    assert experts.down_proj.grad is None
    assert torch.equal(experts.tokens_per_expert, twin.tokens_per_expert)  # counted once
    torch.testing.assert_close(outs[0], outs[1], rtol=FP32_TOL, atol=FP32_TOL)


@pytest.mark.parametrize("forced", ["grouped_mm", "loop"])
def test_either_choice_gives_the_same_numbers(fresh: None, monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    """Whatever the measurement picks, outputs and all gradients equal the other backend's (fp32 tolerance)."""
    other = "loop" if forced == "grouped_mm" else "grouped_mm"
    monkeypatch.setattr(tuning, "_seconds", FakeClock({forced: 1.0, other: 2.0}))
    results = []
    for module in (_experts(), _experts(other)):
        x, index, weights = _inputs(seed=5)
        x.requires_grad_()
        weights.requires_grad_()
        module(x, index, weights).backward(torch.ones(20, 16))
        results.append(
            [module(x, index, weights).detach(), x.grad, weights.grad, module.gate_up_proj.grad, module.down_proj.grad]
        )
        assert module.grouped_mm_choice is not None
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=FP32_TOL, atol=FP32_TOL)


def test_no_measurement_without_real_rows(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock({"grouped_mm": 1.0, "loop": 2.0})
    monkeypatch.setattr(tuning, "_seconds", clock)
    experts = _experts()
    x, index, weights = _inputs()
    experts(x, index, weights, token_mask=torch.zeros(20, dtype=torch.bool))  # all padding: nothing to time
    assert clock.calls == 0
    assert grouped_mm_auto_choices() == {}
    assert experts.grouped_mm_choice is not None  # the rule's
    assert experts.grouped_mm_choice.seconds == ()
    with torch.inference_mode():  # forward only: inference tensors cannot require grad
        experts(x, index, weights)
    assert experts.grouped_mm_choice is not None
    assert "measured (forward on 40 rows" in experts.grouped_mm_choice.reason


def test_tuning_key_keeps_the_device_string_apart_from_the_gpu_model() -> None:
    """The first GPU run (H200) failed with "Invalid device string: 'cuda:0 sm90'": the GPU model was appended to
    the device the timer synchronises. The key holds both, apart, and describes both."""
    key = tuning.TuningKey("cuda:0", torch.bfloat16, 8, 64, 32, True, "silu", capability="sm90")
    assert torch.device(key.device) == torch.device("cuda", 0)
    assert key.describe().startswith("cuda:0 sm90 bfloat16: 8 local experts")
    assert tuning.TuningKey("cpu", torch.float32, 8, 64, 32, True, "silu").describe().startswith("cpu float32:")
