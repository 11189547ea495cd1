"""scripts/device/gpu_bench.py's smoke path: every row of its table (decode, prefill, both
decode kernels, the prefill kernel against the XLA path, n-gram speculation) runs at toy sizes
on CPU, so the script a GPU session runs for a few minutes is known to work before it gets
there."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~20 s: the whole script in a subprocess
def test_smoke_run_fills_every_row():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)  # this tree's package
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "device",
                                                        "gpu_bench.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SMOKE" in proc.stdout  # toy numbers are flagged as such
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    cases = [r["case"].split(",")[0] for r in rows]
    assert cases == ["decode batch 1", "decode batch 2", "prefill 16 tokens", "kernel: ours",
                     "kernel: jax ops.gpu.paged_attention", "prefill attention: ours",
                     "prefill attention: XLA path", "n-gram speculation"], cases
    for r in rows:
        assert r["rate"] != "failed", r
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["fraction"] > 0, r
