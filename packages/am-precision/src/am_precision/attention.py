"""Attention kernels behind `BackendConfig.attn`: one call signature (SDPA's) for every backend a model may choose.

What it is for: `AttentionKernel(attn, ...)` is the core attention of a model layer. Its forward takes SDPA's
arguments (`q [B, H, Sq, d]`, `k`/`v [B, H_kv, Sk, d]`, a boolean "may attend" or additive float mask, `is_causal`,
`scale`, `dropout_p`, `enable_gqa`) and runs the chosen backend:
  - "sdpa": `torch.nn.functional.scaled_dot_product_attention`;
  - "eager": plain matmul + softmax (softmax in fp32, as transformers' eager attention), the readable reference;
  - "flex": `torch.nn.attention.flex_attention` (compiled on CUDA; on the CPU torch runs its forward unfused and
    has no backward, so a CPU forward that needs gradients is refused with that reason);
  - "cudnn": SDPA restricted to torch's cuDNN attention kernel (CUDA only);
  - "te": Transformer Engine's `DotProductAttention` (CUDA + TE only; `qkv_format="bshd"`).
"tilelang" is refused by `attention_backend_problem`: upstream's TileLang kernels are the sparse attention of
DeepSeek-V4 / GLM-DSA, which dense-attention models have no use for. Rows of a mask with no visible key give 0 on
every backend (what SDPA does).
What it must not do: import transformer_engine at import time (only when an "te" kernel is built), register
parameters or state-dict entries (a model's checkpoint keys never depend on its attention backend: the TE module is
held outside the module tree), or silently run another backend than the one asked for.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import flags

__all__ = ["RUNNABLE_ATTN_BACKENDS", "AttentionKernel", "attention_backend_problem", "eager_attention"]

# Backends `AttentionKernel` implements (each may still need CUDA / TE: see `attention_backend_problem`).
RUNNABLE_ATTN_BACKENDS: tuple[str, ...] = ("sdpa", "eager", "flex", "cudnn", "te")


def attention_backend_problem(attn: str, *, cuda: bool | None = None) -> str | None:
    """Why `attn` cannot run on this machine (None: it can). `cuda`: whether CUDA is there (default: ask torch).

    The message names the missing hardware or library and the fix.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if attn == "tilelang":
        return (
            "attn='tilelang' selects upstream's TileLang sparse-attention kernels (DeepSeek-V4 / GLM-DSA indexer "
            "attention); this model's attention is dense and has no TileLang kernel. Use attn='sdpa', 'flex', "
            "'eager', 'cudnn' or 'te'"
        )
    if attn == "te":
        if not flags.HAVE_TE:
            return (
                "attn='te' needs Transformer Engine (transformer_engine.pytorch.DotProductAttention), which is not "
                "installed: `pip install am-precision[te]` on a CUDA machine, or use attn='sdpa'"
            )
        if not cuda:
            return (
                "attn='te' needs a CUDA GPU (Transformer Engine runs only on CUDA; torch.cuda.is_available() is False)"
            )
    if attn == "cudnn" and not cuda:
        return "attn='cudnn' needs a CUDA GPU with cuDNN (torch.cuda.is_available() is False); use attn='sdpa'"
    if attn not in RUNNABLE_ATTN_BACKENDS and attn != "tilelang":
        return f"attn={attn!r} is not one of {RUNNABLE_ATTN_BACKENDS}"
    return None


def _causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """Boolean `[Sq, Sk]` lower-triangular mask aligned at the top-left corner, as SDPA's `is_causal`."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) v with plain matmuls. q `[B, H, Sq, d]`, k/v `[B, H_kv, Sk, d]` → `[B, H, Sq, d]`.

    The softmax runs in fp32 and is cast back to q's dtype (transformers' eager attention); rows whose mask hides
    every key give 0, as SDPA does. `attn_mask`: boolean (True = attend) or additive float, broadcastable to
    `[B, H, Sq, Sk]`.
    """
    if enable_gqa and k.shape[1] != q.shape[1]:
        repeats = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if is_causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    probs = torch.softmax(scores, dim=-1)
    # A row that sees no key is NaN after the softmax (-inf - -inf); SDPA returns 0 there.
    probs = torch.nan_to_num(probs, nan=0.0).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


_COMPILED_FLEX: dict[str, Callable[..., Any]] = {}


