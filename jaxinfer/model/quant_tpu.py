"""Quantized projections on TPU through the Pallas kernel (`pallas_kernels.quant_matmul`).

XLA TPU fuses the conversion of a stored int8 / int4 weight into its dot, but its memory-space
assignment also prefetches the stored weight into VMEM, and its cost model counts those copies
besides the HBM read (docs/benchmarks.md, "Quantized weights"). The Pallas kernel owns its VMEM
traffic: it DMAs each weight tile from HBM once and declares exactly that traffic as its cost.

`projection` runs x [.., contraction] @ w [leading.., contraction.., outputs..] (the spec of
every projection of the model but the tied LM head; gate_up [2, D, F] leads with its 2) for int8
(per channel or grouped) or native int4 weights when the rows per data shard are at most
KERNEL_MAX_ROWS and the local weight tiles: under `jax.shard_map` over the context mesh with
each field in its own PartitionSpec (its logical axes through `jaxinfer.sharding.RULES`). Each
shard merges its local contraction axes into K and its local output axes into N, multiplies its
[M, K] rows by its [K, N] weight, and, where a contraction axis is split over a mesh axis, adds
the partial products over it (`psum`, in f32); an output axis split gives each shard its own
columns. Anything else returns None and the caller keeps XLA's dot.

q's output axes but the last go before the contraction ([D, K, C, H] -> [K, C, D, H] -> B =
K x C weights [D, H]; gate_up [2, D, F] is stored that way): XLA TPU stores a weight whose
middle output axes are small (the fused qkv's kv heads and q/k/v slots) with those axes major,
so this view is its stored layout (a free transpose), where merging them into the columns
would copy the weight every step. The scales go to [rows, B, N]: the fused qkv's are stored
[rows, K, C, H] with C outside K, so viewing them as [rows, K x C, H] relays them out each step
(a small copy: rows x K x C x H floats), as does moving a grouped gate_up's [2, rows, F]
scales behind their rows; a per-channel scale's unit rows move for free.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.sharding import RULES, data_shards, shards, spec_for
from pallas_kernels.quant_matmul import quantized_matmul, tile_sizes

# Decode (a row per slot) and speculative verification (R + 1 per slot) multiply a few rows by
# every weight: the step is bound by reading the weights, which the kernel does once. At 256
# rows an int8 projection does 512 flops per weight byte, past the v5e/v6e ridge points (~240
# and ~560 flops per HBM byte at bf16 peak), so longer prompt chunks keep XLA's own dot tiling.
KERNEL_MAX_ROWS = 256


def _local(shape, spec: P, mesh) -> tuple[int, ...]:
    """The shape of one shard of an array of `shape` in `spec` on `mesh`."""
    return tuple(d // shards(mesh, a) for d, a in zip(shape, spec))


def _specs(fields: dict[str, jax.Array], axes: tuple[str, ...], mesh) -> dict[str, tuple]:
    """Each field's PartitionSpec as a tuple of its rank (its logical axes through `RULES`, as
    `sharding.param_shardings` places it); all None on one device."""
    if mesh.empty or mesh.size == 1:
        return {name: (None,) * a.ndim for name, a in fields.items()}
    return {name: (*spec_for(name, axes, a.shape, mesh, RULES), *(None,) * a.ndim)[:a.ndim]
            for name, a in fields.items()}


def _x_spec(x: jax.Array, x_contract: int, contract_spec: tuple, mesh) -> tuple | None:
    """x's spec: rows split over "data" as the model splits them (`llama._rows`) where it
    divides the first batch axis, contraction as the weight's (merged: split on its first
    axis only); None when x's contraction cannot match the weight's shards."""
    if x_contract == len(contract_spec):
        contract = contract_spec
    elif x_contract == 1 and not any(contract_spec[1:]):
        contract = contract_spec[:1]
    else:
        return None
    batch = [None] * (x.ndim - x_contract)
    data = data_shards()
    if batch and data > 1 and x.shape[0] % data == 0:
        batch[0] = "data"
    return (*batch, *contract)


def projection(x: jax.Array, fields: dict[str, jax.Array], axes: tuple[str, ...], *,
               x_contract: int, num_contract: int, group: int, offset: int, out_dtype,
               lead: int = 0, interpret: bool = False) -> jax.Array | None:
    """x [*batch, *contraction] (`x_contract` trailing axes: the weight's contraction axes, or
    them merged into one) times the weight whose fields (q, scale and, grouped, zero; `lead`
    output axes, then its `num_contract` contraction axes, then the other outputs) carry the
    logical `axes`: [*batch, *outputs] in `out_dtype`; None where the kernel does not apply
    (module doc)."""
    mesh = jax.sharding.get_abstract_mesh()
    specs = _specs(fields, axes, mesh)
    q_spec = specs["q"]
    inner = slice(lead, lead + num_contract)
    contract_spec, out_spec = q_spec[inner], q_spec[:lead] + q_spec[inner.stop:]
    split = [a for a in contract_spec if a]
    x_spec = _x_spec(x, x_contract, contract_spec, mesh)
    if x_spec is None or len(split) > 1 or any(
            s[:lead] + s[inner.stop:] != out_spec or (group and s != q_spec)
            for s in specs.values()):
        return None  # a field split unlike q: a shard's scale rows would not be its weight's
    local_q = _local(fields["q"].shape, q_spec, mesh)
    outs = local_q[:lead] + local_q[inner.stop:]
    k, b, n = math.prod(local_q[inner]), math.prod(outs[:-1]), outs[-1]
    batch = x.shape[:x.ndim - x_contract]
    rows = math.prod(batch) // (mesh.shape["data"] if "data" in x_spec else 1)
    if rows > KERNEL_MAX_ROWS or tile_sizes(k, n, group) is None:
        return None
    # q's outputs but the last before its contraction: [B, K, N], the order XLA TPU stores it in
    last = len(local_q) - 1
    perm = (*range(lead), *range(inner.stop, last), *range(inner.start, inner.stop), last)
    rows_first = (*range(inner.start, inner.stop), *range(lead), *range(inner.stop, last + 1))

    def shard(x, *values):
        w = dict(zip(fields, values))
        q = jnp.transpose(w.pop("q"), perm).reshape(b, k, n)
        # [rows, B, N] as stored; 2-D where the stored scale is (a unit B dim in the
        # second-minor place would relay it out)
        scales = {f: jnp.transpose(a, rows_first).reshape((-1, n) if a.ndim == 2 else (-1, b, n))
                  for f, a in w.items()}
        out = quantized_matmul(
            x.reshape(-1, k), q, scales["scale"], scales.get("zero"), group=group, offset=offset,
            out_dtype=jnp.float32 if split else out_dtype, interpret=interpret)
        if split:  # partial products over the split contraction: added in f32
            out = jax.lax.psum(out, split[0]).astype(out_dtype)
        return out.reshape(*x.shape[:len(batch)], *outs)

    if mesh.empty or mesh.size == 1:
        return shard(x, *fields.values())
    return jax.shard_map(shard, in_specs=(P(*x_spec), *(P(*specs[f]) for f in fields)),
                         out_specs=P(*x_spec[:len(batch)], *out_spec),
                         check_vma=False)(x, *fields.values())
