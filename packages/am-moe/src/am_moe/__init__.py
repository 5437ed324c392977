"""Dropless mixture-of-experts building blocks shared by the am-* model packages.

Grouped expert MLPs with one grouped GEMM per projection (`GroupedExperts`, `grouped_mm`; MXFP8 operands on
Blackwell: `mxfp8`), token dispatch and
combine — local, or expert parallel over all-to-all (`dispatch`) — expert weights sharded over an `ep` mesh
dimension and composed with FSDP2 (`parallel`), per-step expert load statistics (`load`) and load balancing (the
auxiliary-loss-free bias update and the auxiliary losses, `balance`). Routers stay in the
model packages: the experts take `(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])`.
Depends on torch only; never imports a model package.
"""

from __future__ import annotations

from ._version import __version__
from .balance import (
    AUX_LOSS_TERMS,
    LoadBalancing,
    RouterBalancer,
    aux_loss_values,
    configure_load_balancing,
    router_z_loss,
    sequence_aux_loss,
    set_aux_loss_scale,
    switch_aux_loss,
    update_expert_bias,
)
from .deepep import DeepEPExchange
from .dispatch import (
    AllToAllDispatcher,
    AllToAllStats,
    DispatchState,
    LocalDispatcher,
    count_all_to_all_bytes,
)
from .experts import EXPERT_ACTIVATIONS, GroupedExperts
from .grouped_mm import (
    GROUPED_MM_BACKENDS,
    GroupedMMChoice,
    GroupLayout,
    grouped_linear,
    select_grouped_mm_backend,
)
from .hybridep import HybridEPDispatcher
from .load import ExpertLoad, expert_load, reset_expert_load
from .mxfp8 import dequantize_mxfp8, mxfp8_grouped_linear, mxfp8_problems, quantize_mxfp8
from .parallel import (
    ExpertParallelPlan,
    apply_expert_parallel,
    build_expert_meshes,
    expert_fsdp_dim,
    expert_modules,
    fully_shard_experts,
    gather_expert_state_dict,
    plan_expert_parallel,
    quiet_expert_gathers,
)
from .routing import RoutingError, balanced_routing, routing_problems
from .token_dispatch import DISPATCHERS, TokenDispatcher, TokenExchange, dispatcher_problems
from .torch_token import TorchTokenExchange
from .tuning import grouped_mm_auto_choices

__all__ = [
    "__version__",
    # experts
    "EXPERT_ACTIVATIONS",
    "GroupedExperts",
    # grouped GEMM
    "GROUPED_MM_BACKENDS",
    "GroupLayout",
    "GroupedMMChoice",
    "grouped_linear",
    "grouped_mm_auto_choices",
    "select_grouped_mm_backend",
    # MXFP8 grouped GEMM (Blackwell; the quantization runs anywhere)
    "dequantize_mxfp8",
    "mxfp8_grouped_linear",
    "mxfp8_problems",
    "quantize_mxfp8",
    # dispatch / combine
    "AllToAllDispatcher",
    "AllToAllStats",
    "DispatchState",
    "LocalDispatcher",
    "count_all_to_all_bytes",
    # token-level dispatchers (DeepEP / UCCL-EP / HybridEP, and their protocol in torch)
    "DISPATCHERS",
    "DeepEPExchange",
    "HybridEPDispatcher",
    "TokenDispatcher",
    "TokenExchange",
    "TorchTokenExchange",
    "dispatcher_problems",
    # router outputs
    "RoutingError",
    "balanced_routing",
    "routing_problems",
    # expert parallelism
    "ExpertParallelPlan",
    "apply_expert_parallel",
    "build_expert_meshes",
    "expert_fsdp_dim",
    "expert_modules",
    "fully_shard_experts",
    "gather_expert_state_dict",
    "quiet_expert_gathers",
    "plan_expert_parallel",
    # load statistics
    "ExpertLoad",
    "expert_load",
    "reset_expert_load",
    # load balancing
    "AUX_LOSS_TERMS",
    "LoadBalancing",
    "RouterBalancer",
    "aux_loss_values",
    "configure_load_balancing",
    "router_z_loss",
    "sequence_aux_loss",
    "set_aux_loss_scale",
    "switch_aux_loss",
    "update_expert_bias",
]
