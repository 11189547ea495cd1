"""jaxinfer benchmark: prefill (TTFT) and batched decode, against the roofline and Hugging Face.

Mirrors `scripts/hf_bench.py` point for point, so the two sides run the same work:

* prefill: batch 1, a random prompt of T tokens into a fresh one-slot cache in chunks of
  --prefill_chunk tokens (512, the largest default bucket: a 2048-token prompt is four
  chunks, as `generate` runs it), greedy first token fetched to the host. One untimed warm-up
  call (its time, compile included, is reported apart), then --repeats timed calls; the median
  is reported as TTFT ms, tok/s = T / time, and the FLOP fraction =
  roofline.prefill_flops / time / peak.
* decode: B slots, each prefilled (untimed) with its own random --decode_prompt_len-token prompt,
  then --decode_steps greedy decode steps, each followed by ONE host transfer of the sampled ids
  (as the generate loop does). Every page bucket the timed steps hit is compiled first (reported
  apart). Each repeat restores the lengths and first tokens left by the prefill. Reported:
  ms/step (median over repeats), tok/s = B / step time, the bandwidth fraction =
  roofline.decode_step_bytes (KV read = the page-bucketed span each row reads) / time / bandwidth,
  and the FLOP fraction.
* random ids: `np.random.default_rng(seed).integers(0, vocab, (batch, len))`, a fresh generator
  per point (the rule of hf_bench.py, so both sides see the same ids).
* the roofline of this host is measured first (roofline.measure_host_cpu), or taken from
  notes/cpu_peers.md with --skip_measure. JAX and HF run one after the other, never together.

Output: a table per dtype, the issue's targets (PASS/MISS: a benchmark reports, it does not
assert), then exactly one JSON line (the last line of stdout). Progress goes to stderr.

  python scripts/benchmark.py --hf_python=/work/hfvenv/bin/python          # full sweep (long)
  python scripts/benchmark.py --dtypes=float32 --prefill_lens=128 --decode_batches=1,8 \\
      --decode_steps=8 --repeats=1 --skip_measure                           # quick check
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxinfer import roofline, steps
from jaxinfer.config import CacheConfig, ModelConfig, RunConfig, SamplingConfig
from jaxinfer.kv_cache import create_cache, pages_bucket
from jaxinfer.loading import load_model
from jaxinfer.sampling import SamplingParams
from jaxinfer.weights import load_checkpoint

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_string("model_path", None, "GGUF file or HF directory (default: embedded SmolLM2).")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Model dtypes to benchmark.")
flags.DEFINE_list("prefill_lens", ["128", "512", "2048"], "Prefill prompt lengths T.")
flags.DEFINE_list("decode_batches", ["1", "8", "32", "64"], "Decode batch sizes B.")
flags.DEFINE_integer("decode_prompt_len", 16, "Prompt tokens per decode row.")
flags.DEFINE_integer("decode_steps", 64, "Timed decode steps per repeat.")
flags.DEFINE_integer("repeats", 3, "Timed repeats per point (median reported).")
flags.DEFINE_integer("seed", 0, "Seed of the random prompt ids.")
flags.DEFINE_string("hf_python", "", "Python with torch + transformers for scripts/hf_bench.py "
                    "(e.g. /work/hfvenv/bin/python); empty = skip Hugging Face.")
flags.DEFINE_list("hf_dtypes", ["float32"], "Dtypes to run on the Hugging Face side.")
flags.DEFINE_integer("page_size", 16, "KV cache page size.")
flags.DEFINE_integer("prefill_chunk", 512, "Prefill chunk (tokens), as the engine's largest "
                     "default bucket; longer prompts are prefilled in chunks (0 = one chunk).")
flags.DEFINE_bool("skip_measure", False, "Use the notes' host numbers (24.8 GB/s, 74.2 GFLOP/s, "
                  "measured on a 2-core Zen 1 host) instead of measuring: quick runs only, the "
                  "fractions are wrong on any other CPU.")
flags.DEFINE_float("max_seconds", 3600.0, "Skip the remaining points once a side's run exceeds "
                   "this (also passed to hf_bench.py).")


def _log(msg: str) -> None:
    print(f"[benchmark] {msg}", file=sys.stderr, flush=True)


def random_ids(seed: int, vocab: int, batch: int, length: int) -> np.ndarray:
    """i32[batch, length]: the rule of hf_bench.py (a fresh generator per point)."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length)).astype(np.int32)


