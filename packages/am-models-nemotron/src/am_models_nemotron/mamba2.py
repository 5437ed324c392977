"""The Mamba2 mixer of Nemotron-H: in-projection, causal depthwise conv, SSD scan, gated grouped RMSNorm,
out-projection.

What it is for: one module with three paths that compute the same function —
  - full sequence (training / eval without a cache): conv + chunked scan, packed-sequence resets via `seq_idx`;
  - prefill (a cache is given): the same, and the final conv window and SSM state are written to the cache;
  - decode (the cache holds a previous state and one token arrives): one recurrence step;
  - context parallel (`cp=Mamba2CPContext(group)`): this rank's contiguous block of the sequence, exactly equal to
    the full-sequence path's rows — conv halo and state passing across ranks live in `mamba2_cp`.
Plain PyTorch by default on every device. When `mamba_ssm` and `causal_conv1d` are installed and the tensors live on
CUDA, the full-sequence path uses their kernels instead (same numbers within kernel tolerance).
What it must not do: import mamba_ssm / causal_conv1d at import time (they are looked up with `find_spec` and
imported inside `_kernels`), or store A_log / dt_bias / D in anything but fp32: they live in the `_fp32_params`
holder, which `_keep_in_fp32_modules_strict` pins.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from am_precision import BackendConfig, initialize_linear_module

from ._init import reset_linear_, weight_of
from .backend import resolve_backend
from .config import NemotronConfig
from .mamba2_cp import Mamba2CPContext, conv_halo_width, prepend_conv_halo, ssd_chunked_scan_cp
from .ssd import ssd_chunked_scan
from .tp_plan import MAMBA2_TP_PLAN, Mamba2HeadParallel, mamba2_full_state, mamba2_shard_state, mamba2_tp_problems

__all__ = [
    "CPU_SCAN_CHUNK_SIZE",
    "Mamba2FP32Params",
    "Mamba2Mixer",
    "MambaRMSNormGated",
    "mamba_kernels_available",
]

# The scan's result does not depend on the chunk length (beyond fp32 rounding). On the CPU the plain-PyTorch scan is
# fastest with chunks of about 64 tokens (Q x Q intermediates vs. the per-chunk state recurrence), so CPU tensors use
# min(config.chunk_size, CPU_SCAN_CHUNK_SIZE); elsewhere the config's chunk_size is used, as the kernels do.
CPU_SCAN_CHUNK_SIZE = 64


def mamba_kernels_available(tensor: torch.Tensor) -> bool:
    """True when `tensor` is on CUDA and both mamba_ssm and causal_conv1d are installed (nothing is imported)."""
    return (
        tensor.is_cuda
        and importlib.util.find_spec("mamba_ssm") is not None
        and importlib.util.find_spec("causal_conv1d") is not None
    )


def _kernels() -> tuple[Any, Any]:
    from causal_conv1d import causal_conv1d_fn
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return causal_conv1d_fn, mamba_chunk_scan_combined


class _CausalConv(torch.autograd.Function):
    """Causal depthwise conv in the [B, S, C] layout: out[t] = bias + sum_k x[t - k] * weight[:, -1 - k] * keep_k[t].

    x: [B, S, C]; weight: [C, K] with K <= S; bias: [C] or None; same: [B, S, K - 1] bool or None — tap k >= 1 of
    position t counts only where `same[..., k - 1]` (packed rows: x[t - k] lies in t's document). Same forward as
    the autograd shift-and-add; the backward accumulates the input gradient in place on shifted views and saves only
    x, the weight and the boolean masks (no per-tap products, no zero-filled slice gradients).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, same: torch.Tensor | None
    ) -> torch.Tensor:
        taps, seqlen = weight.shape[1], x.shape[1]
        padded = F.pad(x, (0, 0, taps - 1, 0))
        out = x * weight[:, -1]
        for shift in range(1, taps):
            tap = padded[:, taps - 1 - shift : taps - 1 - shift + seqlen]
            if same is not None:
                tap = tap * same[..., shift - 1, None].to(x.dtype)
            out = torch.addcmul(out, tap, weight[:, -1 - shift])
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x, weight, same)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable  # second derivatives raise instead of silently missing terms
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, same = ctx.saved_tensors
        taps = weight.shape[1]
        grad_x = grad_w = grad_b = None

        def masked(shift: int) -> torch.Tensor:  # grad[t] for the positions where tap `shift` counted
            part = grad[:, shift:]
            return part if same is None else part * same[:, shift:, shift - 1, None].to(grad.dtype)

        if ctx.needs_input_grad[0]:
            grad_x = grad * weight[:, -1]
            for shift in range(1, taps):
                grad_x[:, :-shift].addcmul_(masked(shift), weight[:, -1 - shift])
        if ctx.needs_input_grad[1]:
            columns = [(grad * x).sum(dim=(0, 1))]
            columns += [(masked(shift) * x[:, : x.shape[1] - shift]).sum(dim=(0, 1)) for shift in range(1, taps)]
            grad_w = torch.stack(columns[::-1], dim=-1)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(dim=(0, 1))
        return grad_x, grad_w, grad_b, None


