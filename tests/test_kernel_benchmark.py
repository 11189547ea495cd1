"""Smoke test of scripts/kernel_benchmark.py: a tiny f32 sweep in interpret mode on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


def _run(args: list[str]) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a benchmark mode's smoke run; the kernels are tested on their own
def test_prefill_mode_runs_jax_shipped_kernel_where_it_applies():
    """Prompt chunks in interpret mode: our ragged kernel and jax's GPU flash attention (which
    applies only to a chunk with no paged prefix) agree with the XLA path; elsewhere the
    shipped row says why it is skipped."""
    summary = _run(["--mode=prefill", "--interpret", "--chunks=32,64", "--contexts=64",
                    "--num_kv_heads=2", "--q_per_kv=2", "--head_dim=64", "--repeats=1",
                    "--dtype=float32"])
    rows = {(r["chunk"], r["impl"]): r for r in summary["results"]}
    assert set(rows) == {(c, i) for c in (32, 64) for i in ("xla", "pallas", "shipped")}
    assert "chunk == context" in rows[32, "shipped"]["skipped"]
    for key in ((32, "pallas"), (64, "pallas"), (64, "shipped")):
        assert rows[key]["max_abs_err_vs_xla"] < 1e-4, rows[key]
        chunk = key[0]
        assert rows[key]["flops"] == 4 * 64 * 4 * (chunk * (64 - chunk) + chunk * (chunk + 1) // 2)


@pytest.mark.slow  # a benchmark mode's smoke run; tests/test_tpu_compile.py compiles the kernels
def test_deviceless_mode_compiles_ours_and_jax_ragged_kernel_for_tpu():
    """One layer's mixed step compiled for v5e:2x2 with the XLA path and our kernels, and jax's
    own TPU ragged kernel on the same rows (its interleaved pool, kv heads split the same way):
    all three compile without a device."""
    summary = _run(["--mode=deviceless", "--batches=2", "--chunks=64", "--contexts=512",
                    "--q_per_kv=1", "--dtype=bfloat16"])
    rows = {r["impl"]: r for r in summary["results"]}
    assert set(rows) == {"xla", "pallas", "shipped"} and "skipped" not in rows["shipped"], rows
    assert rows["pallas"]["argument_bytes"] > 0 and rows["shipped"]["argument_bytes"] > 0