def host_roof() -> dict:
    if FLAGS.skip_measure:
        return {"source": "notes/cpu_peers.md", "hbm_bytes_per_s": roofline.NOTES_HOST_BYTES_PER_S,
                "peak_flops_f32": roofline.NOTES_HOST_FLOPS_F32}
    _log("measuring the host (GEMV 512 MiB, GEMM 4096^2; numpy and jax) ...")
    m = roofline.measure_host_cpu()
    _log(f"host: {m['hbm_bytes_per_s'] / 1e9:.1f} GB/s, {m['peak_flops_f32'] / 1e9:.1f} GFLOP/s")
    return {"source": "measured", **m}


class Model:
    """graph + params of one dtype, and what the points need to know about them."""

    def __init__(self, ckpt, dtype: str):
        model, _ = load_model(RunConfig(model_path=FLAGS.model_path, dtype=dtype), ckpt)
        self.config: ModelConfig = model.config
        self.graph, self.params = steps.split_model(model)
        self.dtype_bytes = jnp.dtype(dtype).itemsize
        self.param_bytes = sum(x.nbytes for x in jax.tree.leaves(self.params))

    def cache(self, max_seq_len: int, slots: int):
        cc = CacheConfig(page_size=FLAGS.page_size, max_seq_len=max_seq_len)
        cache = create_cache(self.config, cc, slots)
        state = steps.create_slot_state(slots, self.config.vocab_size)
        return cc, cache, state, SamplingParams.from_configs([SamplingConfig()] * slots)

    def prefill(self, cache, state, sampling, ids: np.ndarray, slot: int, chunk: int = 0):
        """The prompt into `slot` in chunks of `chunk` tokens (0 = one chunk), as the engine
        prefills with its largest bucket; returns cache, state, out of the last chunk."""
        n = len(ids)
        size = min(chunk or n, n)
        page_size, pages_per_seq = cache.page_size, cache.pages_per_seq
        for start in range(0, n, size):
            piece = ids[start:start + size]
            cache, state, out = steps.prefill_step(
                self.graph, self.params, cache, state, sampling, piece, np.int32(slot),
                np.int32(start), np.int32(len(piece)), np.bool_(start + size >= n),
                num_pages_read=pages_bucket(start + len(piece), page_size, pages_per_seq))
        return cache, state, out


def bench_prefill(m: Model, t: int, roof: dict) -> dict:
    cc, cache, state, sampling = m.cache(t, 1)
    ids = random_ids(FLAGS.seed, m.config.vocab_size, 1, t)[0]
    times = []
    for _ in range(FLAGS.repeats + 1):  # the first call compiles: reported apart
        t0 = time.perf_counter()
        cache, state, out = m.prefill(cache, state, sampling, ids, 0, FLAGS.prefill_chunk)
        jax.device_get(out.tokens)
        times.append(time.perf_counter() - t0)
    secs = statistics.median(times[1:])
    flops = roofline.prefill_flops(m.config, t)
    return {"len": t, "ms": secs * 1e3, "tok_s": t / secs, "first_call_s": times[0],
            "compile_s": times[0] - secs, "runs_ms": [x * 1e3 for x in times[1:]],
            "flops": flops, "gflop_s": flops / secs / 1e9,
            "flop_fraction": roofline.flops_fraction(flops, secs, roof["peak_flops_f32"])}


def _decode_run(m: Model, cache, state, sampling, plan: list[int]):
    """Times len(plan) decode steps, one host transfer of the sampled ids each."""
    tokens = []
    t0 = time.perf_counter()
    for pages in plan:
        cache, state, out = steps.decode_step(m.graph, m.params, cache, state, sampling,
                                              num_pages_read=pages)
        tokens.append(jax.device_get(out.tokens))
    return time.perf_counter() - t0, cache, state, np.stack(tokens)


