"""What the TPU byte experiments share: the decode step they compile and the costs XLA reports
for a compiled program (imported by quant_tpu_bytes, quant_tpu_staging, int4_tpu_dot,
int4_einsum_rows and quant_kernel_rows, which run from this directory)."""

from __future__ import annotations


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
    from jaxinfer.engine import aot

    return aot.run_config(None, mesh=mesh, weight_dtype=weight_dtype, dtype="bfloat16",
                          **{"engine.max_slots": 8, "cache.max_seq_len": 128,
                             "cache.page_size": 16, "cache.dtype": "bfloat16",
                             "engine.prefill_buckets": [16], "engine.prefill_chunk_size": 16,
                             "engine.max_num_batched_tokens": 24})
