"""Checks of the router outputs handed to the experts, listing every problem at once.

What it is for: `routing_problems` inspects shapes and dtypes (metadata only, no device-to-host sync) so that an
expert-parallel layer can tell every rank about a bad input in its first collective and all ranks raise together;
`RoutingError` is what the experts raise. Index VALUES (out of range) are counted on the device by the dispatchers
and checked where the counts reach the host anyway.
`balanced_routing` is the one routing it computes: the fake balanced gate of `BackendConfig.fake_balanced_gate`
(benchmarks and tests of the expert path without a trained router).
What it must not do: compute a model's routing (routers live in the model packages) or read tensor values.
"""

from __future__ import annotations

import math

import torch

__all__ = ["RoutingError", "balanced_routing", "routing_problems"]


class RoutingError(ValueError):
    """Router outputs that the experts cannot take (shapes, dtypes, index values); the message lists every problem."""


def routing_problems(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    token_mask: torch.Tensor | None,
    *,
    num_experts: int,
    hidden_size: int,
) -> list[str]:
    """Every shape/dtype problem of `(hidden [T, H], top_k_index [T, K] int, top_k_weights [T, K] float,
    token_mask [T] bool | None)` for `num_experts` experts of width `hidden_size`; empty when all is well."""
    problems = []
    if hidden_states.dim() != 2 or hidden_states.shape[-1] != hidden_size:
        problems.append(
            f"hidden_states must be [tokens, {hidden_size}] (flatten batch and sequence first), got "
            f"{list(hidden_states.shape)}"
        )
    if not hidden_states.is_floating_point():
        problems.append(f"hidden_states must be floating point, got {hidden_states.dtype}")
    tokens = hidden_states.shape[0] if hidden_states.dim() >= 1 else None
    if top_k_index.dim() != 2:
        problems.append(f"top_k_index must be [tokens, top_k], got {list(top_k_index.shape)}")
    else:
        if tokens is not None and top_k_index.shape[0] != tokens:
            problems.append(f"top_k_index has {top_k_index.shape[0]} rows but hidden_states has {tokens} tokens")
        top_k = top_k_index.shape[1]
        if top_k < 1:
            problems.append("top_k_index has no columns: every token needs at least one expert (top_k >= 1)")
        if top_k > num_experts:
            problems.append(
                f"top_k={top_k} is larger than the number of experts ({num_experts}): a token cannot pick "
                "more distinct experts than exist"
            )
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        problems.append(f"top_k_index must be an integer tensor (expert ids), got {top_k_index.dtype}")
    if top_k_weights.shape != top_k_index.shape:
        problems.append(
            f"top_k_weights {list(top_k_weights.shape)} and top_k_index {list(top_k_index.shape)} must have the "
            "same shape [tokens, top_k]"
        )
    if not top_k_weights.is_floating_point():
        problems.append(f"top_k_weights must be floating point, got {top_k_weights.dtype}")
    if token_mask is not None:
        if token_mask.dtype != torch.bool:
            problems.append(f"token_mask must be bool (True = route the token), got {token_mask.dtype}")
        if tokens is not None and tuple(token_mask.shape) != (tokens,):
            problems.append(f"token_mask must be [tokens] = [{tokens}], got {list(token_mask.shape)}")
    devices = {t.device for t in (hidden_states, top_k_index, top_k_weights)}
    if token_mask is not None:
        devices.add(token_mask.device)
    if len(devices) > 1:
        problems.append(f"hidden_states, top_k_index, top_k_weights and token_mask are on different devices {devices}")
    return problems


def out_of_range_message(count: int, num_experts: int) -> str:
    return f"{count} routing indices are out of range [0, {num_experts}) (padding tokens excluded)"


def balanced_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    device: torch.device | str | None = None,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fake, perfectly balanced router: `(weights [T, K] fp32 = 1/K, index [T, K] int64)`.

    Pair j = t * K + k goes to expert `j mod E`, so every expert gets `T*K // E` or one more pair (exactly the same
    number when E divides T*K) and a token's K experts are distinct (K <= E). With `noise > 0` each token's scores
    (1 for its balanced experts, 0 elsewhere) get `noise * N(0, 1)` added before the top-k, which moves some pairs to
    other experts (a realistic, controllable imbalance for benchmarks). No parameter takes part: a model using it
    gives its router no gradient.

    Raises:
        ValueError: non-positive sizes, top_k > num_experts, or a negative or non-finite noise.
    """
    problems = []
    for name, value in (("num_tokens", num_tokens), ("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_tokens" else 1):
            problems.append(f"{name}={value!r} must be a {'non-negative' if name == 'num_tokens' else 'positive'} int")
    if not problems and top_k > num_experts:
        problems.append(f"top_k={top_k} is larger than num_experts={num_experts}")
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not math.isfinite(noise) or noise < 0:
        problems.append(f"noise={noise!r} must be a finite number >= 0")
    if problems:
        raise ValueError("balanced_routing: " + "; ".join(problems))
    index = torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k) % num_experts
    if noise > 0:
        scores = torch.zeros(num_tokens, num_experts, device=device).scatter_(1, index, 1.0)
        noise_sample = torch.randn(
            scores.shape, generator=generator, device=generator.device if generator is not None else None
        )
        scores = scores + noise * noise_sample.to(scores.device)
        index = scores.topk(top_k, dim=-1).indices
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, device=device)
    return weights, index
