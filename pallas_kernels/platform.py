"""The platform a kernel is being traced for, and the compile-only GPU targets (sm_90a)."""

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


# GpuTargetConfigProto (xla/stream_executor/device_description.proto) for H100 SXM and H200, from
# XLA's xla/backends/gpu/target_config/specs/{h100_sxm,h200}.txtpb, trimmed to the fields this
# jaxlib's proto has and without the per-dtype throughput tables (only XLA's cost model reads
# them). `feature_extension: ACCELERATED_FEATURES` makes the target sm_90a, as on a real H100.
# The two differ only in device_memory_size (XLA's scheduler memory limit) and bandwidth.
_GPU_TARGET = """
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation" platform_version: "Compute Capability 9.0a"
  device_address_bits: 64 ecc_enabled: true name: "{name}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{name}"
"""
GPU_TARGETS = {
    "h100": _GPU_TARGET.format(name="NVIDIA H100 80GB HBM3", memory=84942979072,
                               bandwidth=3352320000000),
    "h200": _GPU_TARGET.format(name="NVIDIA H200 141GB HBM3e", memory=151397597184,
                               bandwidth=4800000000000),
}
