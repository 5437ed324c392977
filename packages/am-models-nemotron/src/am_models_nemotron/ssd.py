"""The Mamba2 state-space-duality (SSD) scan in plain PyTorch: chunked (fast) and sequential (the definition).

What it is for: `ssd_chunked_scan` evaluates the selective SSM recurrence
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * (x_t ⊗ B_t),    y_t = C_t · h_t + D * x_t
in chunks of `chunk_size` tokens (quadratic within a chunk, a short recurrence over chunk states), with an initial
state (from a cache), packed-sequence resets (`seq_idx`) and the final state (for a cache). `ssd_sequential_scan`
is the token-by-token definition, used as the test oracle and the benchmark baseline.
What it must not do: import mamba_ssm (the CUDA kernels live behind `mamba2._kernels`), or round: all math is
fp32 (or fp64 when the inputs are fp64) whatever the input dtype.

Heads map to groups as `head // (heads / groups)`; B and C are never repeated per head (transformers' reference
repeats them), chunk states are kept per group as [state, heads_per_group * head_dim] matrices so every contraction
is one batched matmul without broadcast copies.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["segment_sum", "ssd_chunked_scan", "ssd_sequential_scan"]


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """Pairwise decay exponents within a chunk: out[..., i, j] = sum(a[..., j+1 : i+1]) for i >= j, else -inf.

    a: [..., Q] -> [..., Q, Q]. Computed as a masked cumulative sum (not cum_i - cum_j) so that long chunks do
    not lose precision to cancellation.
    """
    length = a.size(-1)
    expanded = a[..., None].expand(*a.shape, length)  # [..., k, j] = a_k
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = expanded.masked_fill(~strictly_lower, 0).cumsum(dim=-2)
    return sums.masked_fill(~torch.ones_like(strictly_lower).tril(0), -torch.inf)


class _IntraChunk(torch.autograd.Function):
    """y = (exp(segsum(a_cum)) * scores) @ x within each chunk, with a hand-written backward.

    a_cum: [b,c,h,Q] cumulative log-decays; scores: [b,c,g,Q,Q] (C_i · B_j per group); x: [b,c,h,Q,p] (dt-scaled).
    Returns [b,c,h,Q,p]. The causal mask is applied to the per-group scores (8x smaller than the per-head decays),
    and the decay exponent above the diagonal is set to 0, not -inf (exp of -inf is the slow path of the vectorised
    exp; the zeroed scores mask those entries anyway). The backward works in place on one [b,c,h,Q,Q] buffer:
    grad_mixing * decay gives the scores' gradient (summed over a group's heads), times the scores the exponent's,
    whose row sums minus column sums are the gradient of a_cum.
    """

    @staticmethod
    def forward(ctx: Any, a_cum: torch.Tensor, scores: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        batch, chunks, heads, q = a_cum.shape
        groups = scores.shape[2]
        upper = torch.ones(q, q, dtype=torch.bool, device=a_cum.device).triu(1)
        causal_scores = scores.masked_fill(upper, 0.0)
        # a_cum is non-increasing along a chunk (dt >= 0, A < 0), so the kept exponents are <= 0: no overflow.
        decay = (a_cum[..., :, None] - a_cum[..., None, :]).masked_fill_(upper, 0.0).exp_()
        mixing = (decay.view(batch, chunks, groups, heads // groups, q, q) * causal_scores[:, :, :, None]).view(
            batch, chunks, heads, q, q
        )
        x = x.contiguous()  # one copy, shared by the forward and the backward matmuls
        ctx.save_for_backward(causal_scores, x, decay, mixing)
        ctx.upper = upper
        return mixing @ x

    @staticmethod
    @once_differentiable  # second derivatives through the direct form raise (the factored form supports them)
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        causal_scores, x, decay, mixing = ctx.saved_tensors
        batch, chunks, heads, q, _ = decay.shape
        groups = causal_scores.shape[2]
        grad_a = grad_scores = grad_x = None
        grad_y = grad_y.contiguous()
        if ctx.needs_input_grad[2]:
            grad_x = mixing.transpose(-1, -2) @ grad_y
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, grad_x
        # grad_mixing, then in place: * decay (-> the scores' gradient per head), * scores (-> the exponent's).
        buffer = (grad_y @ x.transpose(-1, -2)).mul_(decay)  # [b,c,h,Q,Q]
        per_group = buffer.view(batch, chunks, groups, heads // groups, q, q)
        if ctx.needs_input_grad[1]:
            grad_scores = per_group.sum(dim=3).masked_fill_(ctx.upper, 0.0)
        if ctx.needs_input_grad[0]:
            grad_exponent = per_group.mul_(causal_scores[:, :, :, None]).view(batch, chunks, heads, q, q)
            grad_a = grad_exponent.sum(dim=-1) - grad_exponent.sum(dim=-2)
        return grad_a, grad_scores, grad_x


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan.

    x: [b, S, h, p]; dt: [b, S, h] (already softplus'ed and clamped); A: [h] (negative); B, C: [b, S, g, n];
    D: [h]; initial_state: [b, h, p, n]; seq_idx: [b, S] integer document ids, non-decreasing along each row.
    Returns y: [b, S, h, p] in fp32 (fp64 for fp64 inputs), and with `return_final_state` the state after the
    last token, [b, h, p, n].

    Packed rows: the state is reset where `seq_idx` changes; `initial_state` belongs to the document of the first
    token. S need not be a multiple of `chunk_size` (the tail chunk is zero-padded with dt = 0, which neither
    decays nor feeds the state).
    """
    batch, seqlen, heads, head_dim = x.shape
    groups, state = B.shape[-2], B.shape[-1]
    if heads % groups:
        raise ValueError(f"heads={heads} must be a multiple of groups={groups}")
    per_group = heads // groups
    q = chunk_size
    pad = (-seqlen) % q
    total = seqlen + pad
    chunks = total // q
    dtype = _compute_dtype(x)

    x32, dt32, b32, c32 = x.to(dtype), dt.to(dtype), B.to(dtype), C.to(dtype)
    if pad:
        x32 = F.pad(x32, (0, 0, 0, 0, 0, pad))
        dt32 = F.pad(dt32, (0, 0, 0, pad))
        b32 = F.pad(b32, (0, 0, 0, 0, 0, pad))
        c32 = F.pad(c32, (0, 0, 0, 0, 0, pad))
    a_cum = (dt32 * A.to(dtype)).view(batch, chunks, q, heads).permute(0, 1, 3, 2).cumsum(dim=-1)  # [b,c,h,Q]
    # B and C are small; made contiguous they keep every batched matmul below off its slow strided path (with both
    # operands permuted views, CPU bmm is several times slower).
    b_c = b32.view(batch, chunks, q, groups, state).permute(0, 1, 3, 2, 4).contiguous()  # [b,c,g,Q,n]
    c_c = c32.view(batch, chunks, q, groups, state).permute(0, 1, 3, 2, 4).contiguous()  # [b,c,g,Q,n]

    same_doc = start_ok = keep_chunk = None
    if seq_idx is not None:
        sid = seq_idx.to(torch.long)
        if pad:
            sid = torch.cat([sid, sid[:, -1:].expand(batch, pad)], dim=1)
        sid = sid.view(batch, chunks, q)
        same_doc = (sid[..., :, None] == sid[..., None, :])[:, :, None]  # [b,c,1,Q,Q]
        # The state entering chunk c belongs to the document of the token before it (the first token for c = 0).
        entering_tag = torch.cat([sid[:, :1, :1], sid[:, :-1, -1:]], dim=1)  # [b,c,1]
        start_ok = (sid == entering_tag)[:, :, None]  # [b,c,1,Q]
        keep_chunk = (entering_tag[..., 0] == sid[..., -1])[:, :, None]  # [b,c,1]

    # 1. Within each chunk: y_i += sum_{j<=i} (C_i · B_j) exp(cum_i - cum_j) dt_j x_j. Like mamba_ssm's kernels the
    # exponent is a difference of cumulative sums (one subtraction instead of a Q x Q cumulative sum).
    scores = c_c @ b_c.transpose(-1, -2)  # [b,c,g,Q,Q], per group: never repeated per head
    if same_doc is not None:
        scores = scores * same_doc
    # 2. Each chunk's own end state, per group as [n, (r p)]: sum_j B_j ⊗ exp(cum_last - cum_j) dt_j x_j.
    factored = _factored_form_is_safe(a_cum)
    if factored:
        intra, own_states, in_scale = _factored_intra_and_states(x32, dt32, a_cum, scores, b_c, same_doc, per_group)
    else:
        intra, own_states = _direct_intra_and_states(x32, dt32, a_cum, scores, b_c, same_doc, per_group)

    # 3. State passing over chunks (one short step per chunk).
    chunk_decay = torch.exp(a_cum[..., -1])  # [b,c,h]
    if keep_chunk is not None:
        chunk_decay = chunk_decay * keep_chunk
    chunk_decay = chunk_decay.view(batch, chunks, groups, 1, per_group, 1)
    own_states = own_states.view(batch, chunks, groups, state, per_group, head_dim)
    if initial_state is not None:
        running = initial_state.to(dtype).view(batch, groups, per_group, head_dim, state).permute(0, 1, 4, 2, 3)
    else:
        running = x32.new_zeros(batch, groups, state, per_group, head_dim)
    entering = []
    # unbind, not own_states[:, chunk]: the backward is one stack instead of a zero-filled full-size gradient
    # per indexing op.
    for decay_c, state_c in zip(chunk_decay.unbind(1), own_states.unbind(1), strict=True):
        entering.append(running)
        running = running * decay_c + state_c
    entering_states = torch.stack(entering, dim=1).view(batch, chunks, groups, state, per_group * head_dim)

    # 4. Contribution of the entering state: exp(cum_i) C_i · H_c.
    out_decay = torch.exp(a_cum)  # [b,c,h,Q]
    if start_ok is not None:
        out_decay = out_decay * start_ok
    from_state = (c_c @ entering_states).view(batch, chunks, groups, q, per_group, head_dim)  # [b,c,g,Q,r,p]
    out_decay = out_decay.view(batch, chunks, groups, per_group, q).transpose(-1, -2)[..., None]  # [b,c,g,Q,r,1]

    # 5. y = D x + intra (+ its per-head scale) + from_state * out_decay, accumulated in y's [b,c,Q,h,p] order: the
    # group-major terms enter as permuted views, so no separate transpose copy is made.
    def token_major(t: torch.Tensor) -> torch.Tensor:  # [b,c,g,Q,r,p|1] -> a [b,c,Q,g,r,p|1] view
        return t.permute(0, 1, 3, 2, 4, 5)

    if factored:
        intra = intra.view(batch, chunks, groups, q, per_group, head_dim)
        if D is not None:
            y = torch.addcmul(
                (x32 * D.to(dtype)[:, None]).view(batch, chunks, q, groups, per_group, head_dim),
                token_major(intra),
                token_major(in_scale),
            )
        else:
            y = token_major(intra * in_scale)
        y = torch.addcmul(y, token_major(from_state), token_major(out_decay))
    else:
        y = torch.addcmul(
            intra.view(batch, chunks, q, groups, per_group, head_dim), token_major(from_state), token_major(out_decay)
        )
        if D is not None:
            y = torch.addcmul(y.reshape(batch, total, heads, head_dim), x32, D.to(dtype)[:, None])
    y = y.reshape(batch, total, heads, head_dim)
    if pad:
        y = y[:, :seqlen]
    if return_final_state:
        return y, running.permute(0, 1, 3, 4, 2).reshape(batch, heads, head_dim, state)
    return y


