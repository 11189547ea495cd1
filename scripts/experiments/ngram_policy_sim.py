"""How far can an n-gram drafting policy take the copy workload? An offline replay.

Greedy speculation is exact, so a verification of draft d at the point where the plain run had
generated i tokens accepts exactly the longest prefix of d that equals the plain output from i on.
This script runs `scripts/spec_benchmark.py`'s workloads once without speculation (the default
model, greedy, the same prompts and max_new_tokens), then replays every drafting policy below
over those outputs without the model: each step either decodes plainly (no draft: cost 1) or
verifies at the smallest width the engine would use (`SpecDecoder.widths`), at a cost per width
relative to a plain decode step (`--costs`; the measured costs are in docs/benchmarks.md,
"Speculative decoding"). The predicted speedup is decode steps without speculation / summed
step costs (per workload, all prompts).

Policies (R = drafts per step at most):
* latest / earliest: the continuation of the latest / earliest earlier match of the longest
  suffix (n = ngram_max .. ngram_min); latest is `NGramDrafter`'s rule;
* full: the latest match whose continuation has R tokens (else latest);
* adaptive k0/g: a per-request draft cap that starts at k0, becomes g * (accepted + 1) after a
  verification, and goes back to k0 after a step with no match.

  python scripts/experiments/ngram_policy_sim.py --num_spec=3,5,7,10,14 \\
      --costs=1:1.29,2:1.31,4:1.41,7:1.66

Prints one table per workload: predicted speedup per policy and R.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from absl import app, flags
from numpy.lib.stride_tricks import sliding_window_view

from jaxinfer.cli import flags as jflags

# scripts/spec_benchmark.py: its workloads and flags (--workloads, --num_spec, --max_new_tokens,
# --ngram_max, --ngram_min, --compilation_cache_dir).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import spec_benchmark  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("costs", ["1:1.29", "2:1.31", "4:1.41", "7:1.66"],
                  "Verification cost per width, as width:cost vs a plain decode step; "
                  "widths past the last extrapolate linearly.")


def _lookup(tokens, k, max_n, min_n, pick):
    arr = np.asarray(tokens)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        hits = np.flatnonzero((sliding_window_view(arr[:-1], n) == arr[-n:]).all(axis=1))
        if hits.size:
            if pick == "earliest":
                h = hits[0]
            elif pick == "full":
                full = [x for x in hits if x + n + k <= len(arr)]
                h = full[-1] if full else hits[-1]
            else:
                h = hits[-1]
            return arr[h + n:h + n + k].tolist()
    return []


def simulate(cases, r, cost, *, pick="latest", k0=None, grow=None, max_n=4, min_n=2,
             max_new=128) -> float:
    """Predicted speedup of one policy over (prompt ids, plain output ids) cases."""
    widths = [w for w in (1 << i for i in range(r.bit_length())) if w < r] + [r]
    base = total = 0.0
    for prompt, out in cases:
        base += len(out) - 1
        i, cap = 1, (k0 or r)
        while i < len(out):
            room = max_new - i - 1
            draft = _lookup(prompt + out[:i], min(cap, r, room), max_n, min_n, pick) if room > 0 \
                else []
            a = 0
            while a < len(draft) and i + a < len(out) and draft[a] == out[i + a]:
                a += 1
            if draft:
                total += cost(next(w for w in widths if w >= len(draft)))
                if k0 is not None:
                    cap = max(1, min(r, grow * (a + 1)))
            else:
                total += 1.0
                if k0 is not None:
                    cap = k0
            i += a + 1
    return base / total


def main(argv):
    del argv
    from jaxinfer.checkpoint.loading import load_model, load_tokenizer
    from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.prompts import encode_prompt

    table = dict(sorted((int(w), float(c)) for w, c in (x.split(":") for x in FLAGS.costs)))
    ws, cs = list(table), list(table.values())

    def cost(width: int) -> float:
        return float(np.interp(width, ws, cs, right=cs[-1] + (width - ws[-1]) * (
            (cs[-1] - cs[0]) / max(1, ws[-1] - ws[0]))))

    jflags.use_compilation_cache(0.5)
    model, ckpt = load_model(RunConfig(dtype="float32"))
    tok = load_tokenizer(ckpt)
    llm = LLM(model, tok, cache=CacheConfig(page_size=16, max_seq_len=512),
              engine=EngineConfig(max_slots=8, prefill_buckets=(64, 256),
                                  max_num_batched_tokens=512))
    sampling = SamplingConfig(max_new_tokens=FLAGS.max_new_tokens)
    policies = {"latest": {}, "earliest": {"pick": "earliest"}, "full": {"pick": "full"},
                "adaptive 2/2": {"k0": 2, "grow": 2}, "adaptive 4/2": {"k0": 4, "grow": 2},
                "adaptive 4/3": {"k0": 4, "grow": 3}}
    for name in FLAGS.workloads:
        prompts = spec_benchmark.WORKLOADS[name]
        results = llm.generate(prompts, sampling, chat=True, use_tqdm=False)
        cases = [(encode_prompt(tok, model.config.vocab_size, p, chat=True), r.token_ids)
                 for p, r in zip(prompts, results)]
        print(f"\n{name}: {sum(len(o) for _, o in cases)} tokens; predicted speedup")
        print(f"{'R':>3} " + " ".join(f"{p:>12}" for p in policies))
        common = dict(max_new=FLAGS.max_new_tokens, max_n=FLAGS.ngram_max,
                      min_n=FLAGS.ngram_min)
        for r in (int(x) for x in FLAGS.num_spec):
            print(f"{r:3d} " + " ".join(f"{simulate(cases, r, cost, **common, **kw):11.2f}x"
                                        for kw in policies.values()))


if __name__ == "__main__":
    app.run(main)
