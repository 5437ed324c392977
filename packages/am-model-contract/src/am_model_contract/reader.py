"""`contract_of(model)`: the one function infrastructure packages read a model's contract with.

What it must not do: cache the contract on the model (its hooks are bound to one instance; a copy answers for itself).
"""

from __future__ import annotations

from typing import Any

from .contract import CONTRACT_HOOK, ModelContract
from .conventions import conventional_contract

__all__ = ["contract_of", "declares_contract"]


def declares_contract(model: Any) -> bool:
    """Whether `model` declares its own contract (a callable `am_contract`)."""
    return callable(getattr(model, CONTRACT_HOOK, None))


def contract_of(model: Any) -> ModelContract:
    """What `model` offers the infrastructure: `model.am_contract()` when it declares one, else the contract its
    transformers / NeMo AutoModel class attributes describe (`conventional_contract`; all defaults for a plain
    module). Computed per call: hooks are bound to this instance.

    Raises:
        TypeError: `am_contract` is not callable, or returns something else than a `ModelContract`.
    """
    hook = getattr(model, CONTRACT_HOOK, None)
    if hook is None:
        return conventional_contract(model)
    name = type(model).__name__
    if not callable(hook):
        raise TypeError(f"{name}.{CONTRACT_HOOK} must be a method returning a ModelContract; got {hook!r}")
    contract = hook()
    if not isinstance(contract, ModelContract):
        raise TypeError(
            f"{name}.{CONTRACT_HOOK}() must return an am_model_contract.ModelContract; got {type(contract).__name__}"
        )
    return contract
