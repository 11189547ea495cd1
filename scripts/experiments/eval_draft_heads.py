"""Replayed held-out acceptance of several draft heads on the same held-out answers: the default
model answers the held-out chat prompts (`jaxinfer.train.prompts`, greedy), and each head's
mean tokens per verification of greedy chain speculation is replayed on them at R = 1, 2, 4
(`jaxinfer.train.draft_head.acceptance`). With `--prompts=chat` the answers are those of
`spec_benchmark.py`'s chat workload instead, so a head's replayed acceptance can be set beside
what the engine measured on the same answers. Section "Speculative decoding" of
docs/benchmarks.md.

    python scripts/experiments/eval_draft_heads.py --heads=/tmp/head1,/tmp/head2
    python scripts/experiments/eval_draft_heads.py --heads=/tmp/head2 --prompts=chat \
        --max_new_tokens=128
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from jaxinfer.checkpoint.eagle import load_draft_head
from jaxinfer.checkpoint.loading import load_model, load_tokenizer
from jaxinfer.config import EngineConfig, RunConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.train import draft_head as train
from jaxinfer.train.prompts import chat_prompts

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from spec_workloads import WORKLOADS  # noqa: E402  (scripts/, put on sys.path above)

FLAGS = flags.FLAGS
flags.DEFINE_list("heads", None, "Draft head directories (train_draft_head.py --out).",
                  required=True)
flags.DEFINE_enum("prompts", "held_out", ["held_out", "chat"], "held_out: the training "
                  "prompts' held-out subjects; chat: spec_benchmark.py's chat workload.")
flags.DEFINE_integer("num_prompts", 24, "Held-out prompts (--prompts=held_out).")
flags.DEFINE_integer("max_new_tokens", 192, "Tokens the target answers each prompt with.")
flags.DEFINE_integer("seq_len", 256, "Tokens per sequence (prompt + answer, cut).")


def main(argv):
    del argv
    model, ckpt = load_model(RunConfig())
    prompts = (chat_prompts(FLAGS.num_prompts, held_out=True) if FLAGS.prompts == "held_out"
               else WORKLOADS["chat"])
    llm = LLM(model, load_tokenizer(ckpt), engine=EngineConfig(max_slots=len(prompts)))
    seqs, errors = train.generate(llm, prompts, max_new_tokens=FLAGS.max_new_tokens)
    if errors:
        raise SystemExit(f"the engine refused a prompt: {errors[0]}")
    print("| head | R = 1 | R = 2 | R = 4 |\n| --- | ---: | ---: | ---: |")
    for path in FLAGS.heads:
        head = load_draft_head(path, model.config)
        held = train.record(model, seqs, head.config, seq_len=FLAGS.seq_len)
        cells = [f"{train.untrained_acceptance(head, model, held, r):.2f}" for r in (1, 2, 4)]
        print(f"| {path} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    app.run(main)
