"""Serving benchmark: Poisson arrivals into the `Engine`, reported as `vllm bench serve` does.

Three scenarios on the default model (SmolLM2-135M-Instruct, f32 on CPU), random prompt ids
(vLLM's "random" dataset: `np.random.default_rng(seed)`), greedy with ignore_eos so output
lengths are exactly as drawn:

* mixed   — prompts of 32..256 tokens, long-tailed output lengths (lognormal, median 37, 8..320
            tokens): prefill-heavy. static batching vs continuous vs continuous + chunked prefill.
* mixed_long — the same comparison on a decode-heavy, ShareGPT-like mix: prompts of 16..256,
            outputs lognormal with median 100, 8..512 tokens (not in the default --scenarios).
* shared  — one 768-token system prompt shared by every request + a 16..48-token question,
            16..32 output tokens; prefix caching off vs on (mean TTFT).
* long    — 7 requests decode 160 tokens each; 3 prompts of 1536 tokens arrive while they do;
            unchunked vs chunked prefill. Reported: the ITL of the decoding requests in the
            windows while a long prompt is being prefilled (arrival -> its first token), p99
            and max, beside the overall ITL percentiles.

Arrivals: request i arrives at the sum of i exponential gaps of mean 1/rate seconds (rate "inf":
all at t = 0). TTFT and E2EL count from the scheduled arrival, so queueing is included. The
engine is warmed up first (every step variant compiled; persistent XLA cache in
~/.cache/jaxinfer/xla), so no compile lands in a measurement.

  python scripts/serve_benchmark.py                       # all scenarios (about 25 min on CPU)
  python scripts/serve_benchmark.py --scenarios=mixed --num_requests=16 --rates=inf  # quick

Output: one table per scenario and one JSON line per run (prefixed "RESULT ") on stdout.

`--backend=http --base_url=http://127.0.0.1:8000` drives a running `jaxinfer-serve` instead:
the same workloads, each request a streamed `/v1/completions` (token-id prompt, greedy,
ignore_eos) sent at its arrival time, timed on the client (a token's time is when its SSE chunk
arrives). The server's engine config is its own, so one run per workload ("http"); start the
server with the in-process run's config to compare, e.g. for `--modes=continuous`:

  jaxinfer-serve --dtype=float32 --max_slots=8 --max_seq_len=2048 --page_size=16 \
      --prefill_buckets=32,128,512 --prefill_chunk_size=512 --max_num_batched_tokens=8192 \
      --noenable_prefix_caching --served_model_name=bench
  python scripts/serve_benchmark.py --backend=http --base_url=http://127.0.0.1:8000 \
      --scenarios=mixed --rates=0.5,inf --num_requests=32
  python scripts/serve_benchmark.py --scenarios=mixed --modes=continuous --rates=0.5,inf \
      --num_requests=32

`--backend=http --scenarios=added_ttft --num_requests=40` (against that server): what the
server adds to TTFT at low load, per request against an in-process engine of the same config
(`added_ttft`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags

from jaxinfer.checkpoint.loading import load_model, load_tokenizer
from jaxinfer.cli import flags as jflags
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.perf.metrics import RequestMetrics, serving_summary

FLAGS = flags.FLAGS
flags.DEFINE_list("scenarios", ["mixed", "shared", "long"], "Scenarios to run.")
flags.DEFINE_list("rates", ["1", "inf"], "Mixed scenario: request rates (req/s; inf = all at 0).")
flags.DEFINE_list("shared_rates", ["0.5", "1"], "Shared-prefix scenario: request rates.")
flags.DEFINE_integer("num_requests", 48, "Requests per run (mixed, shared).")
flags.DEFINE_integer("max_slots", 8, "Engine slots.")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("model_path", None, "GGUF file or HF directory (default: embedded SmolLM2).")
flags.DEFINE_list("modes", ["static", "continuous", "chunked"],
                  "Mixed scenario, in process: the engine configs to run (`mode_config`).")
flags.DEFINE_enum("backend", "engine", ["engine", "http"],
                  "engine: the Engine in this process; http: a running jaxinfer-serve.")
flags.DEFINE_string("base_url", "http://127.0.0.1:8000", "The server of --backend=http.")
flags.DEFINE_string("served_model_name", "bench", "The model name the server serves.")
jflags.define_compilation_cache_flag()

MAX_SEQ_LEN = 2048
PAGE_SIZE = 16


@dataclasses.dataclass
class Item:
    arrival: float
    prompt: list[int]
    sampling: SamplingConfig
    tag: str = ""


def poisson_arrivals(rng, n: int, rate: float) -> np.ndarray:
    if rate == float("inf"):
        return np.zeros(n)
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, n - 1))])


# Output-length distributions (lognormal mu, sigma; clipped): "mixed" is prefill-heavy (median
# 37 output tokens for a mean prompt of 144), "mixed_long" decode-heavy like ShareGPT (median 100
# output tokens, long tail to 512, for a mean prompt of 136).
MIXED = {"mixed": ((32, 257), 3.6, 0.9, (8, 320)), "mixed_long": ((16, 257), 4.6, 0.8, (8, 512))}


def mixed_workload(vocab: int, n: int, rate: float, seed: int, kind: str = "mixed"
                   ) -> list[Item]:
    (lo, hi), mu, sigma, (out_lo, out_hi) = MIXED[kind]
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rng, n, rate)
    items = []
    for t in arrivals:
        prompt = rng.integers(0, vocab, int(rng.integers(lo, hi))).tolist()
        out = int(np.clip(rng.lognormal(mu, sigma), out_lo, out_hi))
        items.append(Item(float(t), prompt, SamplingConfig(max_new_tokens=out, ignore_eos=True)))
    return items


def shared_workload(vocab: int, n: int, rate: float, seed: int) -> list[Item]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, 768).tolist()
    arrivals = poisson_arrivals(rng, n, rate)
    return [Item(float(t), system + rng.integers(0, vocab, int(rng.integers(16, 49))).tolist(),
                 SamplingConfig(max_new_tokens=int(rng.integers(16, 33)), ignore_eos=True))
            for t in arrivals]


def long_workload(vocab: int, seed: int) -> list[Item]:
    rng = np.random.default_rng(seed)
    items = [Item(0.0, rng.integers(0, vocab, 32).tolist(),
                  SamplingConfig(max_new_tokens=160, ignore_eos=True), "decoder")
             for _ in range(7)]
    items += [Item(t, rng.integers(0, vocab, 1536).tolist(),
                   SamplingConfig(max_new_tokens=8, ignore_eos=True), "long")
              for t in (1.0, 6.0, 11.0)]
    return items


def run(model, tokenizer, items: list[Item], engine_config: EngineConfig,
        num_pages: int) -> tuple[dict, list, Engine]:
    eng = Engine(model, tokenizer, cache=CacheConfig(page_size=PAGE_SIZE, max_seq_len=MAX_SEQ_LEN,
                                                     num_pages=num_pages),
                 engine=engine_config)
    max_len = max(len(it.prompt) + it.sampling.max_new_tokens for it in items)
    t = time.perf_counter()
    variants = eng.warmup(max_len)
    print(f"  warm-up: {variants} step variants in {time.perf_counter() - t:.1f} s",
          file=sys.stderr)
    pending = sorted(items, key=lambda it: it.arrival)
    ids = []
    t0 = time.perf_counter()
    while pending or eng.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival <= now:
            it = pending.pop(0)
            ids.append((it, eng.add_request(it.prompt, it.sampling, arrival=t0 + it.arrival)))
        if not eng.has_unfinished():
            time.sleep(max(0.0, pending[0].arrival - (time.perf_counter() - t0)))
            continue
        eng.step()
    duration = time.perf_counter() - t0
    results = [(it, eng.result(rid)) for it, rid in ids]
    summary = serving_summary([r.metrics for _, r in results], [len(it.prompt) for it, _ in ids],
                              duration)
    summary.update({k: v for k, v in eng.stats().items()
                    if k in ("preemptions", "prefix_hits", "reused_tokens", "computed_tokens",
                             "steps", "device_calls")})
    return summary, results, eng


async def _http_request(client, item: Item, t0: float) -> RequestMetrics:
    """One streamed completion sent at its arrival; token times when each chunk arrives."""
    await asyncio.sleep(max(0.0, t0 + item.arrival - time.perf_counter()))
    metrics = RequestMetrics(arrival=t0 + item.arrival)
    body = {"model": FLAGS.served_model_name, "prompt": item.prompt, "temperature": 0,
            "max_tokens": item.sampling.max_new_tokens, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                metrics.token_times.append(time.perf_counter())
    return metrics


async def _http_run(items: list[Item]) -> tuple[list[RequestMetrics], float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=FLAGS.base_url, timeout=None, limits=limits) as client:
        t0 = time.perf_counter()
        metrics = await asyncio.gather(*(_http_request(client, it, t0) for it in items))
        return list(metrics), time.perf_counter() - t0


def _server_ttft() -> tuple[float, float]:
    """(sum, count) of the server's TTFT histogram (`GET /metrics`): its arrival is when the
    handler starts, so client TTFT - server TTFT is what HTTP adds (connection, request, JSON,
    SSE delivery)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{FLAGS.base_url}/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return (values["jaxinfer_time_to_first_token_seconds_sum"],
            values["jaxinfer_time_to_first_token_seconds_count"])


