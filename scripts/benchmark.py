"""jaxinfer benchmark: prefill (TTFT) and batched decode through the serving engine, against the
roofline and Hugging Face.

Every point runs what a user runs: requests added to an `Engine` (`jaxinfer.engine.engine`) and
`Engine.step()` called until their tokens stream back. The engine overlaps host and device (it
dispatches step n, then waits for step n - 1's sampled ids), so a request's first token comes
back from the step after the one that computed it. Mirrors `scripts/hf_bench.py` point for
point, so the two sides run the same work:

* prefill: an engine with one slot, prefix caching off (each repeat recomputes the prompt) and
  prefill chunks of --prefill_chunk tokens (512: a 2048-token prompt is four chunks); a random
  prompt of T tokens with `max_new_tokens=1, ignore_eos=True`, timed from `add_request` until
  `step()` returns its first token. The step variants the request uses are compiled first
  (`Engine.warmup(workload=...)`, reported as compile_s), then one untimed warm-up request
  (first_call_s), then --repeats timed ones; the median is reported as TTFT ms,
  tok/s = T / time, and the FLOP fraction = roofline.prefill_flops / time / peak.
* decode: an engine with B slots and a token budget that prefills all B prompts in one step;
  B requests of their own random --decode_prompt_len-token prompts, greedy, `ignore_eos=True`,
  max_new_tokens = --decode_steps + 2. The engine steps (untimed) until every request has its
  first token, then --decode_steps consecutive `step()` calls are timed: in that steady state
  each step dispatches one decode row per request and streams one token per request (the
  tokens counted must be B per step). The variants are compiled first (`Engine.warmup`, reported
  apart); each repeat adds fresh requests with the same prompts (same work, same page buckets:
  the greedy tokens must agree across repeats). Reported: ms/step (median over repeats),
  tok/s = B / step time, the bandwidth fraction = roofline.stored_decode_step_bytes (KV read = the
  page-bucketed span each row reads) / time / bandwidth, and the FLOP fraction. The timed window
  waits for the device work of the decode steps that read n + 1 .. n + --decode_steps cached
  positions (n = --decode_prompt_len); their page buckets are reported.
* random ids: `np.random.default_rng(seed).integers(0, vocab, (batch, len))`, a fresh generator
  per point (the rule of hf_bench.py, so both sides see the same ids).
* the roofline of this host is measured first (roofline.measure_host_cpu), or taken from
  notes/cpu_peers.md with --skip_measure. JAX and HF run one after the other, never together.

Output: a table per dtype, the targets (PASS/MISS: a benchmark reports, it does not assert),
then exactly one JSON line (the last line of stdout). Progress goes to stderr.

  python scripts/benchmark.py --hf_python=/work/hfvenv/bin/python          # full sweep (long)
  python scripts/benchmark.py --dtypes=float32 --prefill_lens=128 --decode_batches=1,8 \\
      --decode_steps=8 --repeats=1 --skip_measure                           # quick check

Quantized weights and KV side by side with f32 (one engine per configuration, one run): each
point's roofline is its own bytes as stored (weights with their scales; KV bytes per token with
an int8 pool's scales), and a last table puts the configurations in one row each:

  python scripts/benchmark.py --dtypes=float32 --weight_dtype=float32,int8,int4 \\
      --kv_dtype=float32,int8 --prefill_lens=512 --decode_batches=1,8,32

The two layouts of the layer stack (`ModelConfig.scan_layers`: unrolled, or a scan over stacked
weights) side by side, each point's compile seconds in the JSON line:

  python scripts/benchmark.py --dtypes=float32 --prefill_lens=512 --decode_batches=1,8,32 \
      --scan_layers=false,true

A mixture of experts beside a dense model of equal active parameters (random weights, the
shapes of `MOE_VS_DENSE`; decode only, the first of --dtypes): tok/s per batch and the bytes a
step reads by the expert-touch model (the weights less the experts its B rows are expected not
to route to, E (1 - (1 - k/E)^B) of E read per mixture layer, `planner.unread_expert_bytes`):

  python scripts/benchmark.py --moe_vs_dense --dtypes=float32 --decode_batches=1,8 \
      --decode_steps=16 --repeats=3 --skip_measure

The same decode rate from `jaxinfer-generate`: its stderr line "decode X tok/s" is the decode
tokens of all requests over the span from the first first-token to the last token, i.e.
B / step time once B requests decode together. With B prompts of a few tokens each (written by
--write_prompts: natural-language prompts, B = the last --decode_batches value), both commands
decode B rows per step over a short, growing context:

  python scripts/benchmark.py --write_prompts=/tmp/prompts8.txt --decode_batches=8
  python scripts/benchmark.py --dtypes=float32 --prefill_lens= --decode_batches=8 \\
      --decode_steps=64 --repeats=3 --skip_measure                   # "decode B=8 ... tok/s"
  jaxinfer-generate --prompts_file=/tmp/prompts8.txt --max_new_tokens=64 --ignore_eos \\
      --max_slots=8                                                   # "decode X tok/s"
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from jaxinfer.checkpoint.loading import load_model
from jaxinfer.checkpoint.weights import load_checkpoint
from jaxinfer.config import CacheConfig, EngineConfig, ModelConfig, RunConfig, SamplingConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_cache import cache_bytes, pages_bucket
from jaxinfer.model import Llama, init_params, quant
from jaxinfer.model.quant import QUANT_DTYPES
from jaxinfer.perf import planner, roofline

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_string("model_path", None, "GGUF file or HF directory (default: embedded SmolLM2).")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Model dtypes to benchmark.")
flags.DEFINE_list("weight_dtype", [], "Weight storage dtypes run with each of --dtypes "
                  "(float32, bfloat16, int8, int4: `jaxinfer.model.quant`); empty = the model "
                  "dtype. A float one other than the model dtype is skipped.")
flags.DEFINE_list("kv_dtype", [], "KV cache dtypes run with each weight dtype (float32, "
                  "bfloat16, int8); empty = the model dtype.")
flags.DEFINE_list("scan_layers", ["auto"], "Layer stack layouts run with each configuration "
                  "(auto, true: scanned, false: unrolled; `ModelConfig.scan_layers`).")
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
flags.DEFINE_integer("prefill_chunk", 512, "Prefill chunk (tokens) of the prefill engine; "
                     "longer prompts are prefilled in chunks (0 = one chunk).")
flags.DEFINE_bool("skip_measure", False, "Use the notes' host numbers (24.8 GB/s, 74.2 GFLOP/s, "
                  "measured on a 2-core Zen 1 host) instead of measuring: quick runs only, the "
                  "fractions are wrong on any other CPU.")
flags.DEFINE_float("max_seconds", 3600.0, "Skip the remaining points once a side's run exceeds "
                   "this (also passed to hf_bench.py).")
flags.DEFINE_bool("moe_vs_dense", False, "Decode a random mixture of experts beside a dense "
                  "model of equal active parameters (`MOE_VS_DENSE`) instead of --model_path.")
flags.DEFINE_string("write_prompts", "", "Write B natural-language prompts (B = the last "
                    "--decode_batches value), one per line, to this file for "
                    "`jaxinfer-generate --prompts_file`, and exit.")

PROMPT_SUBJECTS = ["a lighthouse keeper", "the first snow of winter", "a robot learning to paint",
                   "a lost city under the sea", "two rival bakers", "a journey across a desert",
                   "a cat who runs a library", "the last day of summer"]


def _log(msg: str) -> None:
    print(f"[benchmark] {msg}", file=sys.stderr, flush=True)


def random_ids(seed: int, vocab: int, batch: int, length: int) -> np.ndarray:
    """i32[batch, length]: the rule of hf_bench.py (a fresh generator per point)."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length)).astype(np.int32)