# The factored intra-chunk form scales token j by exp(-(cum_j - mid)) and token i by exp(cum_i - mid), where mid is
# the middle of the chunk's cumulative log-decay. Exact in exact arithmetic; in floating point its outputs are as
# accurate as the direct form's while |cum - mid| stays far from the exponent range (near the fp32 bound the
# gradients of A and dt are a few times less accurate than the direct form's, still ~1e-5 relative). Bound per
# dtype: exp(30) ~ 1e13 leaves fp32 25 orders of magnitude of headroom for the activations.
_FACTORED_HALF_RANGE = {torch.float32: 30.0, torch.float64: 300.0}


def _factored_form_is_safe(a_cum: torch.Tensor) -> bool:
    """True when every chunk's decay range allows the factored form (one host sync)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(a_cum):  # a dry run (fake tensors, no values): the form a run with finite decays takes
        return True
    # max - min, not first - last: also right if a caller passes A > 0 (growing instead of decaying states).
    half_range = 0.5 * (a_cum.amax(dim=-1) - a_cum.amin(dim=-1)).detach()
    return bool(half_range.max() <= _FACTORED_HALF_RANGE[a_cum.dtype]) if half_range.numel() else True


def _factored_intra_and_states(
    x32: torch.Tensor,
    dt32: torch.Tensor,
    a_cum: torch.Tensor,
    scores: torch.Tensor,
    b_c: torch.Tensor,
    same_doc: torch.Tensor | None,
    per_group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Within-chunk outputs and chunk end states with the decay factored out of the Q x Q matrices.

    exp(cum_i - cum_j) = u_i / u_j with u = exp(cum - mid), so with x~_j = dt_j x_j / u_j (one [b,c,g,Q,(r p)]
    tensor, the layout both matmuls read):
        intra_i = u_i * sum_j scores_ij x~_j            (scores: per group, causal; u applied by the caller)
        state   = exp(cum_last - mid) * sum_j B_j ⊗ x~_j
    Every product is one batched matmul per group with (r p) columns, and no per-head Q x Q tensor exists.
    Returns intra [b,c,g,Q,(r p)] (without u), own states [b,c,g,n,(r p)] and u as [b,c,g,Q,r,1].
    """
    batch, chunks, heads, q = a_cum.shape
    groups = heads // per_group
    head_dim = x32.shape[-1]
    # mid only sets the scale of intermediate values; the result does not depend on it, so no gradient flows to it.
    mid = (0.5 * (a_cum[..., :1] + a_cum[..., -1:])).detach()  # [b,c,h,1]
    rel = a_cum - mid
    in_scale = torch.exp(rel)  # u, [b,c,h,Q]

    def group_major(t: torch.Tensor) -> torch.Tensor:  # [b,c,h,Q] -> contiguous [b,c,g,Q,r,1]
        return t.view(batch, chunks, groups, per_group, q).transpose(-1, -2).contiguous()[..., None]

    dt_c = dt32.view(batch, chunks, q, heads).permute(0, 1, 3, 2)  # [b,c,h,Q]
    # The small contiguous factor goes first: the product is then laid out [b,c,g,Q,r,p] (no extra copy).
    x_tilde = group_major(dt_c * torch.exp(-rel)) * x32.view(batch, chunks, q, groups, per_group, head_dim).permute(
        0, 1, 3, 2, 4, 5
    )
    x_tilde = x_tilde.view(batch, chunks, groups, q, per_group * head_dim)
    intra = scores.tril() @ x_tilde
    b_state = b_c if same_doc is None else b_c * same_doc[:, :, :, -1, :, None]  # only the last document's tokens
    own = (b_state.transpose(-1, -2) @ x_tilde).view(batch, chunks, groups, -1, per_group, head_dim)
    to_end = torch.exp(a_cum[..., -1] - mid[..., 0]).view(batch, chunks, groups, 1, per_group, 1)
    return intra, own * to_end, group_major(in_scale)


