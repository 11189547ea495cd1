"""scripts/device/gpu_bench.py's smoke path: every row of its table (decode, prefill, both
kernels, n-gram speculation) runs at toy sizes on CPU, so the script a GPU session runs for a
few minutes is known to work before it gets there."""

import importlib.util
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "gpu_bench", os.path.join(ROOT, "scripts", "device", "gpu_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_fills_every_row():
    rows = _bench().run(smoke=True, chip_name="h200")
    cases = [r["case"] for r in rows]
    assert [c.split(",")[0] for c in cases] == [
        "decode batch 1", "decode batch 2", "prefill 16 tokens", "kernel: ours",
        "kernel: jax ops.gpu.paged_attention", "n-gram speculation"], cases
    for r in rows:
        assert r["rate"] != "failed", r
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["fraction"] > 0, r