def _flex_function(*, compiled: bool) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if "flex" not in _COMPILED_FLEX:  # one compiled function per process; torch caches the graphs per shape
        _COMPILED_FLEX["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX["flex"]


def _flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
    enable_gqa: bool,
    compiled: bool,
) -> torch.Tensor:
    """FlexAttention with the SDPA arguments: a boolean mask or causality becomes a block mask, a float mask a
    score_mod. Shapes as `eager_attention`."""
    from torch.nn.attention.flex_attention import create_block_mask

    if dropout_p:
        raise ValueError(
            f"attn='flex' has no attention dropout (got dropout_p={dropout_p}); set attention_dropout=0 or use "
            "attn='sdpa' / 'eager'"
        )
    on_cpu = q.device.type == "cpu"
    if on_cpu and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            f"attn='flex' cannot train on the CPU: torch {torch.__version__} has no FlexAttention backward on the "
            "CPU. Run the forward under torch.no_grad() (evaluation), train on CUDA, or use attn='sdpa' / 'eager'"
        )
    q_len = q.shape[-2]
    k_len = k.shape[-2]
    block_mask, score_mod = None, None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        mask = attn_mask if attn_mask.dim() == 4 else attn_mask.reshape(1, 1, q_len, k_len)
        mask = mask.expand(mask.shape[0], mask.shape[1], q_len, k_len)
        mask_batch = mask.shape[0]
        heads_in_mask = mask.shape[1] != 1

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            allowed = mask[b if mask_batch > 1 else 0, h if heads_in_mask else 0, q_idx, kv_idx]
            return allowed & (kv_idx <= q_idx) if is_causal else allowed

        block_mask = create_block_mask(mask_mod, mask_batch, None, q_len, k_len, device=q.device)
    elif is_causal:

        def causal_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx <= q_idx

        block_mask = create_block_mask(causal_mod, None, None, q_len, k_len, device=q.device)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        additive = attn_mask.to(q.dtype)
        add_batch, add_heads = additive.shape[0] > 1, additive.shape[1] > 1

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + additive[b if add_batch else 0, h if add_heads else 0, q_idx, kv_idx]

    run = _flex_function(compiled=compiled)
    with warnings.catch_warnings():
        # torch warns that an uncompiled flex_attention is unfused; on the CPU that is the only forward there is.
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    result: torch.Tensor = out
    return result


class AttentionKernel(nn.Module):
    """The core attention `BackendConfig.attn` names, with SDPA's call signature. No parameters, no state-dict keys.

    forward: q `[B, H, Sq, d]`, k/v `[B, H_kv, Sk, d]` (same dtype) → `[B, H, Sq, d]` in q's dtype.

    Args:
        attn: one of `RUNNABLE_ATTN_BACKENDS` ("tilelang" is refused, see `attention_backend_problem`).
        num_heads: query heads H (TE needs them at construction).
        num_kv_heads: key/value heads H_kv (GQA when fewer than H).
        head_dim: d.
        compile_attn: wrap the kernel in `torch.compile` (`BackendConfig.compile_attn`; not "te", whose kernel is
            already fused); FlexAttention is compiled on CUDA whatever this says (uncompiled it is a slow
            reference).

    Raises:
        ValueError: `attn` cannot run here (missing CUDA / Transformer Engine, or "tilelang"); the message says what
            is missing.
    """

    def __init__(
        self, attn: str, *, num_heads: int, num_kv_heads: int, head_dim: int, compile_attn: bool = False
    ) -> None:
        super().__init__()
        problem = attention_backend_problem(attn)
        if problem is not None:
            raise ValueError(problem)
        self.attn = attn
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compile_attn = compile_attn
        self._te_modules: dict[tuple[Any, ...], Any] = {}  # TE modules, kept out of the module tree (no _extra_state)
        self._compiled: Callable[..., torch.Tensor] | None = None

    def extra_repr(self) -> str:
        return f"attn={self.attn!r}, compile_attn={self.compile_attn}"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        dropout_p: float = 0.0,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        run = self._run
        if self.compile_attn and self.attn != "te":
            if self._compiled is None:
                self._compiled = torch.compile(self._run, dynamic=None)
            run = self._compiled
        # one set of SDPA keywords for every kernel that takes them (the TE path takes them positionally)
        options: dict[str, Any] = dict(
            attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa
        )
        return run(q, k, v, options)

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
        if self.attn == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, **options)
        if self.attn == "eager":
            return eager_attention(q, k, v, **options)
        if self.attn == "flex":
            return _flex_attention(q, k, v, **options, compiled=q.device.type == "cuda" and not self.compile_attn)
        if self.attn == "cudnn":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            # Only the cuDNN kernel is allowed: torch raises rather than fall back when it cannot take these inputs.
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, **options)
        return self._te(q, k, v, options["attn_mask"], options["is_causal"], options["scale"], options["dropout_p"])

    def _te(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
        dropout_p: float,
    ) -> torch.Tensor:
        """Transformer Engine `DotProductAttention` in "bshd" layout. TE's boolean masks mean "masked out"."""
        mask_type = "arbitrary" if attn_mask is not None else ("causal" if is_causal else "no_mask")
        scale = self.head_dim**-0.5 if scale is None else scale
        key = (mask_type, float(scale), float(dropout_p))
        module = self._te_modules.get(key)
        if module is None:
            import transformer_engine.pytorch as te

            module = te.DotProductAttention(
                num_attention_heads=self.num_heads,
                kv_channels=self.head_dim,
                num_gqa_groups=self.num_kv_heads,
                attention_dropout=dropout_p,
                qkv_format="bshd",
                attn_mask_type=mask_type,
                softmax_scale=scale,
            )
            self._te_modules[key] = module
        te_mask = None
        if attn_mask is not None:
            hidden = ~attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
            if is_causal:
                causal = _causal_mask(q.shape[-2], k.shape[-2], q.device)
                hidden = hidden | ~causal
            # TE's "arbitrary" mask is [B, 1, Sq, Sk] (True = masked out); a batch-broadcast mask is expanded.
            te_mask = hidden.expand(q.shape[0], 1, q.shape[-2], k.shape[-2])
        out = module(
            q.transpose(1, 2).contiguous(),
            k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous(),
            attention_mask=te_mask,
        )  # [B, Sq, H * d]
        result: torch.Tensor = out.view(q.shape[0], q.shape[2], self.num_heads, self.head_dim).transpose(1, 2)
        return result