def write_prompts(path: str, batch: int) -> None:
    """`batch` prompts of a few tokens each, one per line (subjects cycle past 8)."""
    with open(path, "w") as f:
        for i in range(batch):
            f.write(f"Write a long story about {PROMPT_SUBJECTS[i % len(PROMPT_SUBJECTS)]}.\n")


def host_roof() -> dict:
    if FLAGS.skip_measure:
        return {"source": "notes/cpu_peers.md", "hbm_bytes_per_s": roofline.NOTES_HOST_BYTES_PER_S,
                "peak_flops_f32": roofline.NOTES_HOST_FLOPS_F32}
    _log("measuring the host (GEMV 512 MiB, GEMM 4096^2; numpy and jax) ...")
    m = roofline.measure_host_cpu()
    _log(f"host: {m['hbm_bytes_per_s'] / 1e9:.1f} GB/s, {m['peak_flops_f32'] / 1e9:.1f} GFLOP/s")
    return {"source": "measured", **m}


class Model:
    """One dtype's model (`model`, or the checkpoint's), and an engine per point built from it."""

    def __init__(self, ckpt, run: Run, model: Llama | None = None):
        self.model: Llama = model or load_model(RunConfig(
            model_path=FLAGS.model_path, dtype=run.dtype, weight_dtype=run.weight_dtype,
            scan_layers=run.scan_layers), ckpt)[0]
        self.config: ModelConfig = self.model.config
        self.kv_dtype = run.kv_dtype
        self.param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(self.model)))
        self.kv_bytes_per_token = 0  # set from the first engine's pool (int8 scales included)
        self.attention_impl = None

    def engine(self, *, max_seq_len: int, slots: int, **engine_kw) -> Engine:
        engine = Engine(self.model, None,
                        cache=CacheConfig(page_size=FLAGS.page_size, max_seq_len=max_seq_len,
                                          dtype=self.kv_dtype),
                        engine=EngineConfig(max_slots=slots, enable_prefix_caching=False,
                                            **engine_kw))
        self.param_bytes = sum(quant.array_bytes(x.shape, x.dtype)  # int4: half a byte
                               for x in jax.tree.leaves(engine.runner.params))
        kv = engine.runner.kv
        self.kv_bytes_per_token = cache_bytes(kv) / (kv.k_pages[0].shape[-3] * kv.page_size)
        self.attention_impl = engine.runner.attention_impl
        return engine


