"""Deviceless GPU compile of the paged decode kernels for H100 / H200 (sm_90a), no GPU needed.

`jax[cuda13]` registers a CUDA topology factory even under JAX_PLATFORMS=cpu; given a
`GpuTargetConfigProto` it makes compile-only devices, and `jit(...).lower().compile()` then runs
the whole XLA:GPU pipeline: Pallas -> Triton -> PTX for sm_90a -> ptxas (the nvidia wheels'
binary) -> cubin. That catches what lowering cannot, e.g. a shared-memory overflow
(notes/pallas_on_cpu.md section 2d). Nothing runs: there is no device to run on.

Cases (per target): the ragged flash kernel (`ragged_paged_attention_gpu`: 8 decode rows beside a
512-token prompt chunk over 8k contexts, bf16 and f32, with soft cap + window, and bf16 queries
over int8 pages with their f32 scales), the
speculative-verification kernel (`spec_verify_gpu`, Llama-3 vocabulary
128256, B = 8, R = 4, with draft probabilities and one-hot), our Triton kernel
(`paged_decode_attention_gpu`) at production shapes
(Llama-3-8B heads K=8, G=4, H=128; B=8, 8k context, page 16, bf16; T=1 decode and T=4 speculative
verify; a draft tree's 45 queries with their ancestor masks; f32; int8 pages; soft cap +
sliding window; the largest page sizes that fit), jax's shipped
`ops.gpu.decode_attention.gqa` and `ops.gpu.paged_attention` at the same shapes, and one case
that must fail (f32 pages of 256 tokens: the Triton kernel's shared memory exceeds sm_90's
227 KiB). Our kernels' pools have B * P + 1 pages, like the engine's cache (num_pages + 1).

Per case: compile seconds, ok / FAILED / expected failure caught (+ first line of the error),
and for each Triton kernel in the program the ptxas report (registers, spill bytes) and the
dynamic shared memory XLA launches it with. Exit status 1 if a case that should compile fails or
the must-fail case compiles.

The test extra installs the compile-only part of `jax[cuda13]`: the CUDA plugin
(`jax[cuda13-local]`) and the nvcc wheel's `ptxas`, no CUDA libraries (~545 MB):

  pip install -e '.[test]'
  JAX_PLATFORMS=cpu python scripts/gpu_compile_check.py [--target=both] [--cases=ragged ...]

`tests/test_gpu_compile.py` runs the production-shape cases in CI.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import shutil
import sys
import tempfile
import time

# Before jax is imported: CPU runtime (no driver needed), ptxas reports logged, XLA dumps (for the
# launch shared memory) in a temporary directory.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=2"
_DUMP_DIR = tempfile.mkdtemp(prefix="gpu_compile_check_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP_DIR}").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from pallas_kernels.paged_attention.gpu import (  # noqa: E402
    _paged_decode_pallas,
    paged_decode_attention_gpu,
)
from pallas_kernels.platform import GPU_TARGETS  # noqa: E402
from pallas_kernels.ragged_attention.gpu import ragged_paged_attention_gpu  # noqa: E402
from pallas_kernels.spec_verify.gpu import spec_verify_gpu  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("target", "both", ["h100", "h200", "both"], "GPU(s) to compile for.")
flags.DEFINE_bool("show_logs", False, "Print the captured XLA / ptxas log of each compile.")
flags.DEFINE_multi_string("cases", [], "Only the cases whose name starts with this (repeatable; "
                          "default: all).")


# Llama-3-8B attention heads, production decode batch and context.
B, K, G, H, PAGE, CONTEXT = 8, 8, 4, 128, 16, 8192
SMEM_ERROR = "Shared memory size limit exceeded"


def with_int8_pages(f, args, pools=(1, 2)):
    """(f, args) with the pools at `pools` int8 and their f32 scales [K, ceil(pages / 8), 8,
    page] (the pool's layout, `pallas_kernels.paged_attention.reference`) appended to args,
    which the returned function passes to `f` as k_scales / v_scales."""
    args = list(args)
    for i in pools:
        args[i] = jax.ShapeDtypeStruct(args[i].shape, jnp.int8, sharding=args[i].sharding)
    scales = [jax.ShapeDtypeStruct((k, -(-pages // 8), 8, page), jnp.float32,
                                   sharding=args[i].sharding)
              for i in pools for k, pages, page in [args[i].shape[:3]]]
    n = len(args)
    return (lambda *a: f(*a[:n], k_scales=a[n], v_scales=a[n + 1])), tuple(args + scales)


def ours(sds, *, t=1, dtype=jnp.bfloat16, page=PAGE, validate=True, int8_pages=False,
         **kernel_kwargs):
    """Our kernel; the pool holds every sequence's pages plus one (the engine's layout).
    validate=False skips the wrapper's input checks (whose page-size limit would otherwise
    refuse the must-fail case before the compiler sees it). int8_pages: int8 pools with their
    scales, `dtype` queries."""
    p = CONTEXT // page
    pool = (K, B * p + 1, page, H)
    args = (sds((B, t, K, G, H), dtype), sds(pool, dtype), sds(pool, dtype),
            sds((B,), jnp.int32), sds((B, p), jnp.int32))
    shapes = f"q[{B},{t},{K},{G},{H}] pool[{K},{B * p + 1},{page},{H}] {jnp.dtype(dtype).name}"
    if int8_pages:
        f, args = with_int8_pages(functools.partial(paged_decode_attention_gpu, **kernel_kwargs),
                                  args)
        return f, args, shapes.replace("] ", "] int8 pages + f32 scales, q ", 1)
    if not validate:
        kernel_kwargs = {"pages_per_split": 8, "num_splits": None, "soft_cap": None,
                         "sliding_window": None, "interpret": False, **kernel_kwargs}
        return functools.partial(_paged_decode_pallas, **kernel_kwargs), args, shapes
    return functools.partial(paged_decode_attention_gpu, **kernel_kwargs), args, shapes


def ours_tree(sds, *, nodes=44, words=2, int8_pages=False, **kernel_kwargs):
    """Our kernel's tree path: a verification of a draft tree's root and `nodes` nodes (the
    "4,2,2,1" tree: 45 queries, ancestor masks of `words` i32 words)."""
    _, args, shapes = ours(sds, t=nodes + 1)
    args = (*args, sds((B, nodes + 1, words), jnp.int32), sds((B,), jnp.int32))

    def f(*a, **scales):
        return paged_decode_attention_gpu(*a[:5], tree_mask=a[5], tree_base=a[6], **scales,
                                          **kernel_kwargs)

    shapes += f" tree_mask[{B},{nodes + 1},{words}]"
    if int8_pages:
        f, args = with_int8_pages(f, args)
        shapes = shapes.replace("] ", "] int8 pages + f32 scales, q ", 1)
    return f, args, shapes


def ragged(sds, *, dtype=jnp.bfloat16, chunk=512, int8_pages=False, **kernel_kwargs):
    """The ragged flash kernel over a mixed step: B decode rows and a `chunk`-token prompt chunk,
    every sequence's table covering CONTEXT tokens (B + 1 sequences; the engine's pool layout);
    int8_pages: int8 pools with their scales, `dtype` queries."""
    p, seqs = CONTEXT // PAGE, B + 1
    pool = (K, seqs * p + 1, PAGE, H)
    i32 = jnp.int32
    args = (sds((B + chunk, K, G, H), dtype), sds(pool, dtype), sds(pool, dtype),
            sds((seqs,), i32), sds((seqs, p), i32), sds((seqs,), i32), sds((seqs,), i32))
    shapes = (f"q[{B + chunk},{K},{G},{H}] pool[{K},{seqs * p + 1},{PAGE},{H}] "
              f"{jnp.dtype(dtype).name}")
    f = functools.partial(ragged_paged_attention_gpu, **kernel_kwargs)
    if int8_pages:
        f, args = with_int8_pages(f, args)
        shapes = shapes.replace("] ", "] int8 pages + f32 scales, q ", 1)
    return f, args, shapes


def spec_verify_case(sds, *, one_hot: bool, r=4, vocab=128256):
    """The speculative-verification kernel at Llama-3's vocabulary, B = 8, R = 4."""
    args = (sds((B, r + 1, vocab), jnp.float32), sds((B, r), jnp.int32),
            None if one_hot else sds((B, r, vocab), jnp.float32), sds((B,), jnp.int32),
            sds((B,), jnp.float32), sds((B, r + 1), jnp.float32))
    shapes = (f"logits[{B},{r + 1},{vocab}] f32, q " + ("one-hot" if one_hot else
                                                          f"[{B},{r},{vocab}] f32"))
    return spec_verify_gpu, args, shapes