def _direct_intra_and_states(
    x32: torch.Tensor,
    dt32: torch.Tensor,
    a_cum: torch.Tensor,
    scores: torch.Tensor,
    b_c: torch.Tensor,
    same_doc: torch.Tensor | None,
    per_group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with the per-head decay matrices exp(cum_i - cum_j) built explicitly (any decay range).

    Returns intra [b,c,h,Q,p] (already decayed) and own states [b,c,g,n,(r p)].
    """
    batch, chunks, heads, q = a_cum.shape
    groups = heads // per_group
    head_dim = x32.shape[-1]
    x_dt = (x32 * dt32[..., None]).view(batch, chunks, q, heads, head_dim)  # natural layout [b,c,Q,h,p]
    intra = _IntraChunk.apply(a_cum, scores, x_dt.permute(0, 1, 3, 2, 4))  # [b,c,h,Q,p]
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b,c,h,Q]
    if same_doc is not None:
        to_end = to_end * same_doc[:, :, :, -1, :]
    weighted = (x_dt * to_end.permute(0, 1, 3, 2)[..., None]).view(batch, chunks, q, groups, per_group * head_dim)
    own = b_c.transpose(-1, -2) @ weighted.permute(0, 1, 3, 2, 4).contiguous()  # [b,c,g,n,(r p)]
    return intra.permute(0, 1, 3, 2, 4), own


def ssd_sequential_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, one token at a time (slow; the definition the chunked scan must equal).

    Shapes as in `ssd_chunked_scan`. Computes in fp32, or fp64 for fp64 inputs. Returns (y, final_state).
    """
    batch, seqlen, heads, head_dim = x.shape
    groups = B.shape[-2]
    dtype = _compute_dtype(x)
    x, dt, A, B, C = x.to(dtype), dt.to(dtype), A.to(dtype), B.to(dtype), C.to(dtype)
    B_h = B.repeat_interleave(heads // groups, dim=2)  # [b, S, h, n]
    C_h = C.repeat_interleave(heads // groups, dim=2)
    h = (
        initial_state.to(dtype).clone()
        if initial_state is not None
        else x.new_zeros(batch, heads, head_dim, B.shape[-1])
    )
    ys = []
    for t in range(seqlen):
        if seq_idx is not None and t > 0:
            boundary = (seq_idx[:, t] != seq_idx[:, t - 1]).to(dtype)[:, None, None, None]
            h = h * (1 - boundary)
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B_h[:, t, :, None, :]
        y = (h * C_h[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + D.to(dtype)[:, None] * x[:, t]
        ys.append(y)
    return torch.stack(ys, dim=1), h
