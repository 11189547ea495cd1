"""Convert a GGUF file or a Hugging Face safetensors directory into a jaxinfer orbax checkpoint.

The orbax checkpoint holds the model's own fused, einsum-native weights
(`jaxinfer.checkpoint.orbax`), plus config.json and the tokenizer. Loading it
(`--model_path=<dir>` with any `--mesh`) restores every weight straight into its shards: no host
dequantize/fuse pass, and no array whole on one device unless its sharding replicates it. The
conversion itself runs on the host (CPU only; about twice the model's bytes of memory).

  python scripts/convert_checkpoint.py --output=/tmp/smollm2-orbax                 # default GGUF
  python scripts/convert_checkpoint.py --model_path=/path/to/Llama-3.1-8B-Instruct \\
      --output=/data/llama-3.1-8b-orbax --dtype=bfloat16
  python scripts/convert_checkpoint.py --output=/tmp/smollm2-int8 --weight_dtype=int8
  jaxinfer-generate --model_path=/data/llama-3.1-8b-orbax --mesh=model:8 --prompt="Hi" --chat
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model_path", None, "GGUF file or HF directory (default: embedded SmolLM2).")
flags.DEFINE_string("output", None, "Directory to write the orbax checkpoint to.", required=True)
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                  "Stored dtype of the matrices (norms stay float32). Default: bfloat16 for a "
                  "bf16 source, else float32.")
flags.DEFINE_enum("weight_dtype", None, ["int8", "int4"],
                  "Quantize the matrices while reading (jaxinfer.model.quant); the checkpoint "
                  "then stores the int8/int4 arrays and their scales.")
flags.DEFINE_bool("scan_layers", True,
                  "Store each layer kind's weights stacked (the layout TPU runs use); "
                  "false: one array per layer. Either loads in either layout.")
flags.DEFINE_bool("overwrite", False, "Replace an existing orbax checkpoint at --output.")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(path) for name in names)


def convert(model_path: str | None, output: str, *, dtype: str | None = None,
            weight_dtype: str | None = None, scan_layers: bool = True,
            overwrite: bool = False) -> dict:
    """Load the source checkpoint, write the orbax one; returns its marker plus timings and the
    on-disk size ("disk_bytes")."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host-only work: never grab an accelerator
    from jaxinfer.checkpoint.orbax import save_orbax
    from jaxinfer.checkpoint.weights import load_checkpoint

    t0 = time.perf_counter()
    ckpt = load_checkpoint(model_path, weight_dtype=weight_dtype)
    t1 = time.perf_counter()
    info = save_orbax(ckpt, output, dtype=dtype, scan_layers=scan_layers, overwrite=overwrite)
    t2 = time.perf_counter()
    return {**info, "output": os.path.abspath(output), "disk_bytes": _dir_bytes(output),
            "load_s": t1 - t0, "save_s": t2 - t1, "num_params": ckpt.config.num_params()}


def main(argv: list[str]) -> None:
    del argv
    info = convert(FLAGS.model_path, FLAGS.output, dtype=FLAGS.dtype,
                   weight_dtype=FLAGS.weight_dtype, scan_layers=FLAGS.scan_layers,
                   overwrite=FLAGS.overwrite)
    out = info["output"]
    print(f"read {info['source']} ({info['source_format']}, {info['num_params'] / 1e6:.1f}M "
          f"params) in {info['load_s']:.1f}s", file=sys.stderr)
    print(f"wrote {out} in {info['save_s']:.1f}s: {info['num_arrays']} arrays, "
          f"{info['dtype']}, {info['bytes'] / 2**20:.1f} MiB of weights, "
          f"{info['disk_bytes'] / 2**20:.1f} MiB on disk")
    for name in sorted(os.listdir(out)):
        full = os.path.join(out, name)
        size = _dir_bytes(full) if os.path.isdir(full) else os.path.getsize(full)
        print(f"  {name}{'/' if os.path.isdir(full) else ''}  {size / 2**20:.2f} MiB")
    if not info["tokenizer"]:
        print("  (no tokenizer in the source: token-id prompts only)")
    print(f"use it: jaxinfer-generate --model_path={out} [--mesh=model:N] --prompt=...")


if __name__ == "__main__":
    app.run(main)
