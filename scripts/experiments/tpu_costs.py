"""What the TPU byte experiments share: the decode step they compile, the 8B projection they
compile through `quant.einsum`, and the costs XLA reports for a compiled program (imported by
quant_tpu_bytes, quant_layer_parts and quant_kernel_rows, which run from this directory)."""

from __future__ import annotations

D, F = 4096, 14336  # the 8B FFN projection: x bf16[rows, D] @ w[D, F]


def costs(compiled) -> dict:
    """XLA's bytes accessed and the argument / temporary bytes of a compiled program."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    return {"bytes_accessed": cost["bytes accessed"], "argument_bytes": mem.argument_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes}


def decode_run(weight_dtype: str, mesh: str):
    """The run config of the measured 8B-shaped decode step: 8 rows, pages of 16, bf16
    activations and KV, weights stored as `weight_dtype`."""
    from jaxinfer.proof import aot

    return aot.run_config(None, mesh=mesh, weight_dtype=weight_dtype, dtype="bfloat16",
                          **{"engine.max_slots": 8, "cache.max_seq_len": 128,
                             "cache.page_size": 16, "cache.dtype": "bfloat16",
                             "engine.prefill_buckets": [16], "engine.prefill_chunk_size": 16,
                             "engine.max_num_batched_tokens": 24})


def projection_costs(mesh, rows: int, layout: str | None, *, mesh_context: bool = True) -> dict:
    """Costs of x bf16[rows, D] @ w[D, F] through `quant.einsum`, the output axis split over
    `mesh`'s "model" axis. layout None: bf16; "int8": per channel; "int8:G" / "int4:G": groups
    of G (int4 native 4-bit, as placed on a TPU). mesh_context: traced under `mesh` (the
    platform `quant.einsum` lowers for: the TPU kernel where it applies); without it the XLA
    forms are traced as for the default backend, then compiled for `mesh`."""
    import contextlib

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer.model import quant

    def sds(shape, dtype, spec=None):  # default: the output axis split
        spec = P(None, "model") if spec is None else spec
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    x = sds((rows, D), jnp.bfloat16, P())
    if layout is None:
        fields, make = {"w": sds((D, F), jnp.bfloat16)}, lambda f: f["w"]
    else:
        kind, _, group = layout.partition(":")
        t = quant.quantize(jax.ShapeDtypeStruct((D, F), jnp.float32), (0,), kind,
                           int(group or 0))
        fields = {k: sds(v.shape, v.dtype) for k, v in t.fields().items()}
        if kind == "int4":
            fields["q"] = sds((D, F), jnp.int4)

        def make(f):
            live = quant.QTensor(q=f["q"], scale=f["scale"], zero=f.get("zero"), shape=t.shape,
                                 contract=t.contract, kind=kind, group=t.group)
            return quant.QuantWeight(live, ("embed", "ffn"), lambda v, _: nnx.Param(v))

    with jax.set_mesh(mesh) if mesh_context else contextlib.nullcontext():
        fn = jax.jit(lambda x, f: quant.einsum("ND,DF->NF", x, make(f)))
        return costs(fn.lower(x, fields).compile())