def shipped_gqa(sds):
    from jax.experimental.pallas.ops.gpu import decode_attention

    bf16 = jnp.bfloat16
    args = (sds((B, K * G, H), bf16), sds((B, CONTEXT, K, H), bf16), sds((B, CONTEXT, K, H), bf16),
            None, sds((B,), jnp.int32))
    return decode_attention.gqa, args, f"q[{B},{K * G},{H}] kv[{B},{CONTEXT},{K},{H}] bfloat16"


def shipped_paged(sds):
    from jax.experimental.pallas.ops.gpu import paged_attention

    p = CONTEXT // PAGE
    pool = (K, B * p + 1, PAGE, H)
    bf16 = jnp.bfloat16
    args = (sds((B, K * G, H), bf16), sds(pool, bf16), sds(pool, bf16), sds((B, p), jnp.int32),
            sds((B,), jnp.int32))
    f = functools.partial(paged_attention.paged_attention, pages_per_compute_block=8,
                          k_splits=16)
    return f, args, f"q[{B},{K * G},{H}] pool[{K},{B * p + 1},{PAGE},{H}] bfloat16"


# (name, builder, must_fail)
CASES = (
    ("ours T=1", ours, False),
    ("ours T=4 (verify)", functools.partial(ours, t=4), False),
    ("ours f32 T=1", functools.partial(ours, dtype=jnp.float32), False),
    ("ours T=4 soft_cap=30 window=4096",
     functools.partial(ours, t=4, soft_cap=30.0, sliding_window=4096), False),
    ("ours int8 pages T=1", functools.partial(ours, int8_pages=True), False),
    ("ours int8 pages T=4 (verify)", functools.partial(ours, t=4, int8_pages=True), False),
    ("ours tree T=45 (4,2,2,1 verify)", ours_tree, False),
    ("ours tree T=45 int8 pages window=4096",
     functools.partial(ours_tree, int8_pages=True, sliding_window=4096), False),
    ("ours page 256 (largest bf16 fit)", functools.partial(ours, page=256), False),
    ("ours f32 page 128 (largest f32 fit)", functools.partial(ours, dtype=jnp.float32, page=128),
     False),
    ("ragged: 8 decode rows + 512-token chunk", ragged, False),
    ("ragged soft_cap=30 window=4096",
     functools.partial(ragged, soft_cap=30.0, sliding_window=4096), False),
    ("ragged f32", functools.partial(ragged, dtype=jnp.float32), False),
    ("ragged int8 pages", functools.partial(ragged, int8_pages=True), False),
    ("spec_verify, draft probabilities", functools.partial(spec_verify_case, one_hot=False),
     False),
    ("spec_verify, one-hot drafts", functools.partial(spec_verify_case, one_hot=True), False),
    ("jax ops.gpu.decode_attention.gqa", shipped_gqa, False),
    ("jax ops.gpu.paged_attention", shipped_paged, False),
    ("MUST FAIL: ours f32 page 256",
     functools.partial(ours, dtype=jnp.float32, page=256, validate=False), True),
)