class Mamba2FP32Params(nn.Module):
    """fp32 holder of the per-head SSM parameters `A_log`, `dt_bias`, `D` (each [heads], always fp32).

    A separate module so that casting and FSDP2 can treat it as its own unit (`skip_modules=("_fp32_params",)`,
    `_keep_in_fp32_modules_strict`); its forward returns the three tensors so FSDP2's pre-forward hook fires.
    It returns copies, not the parameters themselves: FSDP2 frees the unsharded parameter storage right after this
    forward (`reshard_after_forward=True`), and the mixer uses the values later.
    """

    def __init__(self, num_heads: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        # Upstream's construction values (A = -1..-H, dt_bias 1, D 1); the mixer's init_weights re-draws dt_bias.
        heads = torch.arange(1, num_heads + 1, device=device, dtype=torch.float32)
        self.A_log = nn.Parameter(torch.log(heads))
        self.dt_bias = nn.Parameter(torch.ones(num_heads, device=device, dtype=torch.float32))
        self.D = nn.Parameter(torch.ones(num_heads, device=device, dtype=torch.float32))
        self.A_log._no_weight_decay = True  # type: ignore[attr-defined]
        self.D._no_weight_decay = True  # type: ignore[attr-defined]

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        full = [getattr(p, "full_tensor", None) for p in (self.A_log, self.dt_bias, self.D)]
        a_log, dt_bias, d = (
            f() if callable(f) else p.clone() for f, p in zip(full, (self.A_log, self.dt_bias, self.D), strict=True)
        )
        return a_log, dt_bias, d


class MambaRMSNormGated(nn.Module):
    """Gated grouped RMSNorm (norm after gate): y = weight * rmsnorm_per_group(x * silu(gate)), math in fp32.

    x, gate: [..., I] -> [..., I] in x's dtype. Groups are contiguous slices of `group_size` channels.
    """

    def __init__(
        self,
        hidden_size: int,
        group_size: int,
        eps: float = 1e-5,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.group_size = group_size
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.float()
        if gate is not None:
            h = h * F.silu(gate.float())
        *prefix, width = h.shape
        grouped = h.view(*prefix, width // self.group_size, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        # Same order as transformers: cast back, then scale (keeps bf16 parity with the reference).
        return self.weight * grouped.view(*prefix, width).to(input_dtype)


class Mamba2Mixer(nn.Module):
    """Mamba2 mixer. hidden_states: [B, S, H] -> [B, S, H].

    Parameters: `in_proj` H -> [z (I) | xBC (I + 2GN) | dt (heads)], depthwise `conv1d` over xBC, the fp32 holder
    `_fp32_params` (A_log, dt_bias, D), gated `norm`, `out_proj` I -> H.
    """

    # am-tensor-parallel: the mixer shards itself by heads and groups (Megatron's layout, tp_plan.py)
    _tp_plan: ClassVar[Any] = MAMBA2_TP_PLAN
    tensor_parallel_problems = mamba2_tp_problems
    tensor_parallel_full_state = mamba2_full_state  # its plain-tensor shards, re-assembled (checkpoints, HF export)
    tensor_parallel_shard_state = mamba2_shard_state  # the inverse: full tensors -> this rank's shards (meta builds)

    def tensor_parallel_style(self, *, sequence_parallel: bool = False) -> Mamba2HeadParallel:
        return Mamba2HeadParallel(sequence_parallel=sequence_parallel)

    def __init__(
        self,
        config: NemotronConfig | Any,
        layer_idx: int,
        *,
        backend: BackendConfig | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        config = NemotronConfig.from_any(config)  # a raw transformers / NVIDIA config works too
        backend = resolve_backend(backend, owner=type(self).__name__)  # None -> the plain-PyTorch default
        self.layer_idx = layer_idx
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.n_groups = config.n_groups
        self.ssm_state_size = config.ssm_state_size
        self.chunk_size = config.chunk_size
        self.conv_kernel = config.conv_kernel
        self.intermediate_size = config.mamba_intermediate_size
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.ssm_state_size
        self.time_step_limit = config.time_step_limit
        self._time_step_init = (config.time_step_min, config.time_step_max, config.time_step_floor)
        if config.mamba_hidden_act not in ("silu", "swish"):
            raise ValueError(f"mamba_hidden_act={config.mamba_hidden_act!r} is not supported; Nemotron-H uses 'silu'.")

        projection = self.intermediate_size + self.conv_dim + self.num_heads
        self.in_proj = initialize_linear_module(
            backend.linear, config.hidden_size, projection, bias=config.use_bias, device=device, dtype=dtype
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.conv_kernel,
            groups=self.conv_dim,
            padding=self.conv_kernel - 1,
            bias=config.use_conv_bias,
            device=device,
            dtype=dtype,
        )
        self._fp32_params = Mamba2FP32Params(self.num_heads, device=device)
        self.norm = MambaRMSNormGated(
            self.intermediate_size,
            group_size=self.intermediate_size // self.n_groups,
            eps=config.layer_norm_epsilon,
            device=device,
            dtype=dtype,
        )
        self.out_proj = initialize_linear_module(
            backend.linear, self.intermediate_size, config.hidden_size, bias=config.use_bias, device=device, dtype=dtype
        )

    # Read-only views; the parameters live in the fp32 holder (state-dict key `mixer.A_log` in HF checkpoints).
    @property
    def A_log(self) -> torch.Tensor:
        return self._fp32_params.A_log

    @property
    def dt_bias(self) -> torch.Tensor:
        return self._fp32_params.dt_bias

    @property
    def D(self) -> torch.Tensor:
        return self._fp32_params.D

    @torch.no_grad()
    def init_weights(self, *, num_hidden_layers: int, rescale_prenorm_residual: bool) -> None:
        """A_log = log(1..heads), D = 1, dt_bias = softplus⁻¹(dt) with dt log-uniform in [time_step_min, max]."""
        t_min, t_max, t_floor = self._time_step_init
        heads = self.num_heads
        device = self.A_log.device
        self.A_log.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32, device=device)))
        self.D.fill_(1.0)
        dt = torch.exp(torch.rand(heads, device=device) * (math.log(t_max) - math.log(t_min)) + math.log(t_min)).clamp(
            min=t_floor
        )
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.conv1d.reset_parameters()
        self.norm.reset_parameters()
        reset_linear_(self.in_proj)
        reset_linear_(self.out_proj)
        weight = weight_of(self.out_proj)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if rescale_prenorm_residual:
            weight.div_(math.sqrt(num_hidden_layers))

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        cache: Any | None = None,
        attention_mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        cp: Mamba2CPContext | None = None,
    ) -> torch.Tensor:
        """hidden_states: [B, S, H]; attention_mask: [B, S] (1 keep, 0 pad) zeroes padded positions;
        seq_idx: [B, S] document ids of packed rows; cache: a `NemotronHybridCache` (prefill or decode).

        cp: context parallelism — this rank holds one contiguous block of every row (S = S_local) and the result
        equals those rows of the single-process forward of the whole sequence (`mamba2_cp`); seq_idx must then hold
        GLOBAL document ids. A group of size 1 runs the single-process path. Collective over the CP group."""
        batch, seqlen, _ = hidden_states.shape
        dtype = hidden_states.dtype
        if cp is not None and cp.size == 1:
            cp = None
        if cp is not None:
            self._check_cp_inputs(hidden_states, cache=cache, seq_idx=seq_idx)
        if attention_mask is not None:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(dtype)
        projected = self.in_proj(hidden_states)
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        a_log, dt_bias, d_skip = self._fp32_params()
        A = -torch.exp(a_log.float())

        if cache is not None and cache.has_previous_state and seqlen == 1:
            y = self._decode_step(xbc[:, 0], dt[:, 0], A, dt_bias, d_skip, cache)[:, None]
        else:
            initial_state = None
            history = 0
            if cache is not None:
                conv_state = cache.conv_states[self.layer_idx]  # [B, C, K]: the last K inputs
                if cache.has_previous_state:
                    # Continuing a cached sequence with several tokens: the conv reads the cached inputs first.
                    history = self.conv_kernel - 1
                    xbc = torch.cat([conv_state[..., 1:].transpose(1, 2).to(xbc.dtype), xbc], dim=1)
                    initial_state = cache.ssm_states[self.layer_idx]
                window = F.pad(xbc.transpose(1, 2), (max(self.conv_kernel - xbc.shape[1], 0), 0))
                conv_state.copy_(window[..., -self.conv_kernel :])
            conv_seq_idx = seq_idx
            if cp is not None:  # the conv reads the previous rank's last inputs first (zeros on rank 0)
                history = conv_halo_width(self.conv_kernel)
                xbc, conv_seq_idx = prepend_conv_halo(xbc, width=history, cp=cp, seq_idx=seq_idx)
            # Under CP the plain-PyTorch conv and scan run on every device (the fused kernels take no entering state).
            use_kernels = mamba_kernels_available(xbc) and cache is None and cp is None
            xbc = self._conv(xbc, seq_idx=conv_seq_idx, use_kernels=use_kernels)[:, history:]
            if attention_mask is not None:
                xbc = (xbc * attention_mask[:, :, None]).to(dtype)
            x, b_mat, c_mat = xbc.split(
                [self.intermediate_size, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size],
                dim=-1,
            )
            x = x.view(batch, seqlen, self.num_heads, self.head_dim)
            b_mat = b_mat.view(batch, seqlen, self.n_groups, self.ssm_state_size)
            c_mat = c_mat.view(batch, seqlen, self.n_groups, self.ssm_state_size)
            if use_kernels:
                y = self._kernel_scan(x, dt, A, b_mat, c_mat, dt_bias, d_skip, seq_idx=seq_idx)
            elif cp is not None:
                y = ssd_chunked_scan_cp(
                    x,
                    self._discretize(dt, dt_bias),
                    A,
                    b_mat,
                    c_mat,
                    chunk_size=self.scan_chunk_size(x),
                    cp=cp,
                    D=d_skip,
                    seq_idx=seq_idx,
                    previous_seq_idx=None if conv_seq_idx is None else conv_seq_idx[:, history - 1],
                )
            else:
                dt_full = self._discretize(dt, dt_bias)
                scanned = ssd_chunked_scan(
                    x,
                    dt_full,
                    A,
                    b_mat,
                    c_mat,
                    chunk_size=self.scan_chunk_size(x),
                    D=d_skip,
                    initial_state=initial_state,
                    seq_idx=seq_idx,
                    return_final_state=cache is not None,
                )
                if cache is not None:
                    y, final_state = scanned
                    cache.ssm_states[self.layer_idx].copy_(final_state)
                else:
                    y = scanned  # type: ignore[assignment]
        y = self.norm(y.reshape(batch, seqlen, self.intermediate_size), gate)
        out: torch.Tensor = self.out_proj(y.to(dtype))
        return out

    def _check_cp_inputs(self, hidden_states: torch.Tensor, *, cache: Any | None, seq_idx: torch.Tensor | None) -> None:
        """Refuse, before any transfer, what context parallelism cannot run (every problem at once)."""
        batch, seqlen, _ = hidden_states.shape
        problems = []
        if cache is not None:
            problems.append("a generation cache was given (generate without context parallelism)")
        width = conv_halo_width(self.conv_kernel)
        if seqlen < width:
            problems.append(f"S_local={seqlen} is shorter than the conv halo ({width} tokens; use fewer CP ranks)")
        if seq_idx is not None and tuple(seq_idx.shape) != (batch, seqlen):
            problems.append(f"seq_idx has shape {tuple(seq_idx.shape)}, expected [B, S_local] = {(batch, seqlen)}")
        if problems:
            raise ValueError(f"Mamba2Mixer layer {self.layer_idx} under context parallelism: " + "; ".join(problems))

    def scan_chunk_size(self, x: torch.Tensor) -> int:
        """Chunk length of the plain-PyTorch scan for tensors like `x` (see `CPU_SCAN_CHUNK_SIZE`)."""
        return min(self.chunk_size, CPU_SCAN_CHUNK_SIZE) if x.device.type == "cpu" else self.chunk_size

    def _discretize(self, dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt + dt_bias.to(dt.dtype))
        low, high = self.time_step_limit
        if low > 0.0 or math.isfinite(high):
            dt = dt.clamp(min=low, max=high)
        return dt

    def _conv(self, xbc: torch.Tensor, *, seq_idx: torch.Tensor | None, use_kernels: bool) -> torch.Tensor:
        """Causal depthwise conv + SiLU. xbc: [B, S, C] -> [B, S, C]; packed rows never mix documents."""
        seqlen = xbc.shape[1]
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        if use_kernels:
            causal_conv1d_fn, _ = _kernels()
            out = causal_conv1d_fn(
                xbc.transpose(1, 2),
                weight,
                self.conv1d.bias,
                seq_idx=None if seq_idx is None else seq_idx.to(torch.int32).contiguous(),
                activation="silu",
            )
            return out.transpose(1, 2)
        # A K-tap shift-and-add in the [B, S, C] layout: no transposes, and its backward is K elementwise products
        # (the CPU depthwise-convolution backward is several times slower). Packed rows: tap k reads position t - k
        # only while it lies in the same document.
        # The input is zero-padded once in front; each tap is a view of it, accumulated with one fused addcmul.
        taps = min(self.conv_kernel, seqlen)
        same = None
        if seq_idx is not None:  # tap k of position t reads t - k only within t's document
            same = torch.zeros(*seq_idx.shape, taps - 1, dtype=torch.bool, device=xbc.device)
            for shift in range(1, taps):
                same[:, shift:, shift - 1] = seq_idx[:, shift:] == seq_idx[:, :-shift]
        return F.silu(_CausalConv.apply(xbc, weight[:, -taps:], self.conv1d.bias, same))

    def _kernel_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        b_mat: torch.Tensor,
        c_mat: torch.Tensor,
        dt_bias: torch.Tensor,
        d_skip: torch.Tensor,
        *,
        seq_idx: torch.Tensor | None,
    ) -> torch.Tensor:
        _, mamba_chunk_scan_combined = _kernels()
        return mamba_chunk_scan_combined(
            x,
            dt,
            A,
            b_mat,
            c_mat,
            chunk_size=self.chunk_size,
            D=d_skip,
            dt_bias=dt_bias,
            dt_softplus=True,
            seq_idx=None if seq_idx is None else seq_idx.to(torch.int32).contiguous(),
            dt_limit=self.time_step_limit,
        )

    def _decode_step(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        dt_bias: torch.Tensor,
        d_skip: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """One token. xbc: [B, C]; dt: [B, heads] -> y: [B, heads, head_dim] (fp32); updates the cache in place."""
        batch = xbc.shape[0]
        conv_state = cache.conv_states[self.layer_idx]  # [B, C, K]
        window = torch.cat([conv_state[..., 1:], xbc[..., None].to(conv_state.dtype)], dim=-1)
        conv_state.copy_(window)
        out = (window.to(self.conv1d.weight.dtype) * self.conv1d.weight.squeeze(1)).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias
        xbc = F.silu(out).to(xbc.dtype)
        x, b_mat, c_mat = xbc.split(
            [self.intermediate_size, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size], dim=-1
        )
        per_group = self.num_heads // self.n_groups
        x = x.view(batch, self.num_heads, self.head_dim).float()
        b_heads = b_mat.view(batch, self.n_groups, 1, self.ssm_state_size).float()
        b_heads = b_heads.expand(-1, -1, per_group, -1).reshape(batch, self.num_heads, self.ssm_state_size)
        c_heads = c_mat.view(batch, self.n_groups, 1, self.ssm_state_size).float()
        c_heads = c_heads.expand(-1, -1, per_group, -1).reshape(batch, self.num_heads, self.ssm_state_size)
        dt = self._discretize(dt.float(), dt_bias)  # [B, heads]
        state = cache.ssm_states[self.layer_idx]  # [B, heads, head_dim, N], fp32
        decay = torch.exp(dt * A)[..., None, None]
        new_state = state.float() * decay + (dt[..., None] * x)[..., None] * b_heads[:, :, None, :]
        state.copy_(new_state.to(state.dtype))
        y = (new_state @ c_heads[..., None]).squeeze(-1)
        return y + x * d_skip.float()[:, None]
