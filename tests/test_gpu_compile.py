"""The GPU kernels compiled all the way to sm_90a cubin (Triton -> PTX -> ptxas), no GPU needed.

`scripts/gpu_compile_check.py` in a process of its own (it sets XLA's dump flags before jax
starts) on a compile-only H100: the decode kernel and the ragged flash kernel at Llama-3-8B
shapes (8k contexts, a 512-token prompt chunk) over bf16 and int8 pages (and a draft tree's 45
queries with their ancestor masks), the speculative
verification kernel at Llama 3's vocabulary, and the case that must fail (a Triton kernel over
sm_90's shared memory, caught by ptxas's limit rather than compiled). Needs the test extra's
compile-only CUDA plugin (`tests.helpers.require_cuda_compiler`)."""
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import require_cuda_compiler

ROOT = Path(__file__).resolve().parents[1]
CASES = ("ours T=1", "ours int8 pages T=4", "ours tree T=45 int8", "ragged: 8 decode rows",
         "ragged int8 pages", "spec_verify, draft", "MUST FAIL")


def test_kernels_compile_to_sm90a_cubin():
    require_cuda_compiler()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, "scripts/gpu_compile_check.py", "--target=h100",
                          *(f"--cases={c}" for c in CASES)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| h100 |")]
    assert len(rows) == len(CASES), run.stdout
    for row in rows:
        status, detail = (c.strip() for c in row.split("|")[5:7])
        if "MUST FAIL" in row:
            assert status == "expected failure caught", row
            continue
        assert status == "ok", row
        # Every Triton kernel in the program reached ptxas for sm_90a without spilling.
        kernels = [k for k in detail.split(";") if "regs" in k]
        assert kernels and all("sm_90a" in k and "spill 0 B" in k for k in kernels), row
