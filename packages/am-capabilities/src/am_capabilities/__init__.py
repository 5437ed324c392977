"""am-capabilities: which parallelisms a model supports, by introspection and declaration.

Reads duck-typed attributes of a model (plans, attention backend, hybrid markers, MoE marker, capability
declarations) and a registry that model packages fill through entry points; never imports a model package,
a trainer, or (at import time) transformers.
"""

from ._version import __version__
from .declarative import ModelCapabilities, declared_capabilities, query_capabilities
from .introspection import (
    EXPERT_PARALLEL_HOOK,
    expert_split_problem,
    implements_expert_parallelism,
    is_hybrid_model,
    tp_split_problem,
)
from .mesh import MODEL_AXES, MeshContext, read_mesh_sizes
from .registry import (
    ENTRY_POINT_GROUP,
    ModelRegistryError,
    clear_registry_cache,
    find_model_class,
    get_model_class,
    is_registered_model_class,
    register_model,
    registered_architectures,
    unregister_model,
)
from .supports import ModelSupports
from .validation import attach_capabilities_and_validate, validate_for_mesh

__all__ = [
    # introspection of live models
    "ModelSupports",
    "is_hybrid_model",
    "implements_expert_parallelism",
    "expert_split_problem",
    "tp_split_problem",
    "EXPERT_PARALLEL_HOOK",
    # validation
    "validate_for_mesh",
    "attach_capabilities_and_validate",
    # declarations
    "ModelCapabilities",
    "query_capabilities",
    "declared_capabilities",
    # meshes
    "MeshContext",
    "MODEL_AXES",
    "read_mesh_sizes",
    # registry
    "ENTRY_POINT_GROUP",
    "ModelRegistryError",
    "register_model",
    "unregister_model",
    "get_model_class",
    "find_model_class",
    "registered_architectures",
    "is_registered_model_class",
    "clear_registry_cache",
    "__version__",
]
