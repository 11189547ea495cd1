"""What prompt logprobs cost and how close they are: a prompt of --prompt_len random token ids,
scored (`SamplingConfig(prompt_logprobs=k)`) and not, on SmolLM2 (f32) with the server test's
engine config (prefill chunks of 64), each timed over --repeats runs after a warm-up run that
compiles; then the scored logprobs against a log_softmax of a plain one-chunk forward of the
prompt (`jaxinfer.proof.accuracy`). Prints one JSON line.

  python scripts/experiments/prompt_logprobs_cost.py --prompt_len=256 --repeats=5

Reproduces docs/benchmarks.md, "Prompt logprobs": the seconds with and without prompt
logprobs, and the largest difference from a plain forward.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxinfer.checkpoint.loading import load_model, load_tokenizer  # noqa: E402
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig  # noqa: E402
from jaxinfer.engine.llm import LLM  # noqa: E402
from jaxinfer.proof import accuracy  # noqa: E402

flags.DEFINE_integer("prompt_len", 256, "Prompt tokens.")
flags.DEFINE_integer("top", 5, "Top logprobs per prompt position.")
flags.DEFINE_integer("repeats", 5, "Timed runs of each kind.")
FLAGS = flags.FLAGS


def timed(llm: LLM, ids: list[int], sampling: SamplingConfig) -> tuple[float, object]:
    llm.generate([ids], sampling, use_tqdm=False)  # compiles its step variants
    seconds = []
    for _ in range(FLAGS.repeats):
        t = time.perf_counter()
        out = llm.generate([ids], sampling, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - t)
    return float(np.median(seconds)), out


def main(argv) -> None:
    del argv
    model, ckpt = load_model(RunConfig(dtype="float32"))
    llm = LLM(model, load_tokenizer(ckpt), cache=CacheConfig(max_seq_len=1024),
              engine=EngineConfig(max_slots=4, prefill_buckets=(16, 64),
                                  max_num_batched_tokens=64, max_top_logprobs=FLAGS.top,
                                  enable_prefix_caching=False))
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size,
                                            FLAGS.prompt_len).tolist()
    plain_s, _ = timed(llm, ids, SamplingConfig(max_new_tokens=1))
    scored_s, out = timed(llm, ids, SamplingConfig(max_new_tokens=1, prompt_logprobs=FLAGS.top))
    logits = np.asarray(accuracy._Stream(model, len(ids), 16, None).logits(np.asarray(ids), 0),
                        np.float64)
    logits -= logits.max(-1, keepdims=True)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    diff = np.abs(np.asarray(out.prompt_logprobs[1:]) - ref[np.arange(len(ids) - 1), ids[1:]])
    top_diff = max(abs(lp - ref[i - 1, t]) for i in range(1, len(ids))
                   for t, lp in out.prompt_top_logprobs[i])
    print(json.dumps({"prompt_len": len(ids), "top": FLAGS.top, "repeats": FLAGS.repeats,
                      "plain_s": plain_s, "scored_s": scored_s,
                      "max_abs_diff": float(diff.max()), "max_abs_diff_top": float(top_diff),
                      "load": os.getloadavg()}))


if __name__ == "__main__":
    app.run(main)
