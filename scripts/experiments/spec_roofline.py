"""Speculative decoding's speed-up projected onto an accelerator's roofline from a measured
acceptance (`jaxinfer.perf.roofline.speculative_speedup`): a target preset on one chip, bf16
weights and KV, for each drafter its bytes read per drafted token. Section "Speculative
decoding" of docs/benchmarks.md.

    python scripts/experiments/spec_roofline.py --tokens_per_verification=1.57,2.5,3 \\
        --num_spec=4 --model=llama-3.1-8b --chip=v5e

Drafters: n-gram lookup (host: no device bytes), self-speculation with the target's first
--self_spec_layers layers and its LM head, an EAGLE-3 head (one layer shaped like the
target's, fc over three features, its own LM head over --draft_vocab tokens) and an EAGLE head
(its layer and fc, then the target's LM head). The tokens per verification are the measured
input (`scripts/spec_benchmark.py` reports them); the rest is the roofline.
"""

from __future__ import annotations

import math

from absl import app, flags

from jaxinfer.model.eagle import HeadConfig, head_shapes
from jaxinfer.perf import planner, roofline

FLAGS = flags.FLAGS
flags.DEFINE_list("tokens_per_verification", ["1.57", "2.5", "3"],
                  "Mean accepted length L (tokens per verification) to project.")
flags.DEFINE_integer("num_spec", 4, "R: drafts per verification.")
flags.DEFINE_string("model", "llama-3.1-8b", "Target preset (`jaxinfer-plan --model`).")
flags.DEFINE_string("chip", "v5e", "Chip (`jaxinfer-plan --chip`).")
flags.DEFINE_integer("batch", 1, "Sequences decoding together.")
flags.DEFINE_integer("kv_len", 1024, "Cached positions per sequence.")
flags.DEFINE_integer("draft_vocab", 32000, "EAGLE-3 draft vocabulary (the published heads').")
flags.DEFINE_integer("self_spec_layers", 8, "Self-speculation depth.")

BF16 = 2


def draft_bytes(config) -> dict[str, float]:
    """Drafter -> bytes one drafted token reads (bf16 weights; the embedding-row gather and the
    drafter's own KV left out, as for the target)."""
    lm_head = config.embed_dim * config.vocab_size * BF16
    per_layer = roofline.matmul_params(config) / config.num_layers * BF16

    def head(kind: str, vocab: int | None) -> float:
        shapes = head_shapes(HeadConfig.for_target(config, kind=kind, draft_vocab_size=vocab))
        stored = sum(math.prod(s) for name, s in shapes.items() if name != "d2t") * BF16
        return stored + (lm_head if kind == "eagle" else 0)

    return {"n-gram": 0.0, f"self ({FLAGS.self_spec_layers} layers)":
            FLAGS.self_spec_layers * per_layer + lm_head,
            "eagle3": head("eagle3", FLAGS.draft_vocab), "eagle": head("eagle", None)}


def main(argv) -> None:
    del argv
    config = planner.MODEL_PRESETS[FLAGS.model]
    chip = planner.chip_spec(FLAGS.chip)
    lengths = [float(x) for x in FLAGS.tokens_per_verification]
    print(f"{FLAGS.model} on {chip.name}, batch {FLAGS.batch}, {FLAGS.kv_len} cached "
          f"positions, R = {FLAGS.num_spec}; target weights "
          f"{roofline.weight_bytes(config, BF16) / 1e9:.2f} GB")
    print("| drafter | MB per draft | " + " | ".join(f"L = {x:g}" for x in lengths) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in lengths) + " |")
    for name, nbytes in draft_bytes(config).items():
        cells = [roofline.speculative_speedup(
            config, chip, tokens_per_verification=x, num_spec=FLAGS.num_spec,
            draft_step_bytes=nbytes, batch=FLAGS.batch, kv_len=FLAGS.kv_len) for x in lengths]
        print(f"| {name} | {nbytes / 1e6:.0f} | " + " | ".join(f"{c:.2f}x" for c in cells)
              + " |")


if __name__ == "__main__":
    app.run(main)
