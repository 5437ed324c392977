"""Reading a device mesh for CP: the sub-mesh of a named dim, and this process's rank inside the CP group.

What it is for: the one place the sharders (batch.py, thd.py) read a `DeviceMesh` — or any object with
`mesh_dim_names`, `__getitem__`, `size()`, `get_group()` and `get_local_rank()`.
What it must not do: communicate.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["cp_rank", "sub_mesh"]


def sub_mesh(device_mesh: Any, name: str) -> Any:
    """`device_mesh[name]` when the mesh has a dim of that name, else None (device_mesh may be None)."""
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    return device_mesh[name] if device_mesh is not None and name in names else None


def cp_rank(cp_mesh: Any) -> int:
    """The rank INSIDE the CP group, never the global or HSDP coordinate."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group=cp_mesh.get_group())
    return int(cp_mesh.get_local_rank())