def run_http(items: list[Item]) -> dict:
    """The workload against the server at --base_url, summarised as `run` does, plus the
    server's own mean TTFT over the same requests and the mean TTFT HTTP adds to it."""
    order = sorted(items, key=lambda it: it.arrival)
    before = _server_ttft()
    metrics, duration = asyncio.run(_http_run(order))
    after = _server_ttft()
    summary = serving_summary(metrics, [len(it.prompt) for it in order], duration)
    server_ms = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3
    summary["server_mean_ttft_ms"] = server_ms
    summary["http_added_mean_ttft_ms"] = summary["mean_ttft_ms"] - server_ms
    return summary


def added_ttft(model, tokenizer, n: int) -> dict:
    """What the server adds to TTFT at low load, request by request: prompt i (16 random ids,
    2 output tokens, so the first is not delivered with the request's end) goes to the server
    alone (one keep-alive client, as a load generator holds), then the same prompt to an
    in-process engine of the `continuous` config the server is started with (the order
    alternates), so each pair sees the same machine load; prompts are short so that the
    engine's own time, and its noise, stay small beside the difference. Returns both TTFTs'
    p50 and the p50/mean/p90 of the pairs' differences (ms)."""
    import httpx

    # jaxinfer-serve computes 5 top logprobs per row unless --max_top_logprobs says otherwise
    config = dataclasses.replace(mode_config("continuous", FLAGS.max_slots), max_top_logprobs=5)
    eng = Engine(model, tokenizer, cache=CacheConfig(page_size=PAGE_SIZE, max_seq_len=MAX_SEQ_LEN),
                 engine=config)
    eng.warmup(256)
    sampling = SamplingConfig(max_new_tokens=2, ignore_eos=True)
    rng = np.random.default_rng(FLAGS.seed)
    http_ms, local_ms = [], []

    def over_http(client, prompt) -> float:
        body = {"model": FLAGS.served_model_name, "prompt": prompt, "temperature": 0,
                "max_tokens": 2, "ignore_eos": True, "stream": True}
        t, ttft = time.perf_counter(), None
        with client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = (time.perf_counter() - t) * 1e3
        if ttft is None:
            raise RuntimeError(f"HTTP {r.status_code}: no token")
        return ttft

    def in_process(prompt) -> float:
        t = time.perf_counter()
        rid = eng.add_request(prompt, sampling, arrival=t)
        while eng.has_unfinished():
            eng.step()
        return (eng.result(rid).metrics.token_times[0] - t) * 1e3

    with httpx.Client(base_url=FLAGS.base_url, timeout=60) as client:
        over_http(client, [1, 2, 3])  # opens the connection
        for i in range(n):
            prompt = rng.integers(0, model.config.vocab_size, size=16).tolist()
            if i % 2:
                local_ms.append(in_process(prompt))
                http_ms.append(over_http(client, prompt))
            else:
                http_ms.append(over_http(client, prompt))
                local_ms.append(in_process(prompt))
    added = np.asarray(http_ms) - np.asarray(local_ms)
    return {"requests": n, "p50_ttft_http_ms": float(np.median(http_ms)),
            "p50_ttft_in_process_ms": float(np.median(local_ms)),
            "p50_added_ms": float(np.median(added)), "mean_added_ms": float(added.mean()),
            "p90_added_ms": float(np.percentile(added, 90))}


