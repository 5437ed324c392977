"""NeMo AutoModel's `BackendConfig` MoE fields (`experts`, `dispatcher` and its `dispatcher_*` knobs) in am-moe's terms.

What it is for: the one translation every model package needs from upstream's spelling to `GroupedExperts(
grouped_mm=...)` and `apply_expert_parallel(...)`. The backend is read by field name (am-precision's `BackendConfig`
or any object with upstream's fields), so am-moe still depends on torch only.
What it must not do: decide which values a model runs or can run here (the models and am-precision refuse those);
the core modules never import it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EXPERTS_GROUPED_MM", "LIBRARY_DISPATCHERS", "expert_parallel_options"]

# BackendConfig.experts -> GroupedExperts(grouped_mm=...): "torch" one matmul per expert, "torch_mm"
# torch._grouped_mm, "te" Transformer Engine's GroupedLinear, "gmm" the grouped_gemm package (CUDA; refused by
# am-precision's `backend_runtime_problems` where the library or CUDA is missing), "torch_mm_mxfp8" am-moe's MXFP8
# grouped GEMM (refused off Blackwell by `backend_runtime_problems`; am-moe names anything else missing at the first
# forward).
EXPERTS_GROUPED_MM = {"torch": "loop", "torch_mm": "grouped_mm", "te": "te", "gmm": "gmm", "torch_mm_mxfp8": "mxfp8"}
# Dispatchers that move tokens between expert-parallel ranks with a library (`apply_expert_parallel`); they run
# only once the experts are sharded over ep > 1 (the models' MoE blocks refuse a forward without).
LIBRARY_DISPATCHERS: tuple[str, ...] = ("deepep", "hybridep", "uccl_ep")


def expert_parallel_options(backend: Any | None, *, dispatcher: str | None = None) -> dict[str, Any]:
    """`apply_expert_parallel`'s dispatcher keywords from `backend` (upstream's names and meaning; None: the
    defaults, dispatcher "torch"): `dispatcher` (`dispatcher=` overrides it with any am-moe dispatcher, e.g.
    "torch_token": DeepEP's token-level protocol in plain torch), `dispatcher_num_sms`, `dispatcher_async_dispatch`,
    `dispatcher_share_token_dispatcher`."""
    # The keywords are the BackendConfig fields of the same name.
    names = ("dispatcher", "dispatcher_num_sms", "dispatcher_async_dispatch", "dispatcher_share_token_dispatcher")
    options: dict[str, Any] = {"dispatcher": "torch"} if backend is None else {n: getattr(backend, n) for n in names}
    if dispatcher is not None:
        options["dispatcher"] = dispatcher
    return options
