"""am-model-contract: what a model offers the infrastructure, as one typed declaration.

A model declares `am_contract(self) -> ModelContract` (per axis: context-parallel layout and attention, pipeline
outputs and forward, expert-parallel hook, TP/PP plans); infrastructure packages read `contract_of(model)`, which
gives an undeclared HuggingFace / NeMo AutoModel model the contract its class attributes describe. Depends on the
standard library only, so models and infrastructure both import it without importing each other.
"""

from ._version import __version__
from .contract import (
    CONTRACT_HOOK,
    CP_LAYOUTS,
    ContextParallelContract,
    ExpertParallelContract,
    ModelContract,
    PipelineContract,
    TensorParallelContract,
)
from .conventions import conventional_contract, declared_tp_plan
from .reader import contract_of, declares_contract

__all__ = [
    # the schema
    "ModelContract",
    "ContextParallelContract",
    "PipelineContract",
    "ExpertParallelContract",
    "TensorParallelContract",
    "CP_LAYOUTS",
    "CONTRACT_HOOK",
    # reading it
    "contract_of",
    "declares_contract",
    "conventional_contract",
    "declared_tp_plan",
    "__version__",
]