def bench_decode(m: Model, batch: int, roof: dict) -> dict:
    n, num_steps = FLAGS.decode_prompt_len, FLAGS.decode_steps
    cc, cache, state, sampling = m.cache(n + num_steps + FLAGS.page_size, batch)
    ids = random_ids(FLAGS.seed, m.config.vocab_size, batch, n)
    for b in range(batch):
        cache, state, _ = m.prefill(cache, state, sampling, ids[b], b)
    first_tokens, lengths = jax.device_get((state.tokens, cache.lengths))
    # Step i holds n + i tokens and writes one more: its bucket covers n + i + 1.
    plan = [pages_bucket(n + i + 1, cc.page_size, cc.pages_per_seq) for i in range(num_steps)]
    t0 = time.perf_counter()
    for pages in sorted(set(plan)):  # compile every bucket; runs one step each on the way
        cache, state, out = steps.decode_step(m.graph, m.params, cache, state, sampling,
                                              num_pages_read=pages)
        jax.device_get(out.tokens)
    warmup_s = time.perf_counter() - t0
    times, outs = [], []
    for _ in range(FLAGS.repeats):
        cache = cache.replace(lengths=jnp.asarray(lengths))
        state = state.replace(tokens=jnp.asarray(first_tokens))
        secs, cache, state, toks = _decode_run(m, cache, state, sampling, plan)
        times.append(secs / num_steps)
        outs.append(toks)
    step = statistics.median(times)
    span = float(np.mean(plan)) * cc.page_size  # positions each row reads, page-bucketed
    live = n + (num_steps + 1) / 2  # mean positions really in the cache after the write
    cache_bytes = jnp.dtype(cache.k_pages[0].dtype).itemsize
    nbytes = roofline.decode_step_bytes(m.config, batch, span, m.dtype_bytes, cache_bytes)
    live_bytes = roofline.decode_step_bytes(m.config, batch, live, m.dtype_bytes, cache_bytes)
    flops = roofline.decode_step_flops(m.config, batch, span)
    return {
        "batch": batch, "ms_per_step": step * 1e3, "tok_s": batch / step,
        "runs_ms_per_step": [x * 1e3 for x in times],
        "compile_s": max(0.0, warmup_s - len(set(plan)) * step),
        "page_buckets": sorted(set(plan)), "kv_tokens_read_mean": span,
        "bytes_per_step": nbytes, "gb_s": nbytes / step / 1e9,
        "bw_fraction": roofline.bandwidth_fraction(nbytes, step, roof["hbm_bytes_per_s"]),
        "bw_fraction_live_kv": roofline.bandwidth_fraction(live_bytes, step,
                                                           roof["hbm_bytes_per_s"]),
        "flops_per_step": flops, "gflop_s": flops / step / 1e9,
        "flop_fraction": roofline.flops_fraction(flops, step, roof["peak_flops_f32"]),
        "repeats_agree": all(np.array_equal(o, outs[0]) for o in outs),
    }


def run_jax(ckpt, dtype: str, roof: dict) -> dict:
    t0 = time.perf_counter()
    m = Model(ckpt, dtype)
    res = {"load_s": time.perf_counter() - t0, "param_bytes": m.param_bytes,
           "roofline_weight_bytes": roofline.weight_bytes(m.config, m.dtype_bytes),
           "prefill": [], "decode": []}
    _log(f"{dtype}: model ready in {res['load_s']:.1f}s ({m.param_bytes / 1e6:.1f} MB of params)")
    start = time.perf_counter()
    for t in (int(x) for x in FLAGS.prefill_lens):
        if time.perf_counter() - start > FLAGS.max_seconds:
            res["prefill"].append({"len": t, "skipped": True})
            continue
        res["prefill"].append(r := bench_prefill(m, t, roof))
        _log(f"{dtype} prefill T={t}: {r['ms']:.1f} ms (first call {r['first_call_s']:.1f}s)")
    for b in (int(x) for x in FLAGS.decode_batches):
        if time.perf_counter() - start > FLAGS.max_seconds:
            res["decode"].append({"batch": b, "skipped": True})
            continue
        res["decode"].append(r := bench_decode(m, b, roof))
        _log(f"{dtype} decode B={b}: {r['ms_per_step']:.2f} ms/step "
             f"(compile {r['compile_s']:.1f}s)")
    res["bench_s"] = time.perf_counter() - start
    return res


