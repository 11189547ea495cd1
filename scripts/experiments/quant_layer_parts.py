"""One layer's bytes in the 8B decode step, per weight dtype: the compile check's decode step
(deviceless v5e:2x2, model:4, the run of `tpu_costs.decode_run`) at 1 and 2 layers. Prints
XLA's bytes accessed, the traffic the Pallas quantized-matmul calls declare (their
`cost_estimate` in the optimised HLO), the bytes staged into VMEM and the temporaries; the
differences between the two layer counts are one layer's.

  python scripts/experiments/quant_layer_parts.py --weight_dtypes=bfloat16,int8,int4

Reproduces docs/benchmarks.md, "Quantized weights on TPU (deviceless)": one layer's parts
(XLA's count, the kernels' declared traffic) behind the 1.99x / 3.26x estimate.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from absl import app, flags  # noqa: E402
from tpu_costs import decode_run  # noqa: E402  (this directory)

FLAGS = flags.FLAGS
flags.DEFINE_list("weight_dtypes", ["bfloat16", "int8", "int4"], "Weight storage per row.")

_DECLARED = re.compile(r'"bytes_accessed":"(\d+)"')


def measure(weight_dtype: str, layers: int) -> dict:
    """The decode step's costs, and the declared kernel traffic read from its optimised HLO (the
    executable with the most Pallas calls: the forward)."""
    from jaxinfer.proof import aot

    hlos = []
    scan = aot.whole_operand_bytes

    def keep(hlo, min_bytes):
        hlos.append(hlo)
        return scan(hlo, min_bytes)

    aot.whole_operand_bytes = keep
    try:
        report = aot.check(aot.AotConfig(model="llama-3.1-8b", target="v5e:2x2",
                                         run=decode_run(weight_dtype, "data:1,model:4"),
                                         num_layers=layers, decode_only=True,
                                         pages="largest"), log=lambda m: None)
    finally:
        aot.whole_operand_bytes = scan
    forward = max(hlos, key=lambda h: h.count("tpu_custom_call"))
    d = report.decode
    return {"bytes_accessed": d.bytes_accessed,
            "declared": sum(int(b) for b in _DECLARED.findall(forward)),
            "staged": d.staged_bytes, "temp": d.temp_bytes}


def main(argv) -> int:
    del argv
    print("| weights | layers | bytes accessed MB | kernels declared MB | staged MB | temp MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for weight_dtype in FLAGS.weight_dtypes:
        per = [measure(weight_dtype, layers) for layers in (1, 2)]
        for layers, r in zip((1, 2, "per layer"), per + [
                {k: per[1][k] - per[0][k] for k in per[0]}]):
            print(f"| {weight_dtype} | {layers} | {r['bytes_accessed'] / 1e6:.2f} | "
                  f"{r['declared'] / 1e6:.2f} | {r['staged'] / 1e6:.2f} | "
                  f"{r['temp'] / 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    app.run(main)
