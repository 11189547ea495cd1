"""XLA's bytes accessed of an 8B-shaped decode step per weight dtype, compiled for a TPU
topology (or `--target=gpu:h100` with the compile-only CUDA plugin) without one (deviceless,
`jaxinfer.proof.aot`), and where those bytes go.

  python scripts/experiments/quant_tpu_bytes.py --weight_dtypes=bfloat16,int8,int4 --layers=4,32

For each weight dtype x layer count: the engine's decode step (Llama 3.1 8B dims, 8 rows,
8 pages of 16 per row, bf16 activations and KV, mesh model:4 on v5e:2x2) compiled by libtpu;
printed per chip: bytes accessed, the arguments, temporaries, what XLA counts besides HBM
traffic (weights staged into VMEM, gathered tables counted whole, the attention kernel's
operands), and the weight-sized moves the HLO scan finds. The per-layer share is the
difference between two layer counts over the layers added. Prints a table, then one JSON line.

Reproduces docs/benchmarks.md, "Quantized weights on TPU (deviceless)": the 8B decode step's
bytes accessed, arguments and staging per weight dtype at 4 and 32 layers (v5e and v6e).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from absl import app, flags  # noqa: E402
from tpu_costs import decode_run  # noqa: E402  (this directory)

FLAGS = flags.FLAGS
flags.DEFINE_list("weight_dtypes", ["bfloat16", "int8", "int4"],
                  "Weight storage of the rows (int4: native 4-bit in the target's default group, "
                  "`quant.default_int4_group`).")
flags.DEFINE_list("layers", ["4", "32"], "Layer counts of the 8B shape to compile.")
flags.DEFINE_list("int4_groups", [], "int4 rows at these group sizes instead of the target's "
                  "default (the default's constant, `quant.INT4_GROUP_NATIVE`, set per row).")
flags.DEFINE_string("target", "v5e:2x2", "TPU topology.")
flags.DEFINE_string("mesh", "data:1,model:4", "Mesh over the topology's chips.")


def measure(weight_dtype: str, layers: int, group: int | None = None) -> dict:
    from jaxinfer.model import quant
    from jaxinfer.proof import aot

    if group:
        quant.INT4_GROUP_NATIVE = group

    run = decode_run(weight_dtype, FLAGS.mesh)
    report = aot.check(aot.AotConfig(model="llama-3.1-8b", target=FLAGS.target, run=run,
                                     num_layers=layers, decode_only=True, pages="ends"),
                       log=lambda m: None)
    d = report.decode
    if weight_dtype == "int4":
        weight_dtype += f" g{aot.model_config(report.aot).int4_group_size}"
    return {"weights": weight_dtype, "layers": layers, "bytes_accessed": d.bytes_accessed,
            "argument_bytes": d.argument_bytes, "temp_bytes": d.temp_bytes,
            "staged_bytes": d.staged_bytes, "gathered_table_bytes": d.gathered_table_bytes,
            "kernel_operand_bytes": d.custom_call_operand_bytes,
            "compile_s": d.compile_s, "moves": d.moves}


def main(argv) -> int:
    del argv
    rows = [measure(w, int(n), int(g) if g else None) for n in FLAGS.layers
            for w in FLAGS.weight_dtypes
            for g in (FLAGS.int4_groups if w == "int4" and FLAGS.int4_groups else [None])]
    mb = lambda b: f"{b / 1e6:,.1f}"  # noqa: E731
    base = {r["layers"]: r["bytes_accessed"] for r in rows if r["weights"] == "bfloat16"}
    print("| weights | layers | bytes accessed MB | vs bf16 | args MB | temp MB | staged MB "
          "| gathered MB | kernel operands MB | moves |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = base.get(r["layers"], 0) / (r["bytes_accessed"] or float("nan"))
        print(f"| {r['weights']} | {r['layers']} | {mb(r['bytes_accessed'])} | {ratio:.2f}x | "
              f"{mb(r['argument_bytes'])} | {mb(r['temp_bytes'])} | {mb(r['staged_bytes'])} | "
              f"{mb(r['gathered_table_bytes'])} | {mb(r['kernel_operand_bytes'])} | "
              f"{len(r['moves'])} |")
    counts = sorted({r["layers"] for r in rows})
    if len(counts) >= 2:
        lo, hi = counts[0], counts[-1]
        for w in dict.fromkeys(r["weights"] for r in rows):
            by = {r["layers"]: r for r in rows if r["weights"] == w}
            layer = (by[hi]["bytes_accessed"] - by[lo]["bytes_accessed"]) / (hi - lo)
            fixed = by[lo]["bytes_accessed"] - lo * layer
            print(f"{w}: {mb(layer)} MB per layer, {mb(fixed)} MB outside the layers")
    print(json.dumps({"target": FLAGS.target, "mesh": FLAGS.mesh, "rows": rows}))
    return 0


if __name__ == "__main__":
    app.run(main)
