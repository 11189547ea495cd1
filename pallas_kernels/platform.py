"""The platform a kernel is being traced for."""

from __future__ import annotations

import jax


def traced_backend() -> str:
    """The platform of the context mesh's devices (`jax.set_mesh`), else `jax.default_backend()`.

    A program compiled ahead of time for hardware this process does not have (a TPU topology
    from `jax.experimental.topologies`, a compile-only CUDA device) is traced under a mesh of
    that hardware's devices while the default backend is the host's CPU: the mesh, not the
    default backend, says which kernel to lower."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform or jax.default_backend()