_PTXAS = re.compile(
    r"entry function '(\w+)' for '(\w+)'.*?Function properties for \1\s*\n\s*\d+ bytes stack "
    r"frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S)
_THUNK = re.compile(r"kCustomKernel .*?\] (\S+) grid: (\[[^\]]*\]) .*?shared_memory: (\d+) bytes")


@contextlib.contextmanager
def captured_stderr(sink: list):
    """Redirects fd 2 (where XLA's C++ logging and ptxas reports go) into `sink[0]`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode(errors="replace"))


def triton_kernels(lowered_text: str) -> list[str]:
    """Names of the Triton custom calls in a lowered program."""
    names = []
    for line in lowered_text.splitlines():
        if "__gpu$xla.gpu.triton" in line:
            m = re.search(r'\bname = "([^"]+)"', line)
            if m and m.group(1) not in names:
                names.append(m.group(1))
    return names


def kernel_report(names, log: str, new_dumps: list[str]) -> str:
    """Per Triton kernel: arch, registers and spill bytes (stores + loads) from ptxas; dynamic
    shared memory and grid from XLA's thunk-sequence dump."""
    ptxas = {m.group(1): (m.group(5), int(m.group(3)) + int(m.group(4)), m.group(2))
             for m in _PTXAS.finditer(log)}
    smem = {}
    for path in new_dumps:
        with open(path) as f:
            for m in _THUNK.finditer(f.read()):
                smem[m.group(1)] = (m.group(3), m.group(2))
    parts = []
    for name in names:
        regs, spill, arch = ptxas.get(name, ("?", "?", "?"))
        shm, grid = smem.get(name, ("?", "?"))
        parts.append(f"{name}: {arch}, {regs} regs, spill {spill} B, smem {shm} B, grid {grid}")
    return "; ".join(parts) or "(no Triton kernel in the program)"


def compile_case(device, builder, must_fail: bool):
    """Returns (seconds, status, detail) for one case on one compile-only device."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    f, args, shapes = builder(sds)
    before = set(glob.glob(os.path.join(_DUMP_DIR, "*thunk_sequence.txt")))
    log, names = [], []
    t0 = time.perf_counter()
    try:
        with captured_stderr(log):
            lowered = jax.jit(f).trace(*args).lower()
            names = triton_kernels(lowered.as_text())
            lowered.compile()
        seconds = time.perf_counter() - t0
        new = sorted(set(glob.glob(os.path.join(_DUMP_DIR, "*thunk_sequence.txt"))) - before)
        detail = kernel_report(names, log[0], new)
        status = "UNEXPECTEDLY COMPILED" if must_fail else "ok"
    except Exception as e:  # any compile error is a result to report
        seconds = time.perf_counter() - t0
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        detail = f"{type(e).__name__}: {first}"
        if must_fail and SMEM_ERROR in str(e):
            status = "expected failure caught"
        else:
            status = "FAILED" + (" (not the expected shared-memory error)" if must_fail else "")
    if FLAGS.show_logs and log:
        print(log[0], file=sys.stderr)
    return shapes, seconds, status, detail


def selected_cases(prefixes: list[str]):
    """CASES whose names start with one of `prefixes` (all of them for none)."""
    chosen = [c for c in CASES if not prefixes or c[0].startswith(tuple(prefixes))]
    if not chosen:
        raise app.UsageError(f"--cases={prefixes} matches no case; the cases are: "
                             + "; ".join(c[0] for c in CASES))
    return chosen


def main(argv):
    del argv
    targets = ["h100", "h200"] if FLAGS.target == "both" else [FLAGS.target]
    with captured_stderr([]):  # backend start-up INFO lines
        platforms = sorted({d.platform for d in jax.devices()})
    print(f"jax {jax.__version__}, JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')}, "
          f"runtime devices: {platforms} (GPU devices below are compile-only)")
    rows, bad = [], 0
    t_start = time.perf_counter()
    try:
        for target in targets:
            try:
                with captured_stderr([]):
                    topo = topologies.get_topology_desc(target, "cuda",
                                                        target_config=GPU_TARGETS[target],
                                                        topology="1x1x1")
            except NotImplementedError as e:  # no CUDA plugin in this environment
                raise app.UsageError(f"{e}: run with a jax[cuda13] environment (see the "
                                     "module docstring for the install command)") from e
            device = topo.devices[0]
            print(f"{target}: compile-only device {device.device_kind!r} ({device.platform})",
                  flush=True)
            for name, builder, must_fail in selected_cases(FLAGS.cases):
                shapes, seconds, status, detail = compile_case(device, builder, must_fail)
                ok = status in ("ok", "expected failure caught")
                bad += not ok
                rows.append((target, name, shapes, f"{seconds:.2f}", status, detail))
                print(f"  {name}: {status} in {seconds:.2f}s", flush=True)
    finally:
        shutil.rmtree(_DUMP_DIR, ignore_errors=True)

    print()
    print("| target | case | shapes | compile s | result | Triton kernel (ptxas; launch) / error |")
    print("| --- | --- | --- | ---: | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{len(rows)} compiles in {time.perf_counter() - t_start:.1f}s; "
          f"{'all as expected' if not bad else f'{bad} NOT as expected'}")
    return 1 if bad else 0


if __name__ == "__main__":
    app.run(main)