def mode_config(mode: str, slots: int) -> EngineConfig:
    """static / continuous: whole prompts in one step (chunk 512 = the longest prompt of the
    mixed scenario); chunked: 128-token chunks beside the decodes, budget 128 + slots."""
    buckets = (32, 128, 512)
    if mode == "static":
        return EngineConfig(max_slots=slots, prefill_buckets=buckets, prefill_chunk_size=512,
                            max_num_batched_tokens=8192, scheduling_policy="static",
                            enable_prefix_caching=False)
    if mode == "continuous":
        return EngineConfig(max_slots=slots, prefill_buckets=buckets, prefill_chunk_size=512,
                            max_num_batched_tokens=8192, enable_prefix_caching=False)
    if mode == "chunked":
        return EngineConfig(max_slots=slots, prefill_buckets=buckets, prefill_chunk_size=128,
                            max_num_batched_tokens=128 + slots, enable_prefix_caching=False)
    raise ValueError(mode)


COLUMNS = ["output_throughput", "input_throughput", "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p90_itl_ms", "p99_itl_ms", "p99_e2el_ms",
           "duration_s"]


def report(scenario: str, label: str, summary: dict) -> None:
    print("RESULT " + json.dumps({"scenario": scenario, "run": label, **summary}))
    cells = " | ".join(f"{summary[c]:.1f}" for c in COLUMNS)
    print(f"| {scenario} | {label} | {cells} |", flush=True)


