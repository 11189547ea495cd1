"""Is a constrained forked batch slower because of its constraint? The structured-output test's
three forked requests (a nested JSON schema, a date regex, a choice list; temperature 1, its
small pool and 32 slots, `tests/test_constraints.py`) run constrained and then unconstrained
on the same engine, each after a warm-up run: tokens/s, engine steps, synchronous steps, mask
filling time and preemptions of each.

  python scripts/experiments/constrained_vs_free.py --n=24
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxinfer.checkpoint.loading import load_model, load_tokenizer  # noqa: E402
from jaxinfer.config import RunConfig  # noqa: E402
from jaxinfer.engine.llm import LLM  # noqa: E402
from tests.test_constraints import CACHE, COLORS, DATE, ENGINE, SCHEMA, _sampled  # noqa: E402

flags.DEFINE_integer("n", 24, "Forked samples per request.")
FLAGS = flags.FLAGS
PROMPTS = ["Give one record as JSON.", "When was the Eiffel Tower finished? Answer with a date.",
           "Name a color."]


def measure(llm: LLM, configs) -> dict:
    llm.generate(PROMPTS, configs, chat=True, use_tqdm=False)  # compiles, fills nothing cached
    before, t = llm.engine.stats(), time.perf_counter()
    outs = llm.generate(PROMPTS, configs, chat=True, use_tqdm=False)
    seconds, after = time.perf_counter() - t, llm.engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    delta = {k: after[k] - before[k] for k in ("steps", "sync_steps", "mask_fill_seconds",
                                                "preemptions")}
    return {"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds, **delta}


def main(argv):
    del argv
    model, ckpt = load_model(RunConfig(dtype="float32"))
    llm = LLM(model, load_tokenizer(ckpt), cache=CACHE, engine=ENGINE)
    n = FLAGS.n
    runs = {"constrained": [_sampled(n, 28, json_schema=json.dumps(SCHEMA)),
                            _sampled(n, 12, regex=DATE), _sampled(n, 8, choice=COLORS)],
            "unconstrained": [_sampled(n, 28), _sampled(n, 12), _sampled(n, 8)]}
    for name, configs in runs.items():
        print(name, json.dumps(measure(llm, configs)), flush=True)


if __name__ == "__main__":
    app.run(main)