def run_hf(ckpt, dtype: str) -> dict:
    """Runs scripts/hf_bench.py with the same points; returns its JSON line (or an error)."""
    if ckpt.format != "gguf":
        return {"error": "hf_bench.py loads GGUF files only"}
    cmd = [FLAGS.hf_python, os.path.join(REPO_ROOT, "scripts", "hf_bench.py"),
           f"--gguf={ckpt.path}", f"--dtype={dtype}",
           f"--prefill_lens={','.join(FLAGS.prefill_lens)}",
           f"--decode_batches={','.join(FLAGS.decode_batches)}",
           f"--decode_prompt_len={FLAGS.decode_prompt_len}",
           f"--decode_steps={FLAGS.decode_steps}", f"--repeats={FLAGS.repeats}",
           f"--seed={FLAGS.seed}", f"--max_seconds={FLAGS.max_seconds}"]
    _log(f"running Hugging Face: {' '.join(cmd)}")
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    except OSError as e:
        return {"error": f"cannot run {FLAGS.hf_python}: {e}"}
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    for line in lines[:-1]:
        print(f"[hf_bench] {line}", file=sys.stderr)
    try:
        return json.loads(lines[-1]) if proc.returncode == 0 else {
            "error": f"exit status {proc.returncode}"}
    except (IndexError, json.JSONDecodeError) as e:
        return {"error": f"no JSON line from hf_bench.py ({e})"}


def _fmt(x, width: int, digits: int) -> str:
    return f"{x:{width}.{digits}f}" if isinstance(x, (int, float)) else "-".rjust(width)


def print_table(dtype: str, res: dict, hf: dict | None) -> None:
    hf_pre = {r["len"]: r for r in (hf or {}).get("prefill", []) if not r.get("skipped")}
    hf_dec = {r["batch"]: r for r in (hf or {}).get("decode", []) if not r.get("skipped")}
    print(f"\njaxinfer {dtype} vs hf-transformers {dtype if hf else '(not run)'}; roofline: "
          "prefill = FLOP fraction, decode = bandwidth fraction (bucketed KV span)")
    print(f"{'point':>14} {'jax ms':>10} {'jax tok/s':>10} {'roofline':>9} {'HF ms':>10} "
          f"{'HF tok/s':>10} {'speedup':>8}")
    rows = [(f"prefill T={r['len']}", r, hf_pre.get(r["len"]), "ms", "flop_fraction")
            for r in res["prefill"]]
    rows += [(f"decode B={r['batch']}", r, hf_dec.get(r["batch"]), "ms_per_step", "bw_fraction")
             for r in res["decode"]]
    for name, r, h, ms_key, frac_key in rows:
        if r.get("skipped"):
            print(f"{name:>14} {'skipped':>10}")
            continue
        h = h or {}
        speed = r["tok_s"] / h["tok_s"] if h.get("tok_s") else None
        print(f"{name:>14} {_fmt(r[ms_key], 10, 2)} {_fmt(r['tok_s'], 10, 1)} "
              f"{_fmt(r[frac_key], 9, 3)} {_fmt(h.get(ms_key), 10, 2)} "
              f"{_fmt(h.get('tok_s'), 10, 1)} {_fmt(speed, 7, 2)}{'x' if speed else ' '}")


