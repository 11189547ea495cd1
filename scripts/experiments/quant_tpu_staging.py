"""What XLA TPU stages into VMEM (memory space S(1)) in an 8B-shaped decode step, per weight
dtype: the optimised HLO's top-level asynchronous copies and slices into S(1), grouped by the
array staged, with how often and how many bytes (per chip). Compiled without a TPU, through
`jaxinfer.proof.aot` (the engine's own decode executable, as `quant_tpu_bytes.py` does).

  python scripts/experiments/quant_tpu_staging.py --weight_dtypes=bfloat16,int8,int4 --layers=2

Libtpu flags (e.g. memory-space-assignment options) go in LIBTPU_INIT_ARGS. Prints, per dtype,
the bytes accessed, the staged total, and one line per staged array; then one JSON line.
"""

from __future__ import annotations

import collections
import json
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
flags.DEFINE_integer("layers", 2, "Layers of the 8B shape to compile.")
flags.DEFINE_string("target", "v5e:2x2", "TPU topology.")
flags.DEFINE_string("mesh", "data:1,model:4", "Mesh over the topology's chips.")

_STAGE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+(copy-start|copy-done|slice-start|"
                    r"slice-done|custom-call)\((.*)$")


def staged(hlo: str) -> dict[str, list[int]]:
    """'<dtype>[dims] <opcode>' -> [count, bytes] of the top-level instructions whose result
    lives in S(1) (fused computations skipped)."""
    from jaxinfer.proof.hlo_scan import _ARRAY, _array_bytes

    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    fused = False
    for line in hlo.splitlines():
        if line[:1] not in ("", " ", "\t"):
            fused = "fused" in line.split("(")[0] or "fusion" in line.split("(")[0]
            continue
        m = _STAGE.match(line)
        if fused or not m or "S(1)}" not in m.group(2):
            continue
        for dtype, dims in _ARRAY.findall(m.group(2))[-1:]:  # the staged array (last: -done's)
            row = out[f"{dtype}[{dims}] {m.group(3)}"]
            row[0] += 1
            row[1] += _array_bytes(dtype, dims)
    return dict(out)


def measure(weight_dtype: str) -> dict:
    from jaxinfer.proof import aot

    texts = []
    scan = aot.whole_operand_bytes

    def capture(hlo, *args):
        texts.append(hlo)
        return scan(hlo, *args)

    aot.whole_operand_bytes = capture
    run = decode_run(weight_dtype, FLAGS.mesh)
    report = aot.check(aot.AotConfig(model="llama-3.1-8b", target=FLAGS.target, run=run,
                                     num_layers=FLAGS.layers, decode_only=True, pages="largest"),
                       log=lambda m: None)
    aot.whole_operand_bytes = scan
    d = report.decode
    hlo = next(t for t, e in zip(texts, report.executables) if e is d)
    return {"weights": weight_dtype, "bytes_accessed": d.bytes_accessed,
            "argument_bytes": d.argument_bytes, "staged_bytes": d.staged_bytes,
            "staged": staged(hlo)}


def main(argv) -> int:
    del argv
    rows = [measure(w) for w in FLAGS.weight_dtypes]
    for r in rows:
        print(f"{r['weights']}: bytes accessed {r['bytes_accessed'] / 1e6:,.1f} MB, arguments "
              f"{r['argument_bytes'] / 1e6:,.1f} MB, staged {r['staged_bytes'] / 1e6:,.1f} MB")
        for name, (count, nbytes) in sorted(r["staged"].items(), key=lambda kv: -kv[1][1]):
            if nbytes >= 1 << 20:
                print(f"  {count:3d} x {name}: {nbytes / 1e6:,.1f} MB")
    print(json.dumps({"target": FLAGS.target, "mesh": FLAGS.mesh, "layers": FLAGS.layers,
                      "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""), "rows": rows}))
    return 0


if __name__ == "__main__":
    app.run(main)
