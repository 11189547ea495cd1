"""Accuracy of quantized weights and KV caches against the f32 model on real text
(`jaxinfer.proof.accuracy`).

For each weight dtype x KV cache dtype the next-token distributions over the text
(teacher-forced, prompt chunks through each model's own paged KV cache) are compared with the
f32 model's (f32 weights, f32 KV): mean KL divergence KL(f32 || quantized) in nats, top-1
agreement and perplexity. The f32 model of the embedded default is the GGUF's own Q4_1 weights
(and Q8_0 embedding) dequantized, so the weight rows are:

  float32              the f32 weights themselves (a row only with a quantized KV cache)
  bfloat16             the f32 weights rounded to bf16 (activations f32)
  int8-channel         the f32 weights quantized per output channel (round to nearest; the
                       int8 layout of a float checkpoint)
  int8-g32             the f32 weights quantized in asymmetric groups of 32 (round to nearest)
  int8-gguf            read from the file into int8 (groups of 32, the layout of a GGUF load):
                       Q8_0/Q4_x/Q5_x blocks kept exactly, embedding/LM head included
  int4-rtn             the f32 weights quantized in groups of --int4_group, every layer
                       matrix int4 (embedding/LM head int8 per row)
  int4-gguf            read from the file into int4: Q4_0/Q4_1/Q4_K blocks kept exactly (the
                       GGUF's own 4-bit weights); the matrices the file's 4-bit mix stores
                       wider int8 as int8-gguf (`jaxinfer.checkpoint.requant`), the
                       embedding/LM head too

and each is run with every KV cache dtype of --kv_dtypes (float32: the pool in f32; int8:
int8 pages with an f32 scale per token and kv head, `jaxinfer.model.kv_quant`).

  python scripts/quant_eval.py                       # the whole fixture text (~2400 tokens)
  python scripts/quant_eval.py --max_tokens=513 --weight_dtypes=int8-gguf --kv_dtypes=int8

Prints a table, then one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("model_path", None, "GGUF file or HF directory (default: embedded SmolLM2).")
flags.DEFINE_string("text", os.path.join(REPO_ROOT, "tests", "fixtures",
                                         "public_domain_text.txt"), "UTF-8 text to score.")
flags.DEFINE_integer("max_tokens", 0, "Tokens of the text to use (0: all).")
flags.DEFINE_list("weight_dtypes", ["float32", "bfloat16", "int8-channel", "int8-g32",
                                     "int8-gguf", "int4-rtn", "int4-gguf"],
                  "Weights of the rows to compare with f32 (see the module doc).")
flags.DEFINE_list("kv_dtypes", ["float32", "int8"], "KV cache dtypes of the rows.")
flags.DEFINE_integer("int4_group", 32, "int4 group size.")
flags.DEFINE_integer("chunk", 256, "Prompt chunk (tokens per forward).")


def build(name: str, ckpt, group: int):
    """The model of row `name`, from the float checkpoint `ckpt` (or its file)."""
    from jaxinfer.checkpoint.loading import load_model
    from jaxinfer.config import RunConfig
    from jaxinfer.model import Llama

    if name in ("float32", "bfloat16"):
        return Llama(dataclasses.replace(ckpt.config, dtype="float32", weight_dtype=name),
                     ckpt.params)
    kinds = {"int8-channel": ("int8", 0), "int8-g32": ("int8", 32), "int8-gguf": ("int8", None),
             "int4-rtn": ("int4", 0), "int4-gguf": ("int4", None)}
    if name not in kinds:
        raise ValueError(f"weight row {name!r} is not one of {('float32', 'bfloat16', *kinds)}")
    kind, int8_group = kinds[name]
    if int8_group is None:  # read from the file
        model, _ = load_model(RunConfig(dtype="float32", weight_dtype=kind,
                                        model_path=ckpt.path))
        return model
    config = dataclasses.replace(ckpt.config, dtype="float32", weight_dtype=kind,
                                 int4_group_size=group, int8_group_size=int8_group,
                                 int8_matrices=())
    return Llama(config, ckpt.params)


def main(argv):
    del argv
    from jaxinfer.checkpoint.loading import load_model, load_tokenizer
    from jaxinfer.checkpoint.weights import load_checkpoint
    from jaxinfer.config import RunConfig
    from jaxinfer.proof.accuracy import compare

    ckpt = load_checkpoint(FLAGS.model_path)
    with open(FLAGS.text, encoding="utf-8") as f:
        ids = load_tokenizer(ckpt).encode(f.read())
    if FLAGS.max_tokens:
        ids = ids[:FLAGS.max_tokens]
    reference, _ = load_model(RunConfig(dtype="float32"), ckpt)
    built = {name: build(name, ckpt, FLAGS.int4_group) for name in FLAGS.weight_dtypes}
    rows = [(w, kv) for w in FLAGS.weight_dtypes for kv in FLAGS.kv_dtypes
            if (w, kv) != ("float32", "float32")]  # that one is the reference
    models = {f"{w}/{kv}": built[w] for w, kv in rows}
    t0 = time.perf_counter()
    results = compare(reference, models, ids, chunk=FLAGS.chunk,
                      kv_dtypes={f"{w}/{kv}": kv for w, kv in rows})
    print(f"{len(ids)} tokens of {os.path.basename(FLAGS.text)}, "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print(f"{'weights/KV':<18} {'mean KL (nats)':>15} {'top-1':>8} {'perplexity':>11}")
    first = next(iter(results.values()))
    print(f"{'float32/float32':<18} {0.0:>15.5f} {1.0:>8.4f} "
          f"{first.reference_perplexity:>11.3f}")
    for name, r in results.items():
        print(f"{name:<18} {r.mean_kl:>15.5f} {r.top1:>8.4f} {r.perplexity:>11.3f}")
    print(json.dumps({"positions": first.positions, "text": os.path.basename(FLAGS.text),
                      "int4_group": FLAGS.int4_group,
                      "results": {k: v.as_dict() for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    app.run(main)