def _first_token(engine: Engine, ids: np.ndarray, sampling: SamplingConfig) -> float:
    """Seconds from add_request until step() returns the request's first token; then drains
    the engine (untimed) so the next call starts on an idle device."""
    t0 = time.perf_counter()
    rid = engine.add_request(ids, sampling)
    while not any(out.request_id == rid for out in engine.step()):
        pass
    secs = time.perf_counter() - t0
    engine.run()
    engine.runner.block_until_ready()
    engine.forget(rid)
    return secs


def bench_prefill(m: Model, t: int, roof: dict) -> dict:
    chunk = FLAGS.prefill_chunk or t
    buckets = tuple(sorted(set(EngineConfig().prefill_buckets) | {chunk}))
    engine = m.engine(max_seq_len=t + 1, slots=1, prefill_buckets=buckets,
                      prefill_chunk_size=chunk, max_num_batched_tokens=chunk)
    ids = random_ids(FLAGS.seed, m.config.vocab_size, 1, t)[0].tolist()
    sampling = SamplingConfig(max_new_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    variants = engine.warmup(workload=[(ids, sampling)])
    compile_s = time.perf_counter() - t0
    first = _first_token(engine, ids, sampling)  # untimed warm-up request
    times = [_first_token(engine, ids, sampling) for _ in range(FLAGS.repeats)]
    secs = statistics.median(times)
    flops = roofline.prefill_flops(m.config, t)
    return {"len": t, "ms": secs * 1e3, "tok_s": t / secs, "chunk": chunk,
            "compile_s": compile_s, "variants": variants, "first_call_s": first,
            "runs_ms": [x * 1e3 for x in times], "flops": flops, "gflop_s": flops / secs / 1e9,
            "flop_fraction": roofline.flops_fraction(flops, secs, roof["peak_flops_f32"])}


def _decode_run(engine: Engine, ids: np.ndarray, sampling: SamplingConfig, num_steps: int
                ) -> tuple[float, int, list[list[int]]]:
    """Adds one request per row of `ids`, steps until each has its first token, then times
    `num_steps` steps. Returns (seconds, tokens streamed in them, every request's tokens)."""
    rids = [engine.add_request(row.tolist(), sampling) for row in ids]
    started: set[str] = set()
    prefill_steps = 0
    while len(started) < len(rids):
        started.update(out.request_id for out in engine.step())
        prefill_steps += 1
    if prefill_steps != 2:  # one step dispatches every prompt, the next returns the tokens
        _log(f"warning: the first tokens took {prefill_steps} steps (expected 2): the timed "
             "steps' contexts differ from the reported page buckets")
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(num_steps):
        tokens += len(engine.step())
    secs = time.perf_counter() - t0
    engine.run()
    engine.runner.block_until_ready()
    outs = [engine.result(rid).token_ids for rid in rids]
    for rid in rids:
        engine.forget(rid)
    return secs, tokens, outs


def bench_decode(m: Model, batch: int, roof: dict) -> dict:
    n, num_steps = FLAGS.decode_prompt_len, FLAGS.decode_steps
    sampling = SamplingConfig(max_new_tokens=num_steps + 2, ignore_eos=True)
    engine = m.engine(max_seq_len=n + num_steps + 2, slots=batch,
                      max_num_batched_tokens=max(512, batch * n))
    ids = random_ids(FLAGS.seed, m.config.vocab_size, batch, n)
    t0 = time.perf_counter()
    variants = engine.warmup(workload=[(row.tolist(), sampling) for row in ids])
    compile_s = time.perf_counter() - t0
    times, outs, counts = [], [], []
    for _ in range(FLAGS.repeats):
        secs, tokens, toks = _decode_run(engine, ids, sampling, num_steps)
        times.append(secs / num_steps)
        counts.append(tokens)
        outs.append(toks)
    step = statistics.median(times)
    c = engine.cache_config
    # The timed steps wait for the device work of the decode steps that read n + 1 .. n + S
    # cached positions (the step before the window feeds the first token at position n).
    plan = [pages_bucket(n + i + 1, c.page_size, c.pages_per_seq) for i in range(num_steps)]
    span = float(np.mean(plan)) * c.page_size  # positions each row reads, page-bucketed
    live = n + (num_steps + 1) / 2  # mean positions really in the cache after the write
    nbytes = roofline.stored_decode_step_bytes(m.param_bytes, m.kv_bytes_per_token, batch, span)
    live_bytes = roofline.stored_decode_step_bytes(m.param_bytes, m.kv_bytes_per_token, batch,
                                                   live)
    flops = roofline.decode_step_flops(m.config, batch, span)
    # a mixture's step reads only the experts its rows route to (expert-touch model)
    unread = planner.unread_expert_bytes(m.config, 1, batch) if m.config.num_experts else 0.0
    nbytes -= unread
    live_bytes -= unread
    return {
        "batch": batch, "ms_per_step": step * 1e3, "tok_s": batch / step,
        "runs_ms_per_step": [x * 1e3 for x in times],
        "tokens_per_step": [x / num_steps for x in counts],
        "compile_s": compile_s, "variants": variants,
        "page_buckets": sorted(set(plan)), "kv_tokens_read_mean": span,
        "bytes_per_step": nbytes, "gb_s": nbytes / step / 1e9,
        "bw_fraction": roofline.bandwidth_fraction(nbytes, step, roof["hbm_bytes_per_s"]),
        "bw_fraction_live_kv": roofline.bandwidth_fraction(live_bytes, step,
                                                           roof["hbm_bytes_per_s"]),
        "flops_per_step": flops, "gflop_s": flops / step / 1e9,
        "flop_fraction": roofline.flops_fraction(flops, step, roof["peak_flops_f32"]),
        "repeats_agree": all(o == outs[0] for o in outs),
    }


class Run(NamedTuple):
    """One configuration: activation dtype, weight storage, KV cache dtype (None = dtype),
    layer stack layout (`RunConfig.scan_layers`)."""

    dtype: str
    weight_dtype: str | None
    kv_dtype: str | None
    scan_layers: str = "auto"

    @property
    def name(self) -> str:
        """"float32", or e.g. "float32 w=int8 kv=int8 scan=true" when any differs."""
        extra = [f"{k}={v}" for k, v in (("w", self.weight_dtype), ("kv", self.kv_dtype))
                 if v not in (None, self.dtype)]
        if self.scan_layers != "auto":
            extra.append(f"scan={self.scan_layers}")
        return " ".join([self.dtype, *extra])


def runs() -> list[Run]:
    """Every (dtype, weight dtype, kv dtype) of the flags; a float weight dtype other than the
    model dtype is the other dtype's model (run it through --dtypes)."""
    out = []
    for dtype in FLAGS.dtypes:
        for w in FLAGS.weight_dtype or [None]:
            if w not in (None, dtype, *QUANT_DTYPES):
                continue
            out += [Run(dtype, w, kv, scan) for kv in FLAGS.kv_dtype or [None]
                    for scan in FLAGS.scan_layers]
    return list(dict.fromkeys(out))


def run_jax(ckpt, run: Run, roof: dict) -> dict:
    dtype = run.name
    t0 = time.perf_counter()
    m = Model(ckpt, run)
    res = {"load_s": time.perf_counter() - t0, "dtype": run.dtype,
           "weight_dtype": run.weight_dtype or run.dtype, "kv_dtype": run.kv_dtype or run.dtype,
           "scan_layers": m.config.scan_layers,
           "roofline_weight_bytes": roofline.weight_bytes(m.config,
                                                          jnp.dtype(run.dtype).itemsize),
           "prefill": [], "decode": []}
    _log(f"{dtype}: model loaded in {res['load_s']:.1f}s")
    start = time.perf_counter()
    for t in (int(x) for x in FLAGS.prefill_lens):
        if time.perf_counter() - start > FLAGS.max_seconds:
            res["prefill"].append({"len": t, "skipped": True})
            continue
        res["prefill"].append(r := bench_prefill(m, t, roof))
        _log(f"{dtype} prefill T={t}: {r['ms']:.1f} ms (compile {r['compile_s']:.1f}s, "
             f"warm-up request {r['first_call_s']:.2f}s)")
    for b in (int(x) for x in FLAGS.decode_batches):
        if time.perf_counter() - start > FLAGS.max_seconds:
            res["decode"].append({"batch": b, "skipped": True})
            continue
        res["decode"].append(r := bench_decode(m, b, roof))
        _log(f"{dtype} decode B={b}: {r['ms_per_step']:.2f} ms/step, "
             f"{r['tokens_per_step'][0]:g} tokens/step (compile {r['compile_s']:.1f}s)")
    res["bench_s"] = time.perf_counter() - start
    res["param_bytes"] = m.param_bytes
    res["kv_bytes_per_token"] = m.kv_bytes_per_token
    res["attention_impl"] = m.attention_impl
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


def print_side_by_side(jax_res: dict) -> None:
    """One row per configuration: stored bytes, then tok/s (and its own roofline fraction:
    prefill FLOPs, decode bytes as stored) of every point."""
    first = next(iter(jax_res.values()))
    points = ([f"prefill T={r['len']}" for r in first["prefill"]]
              + [f"decode B={r['batch']}" for r in first["decode"]])
    print("\nside by side: tok/s (fraction of the roofline: prefill FLOP/s, decode bytes/s with "
          "each configuration's own weight and KV bytes)")
    print(f"{'configuration':>26} {'weights MB':>10} {'KV B/tok':>9} "
          + " ".join(f"{p:>19}" for p in points))
    for name, res in jax_res.items():
        cells = []
        for r, key in ([(r, "flop_fraction") for r in res["prefill"]]
                       + [(r, "bw_fraction") for r in res["decode"]]):
            cells.append(f"{'skipped':>19}" if r.get("skipped") else
                         f"{r['tok_s']:10.1f} ({_fmt(r[key], 5, 3)})")
        print(f"{name:>26} {res['param_bytes'] / 1e6:10.1f} {res['kv_bytes_per_token']:9.0f} "
              + " ".join(cells))


def check_targets(jax_res: dict, hf_res: dict) -> list[dict]:
    """The targets, PASS / MISS / NOT MEASURED (reported, never asserted)."""
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


# A mixture (16 experts of FFN 1024, top 2) and a dense model whose FFN (2048) is its two
# experts': the same active parameters per token (the router's 16 x 1024 aside).
MOE_VS_DENSE = {
    "mixture E=16 k=2": dict(ffn_dim=1024, num_experts=16, experts_per_token=2),
    "dense, equal active": dict(ffn_dim=2048),
}
MOE_VS_DENSE_BASE = dict(vocab_size=8192, embed_dim=1024, num_layers=4, num_q_heads=16,
                         num_kv_heads=4, head_dim=64, max_position=4096)


def moe_vs_dense(roof: dict) -> dict:
    """Decode points of `MOE_VS_DENSE` (random weights) at --decode_batches; prints a table."""
    dtype, res = FLAGS.dtypes[0], {}
    for name, shape in MOE_VS_DENSE.items():
        config = ModelConfig(**MOE_VS_DENSE_BASE, **shape, dtype=dtype)
        model = Llama(config, init_params(config, seed=FLAGS.seed, scale=0.3))
        m = Model(None, Run(dtype, None, None), model)
        res[name] = {"params": config.num_params(), "active_params": config.num_active_params(),
                     "decode": [bench_decode(m, int(b), roof) for b in FLAGS.decode_batches]}
        _log(f"{name}: " + ", ".join(f"B={r['batch']} {r['tok_s']:.1f} tok/s"
                                     for r in res[name]["decode"]))
    print(f"\nmixture vs dense, {dtype}, decode (random weights, {MOE_VS_DENSE_BASE})\n")
    print("| model | params | active | B | ms/step | tok/s | MB read/step (expert-touch) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in res.items():
        for d in r["decode"]:
            print(f"| {name} | {r['params'] / 1e6:.1f}M | {r['active_params'] / 1e6:.1f}M | "
                  f"{d['batch']} | {d['ms_per_step']:.2f} | {d['tok_s']:.1f} | "
                  f"{d['bytes_per_step'] / 1e6:.1f} |")
    return res


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.write_prompts:
        batch = int(FLAGS.decode_batches[-1])
        write_prompts(FLAGS.write_prompts, batch)
        _log(f"wrote {batch} prompts to {FLAGS.write_prompts}")
        return
    load_start = os.getloadavg()
    roof = host_roof()
    if FLAGS.moe_vs_dense:
        res = moe_vs_dense(roof)
        print(json.dumps({"system": "jaxinfer", "argv": sys.argv, "moe_vs_dense": res,
                          "seed": FLAGS.seed, "repeats": FLAGS.repeats,
                          "decode_steps": FLAGS.decode_steps, "versions": versions(),
                          "machine": {"platform": platform.platform(),
                                      "cpu_count": os.cpu_count(), "cpu": cpu_info(),
                                      "roofline": roof, "loadavg_start": load_start,
                                      "loadavg_end": os.getloadavg()}}), flush=True)
        return
    ckpt = load_checkpoint(FLAGS.model_path)
    jax_res = {run.name: run_jax(ckpt, run, roof) for run in runs()}
    hf_res = {dtype: run_hf(ckpt, dtype) for dtype in FLAGS.hf_dtypes} if FLAGS.hf_python else {}
    for dtype, res in jax_res.items():
        hf = hf_res.get(dtype)
        print_table(dtype, res, hf if hf and "error" not in hf else None)
    for dtype, hf in hf_res.items():
        if "error" in hf:
            print(f"hf-transformers {dtype}: {hf['error']}")
    if len(jax_res) > 1:
        print_side_by_side(jax_res)
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
        "prefill_chunk": FLAGS.prefill_chunk, "path": "engine",
        "versions": versions(),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "cpu": cpu_info(), "roofline": roof, "loadavg_start": load_start,
                    "loadavg_end": load_end},
        "jaxinfer": jax_res, "hf": hf_res, "targets": targets, "warnings": warnings}),
          flush=True)


if __name__ == "__main__":
    app.run(main)
