"""Smoke test of scripts/kernel_benchmark.py: a tiny f32 sweep in interpret mode on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "kernel_benchmark.py")
TINY = ["--interpret", "--batches=2", "--contexts=256", "--num_kv_heads=2", "--q_per_kv=2",
        "--head_dim=64", "--repeats=2", "--dtype=float32"]


def test_kernel_benchmark_cpu_smoke():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)  # this tree's package
    proc = subprocess.run([sys.executable, SCRIPT, *TINY], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])  # exactly one JSON line, the last
    assert sum(line.startswith("{") for line in lines) == 1
    assert "meaningless" in proc.stdout  # CPU timings are flagged as such
    assert summary["jax_version"] and summary["device_kind"]
    assert summary["shapes"] == [dict(batch=2, context=256, num_kv_heads=2, q_per_kv=2,
                                      head_dim=64, page_size=16, query_len=1,
                                      dtype="float32")]
    by_impl = {r["impl"]: r for r in summary["results"]}
    assert set(by_impl) == {"pallas", "shipped", "xla"}
    for impl, row in by_impl.items():
        assert row["kv_bytes"] == 2 * 2 * 256 * 2 * 64 * 4
        if "skipped" in row:
            assert impl == "shipped" and row["skipped"], row  # only shipped may be skipped
            continue
        assert row["time_us"] > 0 and row["gb_per_s"] > 0
        if impl != "xla":
            assert row["max_abs_err"] < 1e-4, row