def check_targets(jax_res: dict, hf_res: dict) -> list[dict]:
    """The issue's targets, PASS / MISS / NOT MEASURED (reported, never asserted)."""
    def point(res, batch):
        return next((r for r in (res or {}).get("decode", [])
                     if r["batch"] == batch and not r.get("skipped")), None)

    out = []
    b1 = point(jax_res.get("float32"), 1)
    frac = b1["bw_fraction"] if b1 else None
    out.append({"target": "f32 decode B=1 bandwidth fraction >= 0.80", "value": frac,
                "status": "NOT MEASURED" if frac is None else "PASS" if frac >= 0.8 else "MISS"})
    b32, hf32 = point(jax_res.get("float32"), 32), point(hf_res.get("float32"), 32)
    ratio = b32["tok_s"] / hf32["tok_s"] if b32 and hf32 else None
    out.append({"target": "f32 decode B=32 tok/s >= 2x HF", "value": ratio,
                "jax_tok_s": b32 and b32["tok_s"], "hf_tok_s": hf32 and hf32["tok_s"],
                "status": "NOT MEASURED" if ratio is None else "PASS" if ratio >= 2 else "MISS"})
    return out


def cpu_info() -> dict:
    """Which CPU ran this (the roofline of one x86 host says nothing about another)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (x.strip() for x in line.partition(":"))
                if key in ("model name", "cpu family", "model", "flags") and key not in info:
                    info[key] = value
    except OSError:
        return {}
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    info["flags"] = [x for x in info.get("flags", "").split() if x in wanted]
    return info


def suspicious(jax_res: dict) -> list[str]:
    """Points whose achieved rate exceeds the roofline: the host numbers are stale or disturbed."""
    out = []
    for dtype, res in jax_res.items():
        for r in res["prefill"] + res["decode"]:
            for key in ("flop_fraction", "bw_fraction"):
                if (r.get(key) or 0) > 1:
                    name = f"T={r['len']}" if "len" in r else f"B={r['batch']}"
                    out.append(f"{dtype} {name} {key}={r[key]:.2f} > 1")
    return out


def versions() -> dict:
    import flax
    import jaxlib

    return {"python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__, "numpy": np.__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    load_start = os.getloadavg()
    roof = host_roof()
    ckpt = load_checkpoint(FLAGS.model_path)
    jax_res = {dtype: run_jax(ckpt, dtype, roof) for dtype in FLAGS.dtypes}
    hf_res = {dtype: run_hf(ckpt, dtype) for dtype in FLAGS.hf_dtypes} if FLAGS.hf_python else {}
    for dtype, res in jax_res.items():
        hf = hf_res.get(dtype)
        print_table(dtype, res, hf if hf and "error" not in hf else None)
    for dtype, hf in hf_res.items():
        if "error" in hf:
            print(f"hf-transformers {dtype}: {hf['error']}")
    targets = check_targets(jax_res, hf_res)
    print()
    for t in targets:
        extra = (f"; jax {_fmt(t['jax_tok_s'], 0, 1)} tok/s, HF {_fmt(t['hf_tok_s'], 0, 1)}"
                 " tok/s" if "jax_tok_s" in t else "")
        print(f"target {t['target']}: {t['status']} (value {_fmt(t['value'], 0, 3)}{extra})")
    warnings = suspicious(jax_res)
    for w in warnings:
        print(f"WARNING roofline exceeded: {w}: measure the host on a quiet machine "
              "(without --skip_measure)")
    load_end = os.getloadavg()
    print(json.dumps({
        "system": "jaxinfer", "argv": sys.argv, "model": ckpt.path, "seed": FLAGS.seed,
        "repeats": FLAGS.repeats, "decode_prompt_len": FLAGS.decode_prompt_len,
        "decode_steps": FLAGS.decode_steps, "page_size": FLAGS.page_size,
        "versions": versions(),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "cpu": cpu_info(), "roofline": roof, "loadavg_start": load_start,
                    "loadavg_end": load_end},
        "jaxinfer": jax_res, "hf": hf_res, "targets": targets, "warnings": warnings}),
          flush=True)


if __name__ == "__main__":
    app.run(main)