def long_prompt_itl(results) -> dict:
    """ITL of the decoders inside the windows [long arrival, long first token]."""
    windows = [(r.metrics.arrival, r.metrics.token_times[0]) for it, r in results
               if it.tag == "long" and r.metrics.token_times]
    gaps = []
    for it, r in results:
        if it.tag != "decoder":
            continue
        times = r.metrics.token_times
        for a, b in zip(times, times[1:]):
            if any(a < w1 and b > w0 for w0, w1 in windows):
                gaps.append(b - a)
    ms = np.asarray(gaps) * 1e3
    return {"window_itl_count": int(ms.size),
            "window_p99_itl_ms": float(np.percentile(ms, 99)) if ms.size else float("nan"),
            "window_max_itl_ms": float(ms.max()) if ms.size else float("nan")}


def main_http() -> None:
    """--backend=http: each selected workload once against the running server."""
    from jaxinfer.checkpoint.weights import load_checkpoint

    if "added_ttft" in FLAGS.scenarios:
        jflags.use_compilation_cache(0.5)
        model, ckpt = load_model(RunConfig(model_path=FLAGS.model_path, dtype="float32"))
        result = added_ttft(model, load_tokenizer(ckpt), FLAGS.num_requests)
        print("RESULT " + json.dumps({"scenario": "added_ttft", **result}))
        print(" | ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
    vocab = load_checkpoint(FLAGS.model_path).config.vocab_size  # the prompts' id range
    print(f"# http backend at {FLAGS.base_url}")
    print("| scenario | run | " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * (len(COLUMNS) + 2))
    for kind in ("mixed", "mixed_long"):
        if kind in FLAGS.scenarios:
            for rate in FLAGS.rates:
                items = mixed_workload(vocab, FLAGS.num_requests, float(rate), FLAGS.seed, kind)
                report(kind, f"rate={rate} http", run_http(items))
    if "shared" in FLAGS.scenarios:
        for rate in FLAGS.shared_rates:
            items = shared_workload(vocab, FLAGS.num_requests, float(rate), FLAGS.seed)
            report("shared", f"rate={rate} http", run_http(items))


def main(argv):
    del argv
    if FLAGS.backend == "http":
        main_http()
        return
    jflags.use_compilation_cache(0.5)
    model, ckpt = load_model(RunConfig(model_path=FLAGS.model_path, dtype="float32"))
    tokenizer = load_tokenizer(ckpt)
    vocab = model.config.vocab_size
    slots = FLAGS.max_slots
    num_pages = slots * MAX_SEQ_LEN // PAGE_SIZE
    print(f"# {jax.devices()[0].device_kind}, {os.cpu_count()} cpus, model "
          f"{ckpt.config.num_layers} layers, f32, {slots} slots")
    print("| scenario | run | " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * (len(COLUMNS) + 2))
    for kind in ("mixed", "mixed_long"):
        if kind not in FLAGS.scenarios:
            continue
        for rate in FLAGS.rates:
            items = mixed_workload(vocab, FLAGS.num_requests, float(rate), FLAGS.seed, kind)
            for mode in FLAGS.modes:
                print(f"{kind} rate={rate} {mode}", file=sys.stderr)
                summary, _, _ = run(model, tokenizer, items, mode_config(mode, slots), num_pages)
                report(kind, f"rate={rate} {mode}", summary)
    if "shared" in FLAGS.scenarios:
        for rate in FLAGS.shared_rates:
            items = shared_workload(vocab, FLAGS.num_requests, float(rate), FLAGS.seed)
            for cache_on in (False, True):
                config = dataclasses.replace(mode_config("chunked", slots),
                                             prefill_chunk_size=512,
                                             max_num_batched_tokens=512 + slots,
                                             enable_prefix_caching=cache_on)
                label = f"rate={rate} prefix_caching={'on' if cache_on else 'off'}"
                print(f"shared {label}", file=sys.stderr)
                summary, _, _ = run(model, tokenizer, items, config, num_pages)
                report("shared", label, summary)
    if "long" in FLAGS.scenarios:
        items = long_workload(vocab, FLAGS.seed)
        for mode in ("unchunked", "chunked"):
            if mode == "unchunked":
                config = EngineConfig(max_slots=slots, prefill_buckets=(32, 128, 512, 2048),
                                      prefill_chunk_size=2048, max_num_batched_tokens=8192,
                                      enable_prefix_caching=False)
            else:
                config = mode_config("chunked", slots)
            print(f"long {mode}", file=sys.stderr)
            summary, results, _ = run(model, tokenizer, items, config, num_pages)
            summary.update(long_prompt_itl(results))
            report("long", mode, summary)
            print(f"|   | window ITL ({summary['window_itl_count']} gaps) | p99 "
                  f"{summary['window_p99_itl_ms']:.1f} ms | max "
                  f"{summary['window_max_itl_ms']:.1f} ms |", flush=True)


if __name__ == "__main__":
    app.run(main)
