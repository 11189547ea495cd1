"""One table of what a GPU does with jaxinfer, in a few minutes (run by gpu_bench.sh).

- decode tok/s of a Llama-3.1-8B-shaped model (random bf16 weights made on the GPU: decode speed
  does not depend on their values) at batch 1/8/32/128, context 1024, with the HBM bytes per
  step (weights + KV read) as a fraction of the chip's bandwidth (H200: 4.8 TB/s);
- prefill of one 2048-token prompt, FLOP/s as a fraction of the bf16 peak;
- our Pallas decode kernel against jax's shipped `ops.gpu.paged_attention` on the same pool
  (8B heads, batch 32, context 4096): GB/s of K/V read;
- our ragged prefill kernel against the XLA path on one 512-token prompt chunk over a 4096-token
  paged context (8B heads): FLOP/s as a fraction of the bf16 peak;
- the real default model's (SmolLM2-135M) n-gram speculative speedup at batch 1 on a copy
  workload (the prompt asks to repeat a text it contains);
- with --speculation, then: an EAGLE-3 head trained on this device for the default model
  (scripts/train_draft_head.py's defaults, into --head_dir) and scripts/spec_benchmark.py's
  table with it: none / n-gram / self / eagle, R = 4 chains and the 3,2,1 tree, chat and copy
  prompts, batch 1 and 8 (each script in its own process: they define their own flags).

Every number is measured after a warm-up call, between `block_until_ready`s. `--smoke` runs
every piece at toy sizes on any backend (CPU: the kernels in interpret mode) to check the
script, not the hardware. Prints the table, then one JSON line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxinfer.config import CacheConfig, EngineConfig, ModelConfig, SamplingConfig  # noqa: E402
from jaxinfer.engine import steps  # noqa: E402
from jaxinfer.engine.kv_cache import contiguous_page_table, pages_bucket  # noqa: E402
from jaxinfer.engine.runner import ModelRunner  # noqa: E402
from jaxinfer.model import Llama  # noqa: E402
from jaxinfer.perf import planner, roofline  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "Toy sizes on any backend: checks the script, not the GPU.")
flags.DEFINE_string("chip", "h200", "Roofline chip for the fractions (h200, h100).")
flags.DEFINE_bool("speculation", False, "Then train an EAGLE-3 head on this device and print "
                  "the speculative decoding table (module doc).")
flags.DEFINE_string("head_dir", "/tmp/jaxinfer-gpu-eagle3",
                    "Where --speculation trains the head (--smoke: with a -smoke suffix).")

COPY_TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm "
             "windowsill and the rain taps softly against the glass. ") * 3


def sizes(smoke: bool) -> dict:
    if smoke:
        model = ModelConfig(vocab_size=256, embed_dim=64, num_layers=2, num_q_heads=4,
                            num_kv_heads=2, head_dim=16, ffn_dim=128, max_position=512,
                            dtype="float32")
        return dict(model=model, batches=(1, 2), context=32, prefill=16, steps=1,
                    kernel=dict(batch=1, heads=(2, 2, 16), context=32),
                    chunk=dict(chunk=16, heads=(2, 2, 16), context=48), new_tokens=6)
    model = dataclasses.replace(planner.model_preset("llama-3.1-8b"), max_position=8192)
    return dict(model=model, batches=(1, 8, 32, 128), context=1024, prefill=2048, steps=20,
                kernel=dict(batch=32, heads=(8, 4, 128), context=4096),
                chunk=dict(chunk=512, heads=(8, 4, 128), context=4096), new_tokens=256)


def random_params(model: Llama, seed: int = 0) -> tuple[steps.ModelGraph, dict]:
    """(graph, params) with every weight drawn on the device (normal * 0.02, norms 1)."""
    graph, abstract = steps.split_model(model)
    leaves, treedef = jax.tree.flatten(abstract)

    @jax.jit
    def make(key):
        keys = jax.random.split(key, len(leaves))
        return [jnp.ones(x.shape, x.dtype) if len(x.shape) == 1 else
                (0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
                for k, x in zip(keys, leaves)]

    return graph, jax.tree.unflatten(treedef, make(jax.random.key(seed)))


def timed(fn, n: int) -> float:
    """Seconds per call of `fn` (a device step) over n calls after one warm-up call."""
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def _runner(graph, params, config, batch, max_len, impl):
    cache = CacheConfig(page_size=16, max_seq_len=max_len).resolved(config)
    cache = dataclasses.replace(cache, num_pages=batch * cache.pages_per_seq)
    return ModelRunner(graph, params, config=config, cache=cache, max_slots=batch,
                       attention_impl=impl), cache


def decode_row(graph, params, config, batch, context, n, impl, chip) -> dict:
    """Decode steps of `batch` rows at `context`: tok/s and HBM bytes/s vs the chip."""
    runner, cache = _runner(graph, params, config, batch, context + 16, impl)
    table = contiguous_page_table(batch, cache.pages_per_seq)
    step = dataclasses.replace(steps.MixedBatch.idle(batch, cache.pages_per_seq), page_table=table,
                               decode=np.ones((batch,), bool),
                               decode_pos=np.full((batch,), context, np.int32))
    pages = pages_bucket(context + 1, cache.page_size, cache.pages_per_seq)
    seconds = timed(lambda: runner.mixed(step, pages), n)
    itemsize = jnp.dtype(config.dtype).itemsize
    weights = roofline.weight_bytes(config, itemsize)
    kv = batch * (context + 1) * roofline.kv_bytes_per_token(config, itemsize)
    bw = (weights + kv) / seconds
    return dict(case=f"decode batch {batch}, context {context}", ms=seconds * 1e3,
                rate=f"{batch / seconds:,.0f} tok/s", fraction=bw / chip.hbm_bytes_per_s,
                of=f"{bw / 1e9:,.0f} GB/s of HBM")


def prefill_row(graph, params, config, length, n, impl, chip) -> dict:
    """One prompt of `length` tokens in one chunk: FLOP/s vs the chip's bf16 peak."""
    runner, cache = _runner(graph, params, config, 1, length, impl)
    step = dataclasses.replace(
        steps.MixedBatch.idle(1, cache.pages_per_seq, length),
        page_table=contiguous_page_table(1, cache.pages_per_seq),
        chunk_tokens=np.arange(length, dtype=np.int32) % config.vocab_size,
        chunk_len=np.int32(length), chunk_samples=np.bool_(True), chunk_fresh=np.bool_(True),
        chunk_prompt_len=np.int32(length))
    seconds = timed(lambda: runner.mixed(step, cache.pages_per_seq), n)
    flops = roofline.prefill_flops(config, length) / seconds
    return dict(case=f"prefill {length} tokens", ms=seconds * 1e3,
                rate=f"{length / seconds:,.0f} tok/s", fraction=flops / chip.peak_flops_bf16,
                of=f"{flops / 1e12:,.1f} TFLOP/s of bf16 peak")


def kernel_rows(cfg: dict, chip, interpret: bool) -> list[dict]:
    """Our paged decode kernel and jax's shipped `ops.gpu.paged_attention` on one pool."""
    from jax.experimental.pallas.ops.gpu import paged_attention as shipped

    from pallas_kernels.paged_attention import paged_decode_attention

    b, (k, g, h), context, page = cfg["batch"], cfg["heads"], cfg["context"], 16
    p = context // page
    keys = jax.random.split(jax.random.key(1), 3)
    dt = jnp.float32 if interpret else jnp.bfloat16
    pool = (k, b * p + 1, page, h)
    k_pages, v_pages = (jax.random.normal(x, pool, dt) for x in keys[:2])
    q = jax.random.normal(keys[2], (b, 1, k, g, h), dt)
    table = jnp.asarray(contiguous_page_table(b, p))
    lengths = jnp.full((b,), context, jnp.int32)
    kv_bytes = 2 * b * context * k * h * jnp.dtype(dt).itemsize
    ours = jax.jit(paged_decode_attention)
    splits = min(16, p)  # jax's defaults (16 splits of 8-page blocks), shrunk for a toy pool
    theirs = jax.jit(lambda q, kp, vp, t, n: shipped.paged_attention(
        q.reshape(b, k * g, h), kp, vp, t, n, k_splits=splits,
        pages_per_compute_block=min(8, p // splits), interpret=interpret))
    rows = []
    for name, fn in (("ours", ours), ("jax ops.gpu.paged_attention", theirs)):
        args = (q, k_pages, v_pages, lengths, table) if name == "ours" else (
            q, k_pages, v_pages, table, lengths)
        try:
            seconds = timed(lambda fn=fn, args=args: fn(*args), 3 if interpret else 50)
        except Exception as e:  # a kernel that fails on this backend is a result to report
            rows.append(dict(case=f"kernel: {name}", ms=float("nan"), rate="failed",
                             fraction=float("nan"), of=str(e).splitlines()[0][:80]))
            continue
        rows.append(dict(case=f"kernel: {name}, batch {b}, context {context}", ms=seconds * 1e3,
                         rate=f"{kv_bytes / seconds / 1e9:,.0f} GB/s",
                         fraction=kv_bytes / seconds / chip.hbm_bytes_per_s, of="of HBM"))
    return rows


def chunk_rows(cfg: dict, chip, interpret: bool) -> list[dict]:
    """One prompt chunk (the last `chunk` of `context` tokens, K/V already paged) through our
    ragged flash kernel and the engine's XLA path: FLOP/s of the attended pairs vs bf16 peak."""
    from jaxinfer.model.attention import paged_attention_reference
    from pallas_kernels.ragged_attention import ragged_paged_attention
    from pallas_kernels.ragged_attention.gpu import ragged_paged_attention_gpu

    n, (k, g, h), context, page = cfg["chunk"], cfg["heads"], cfg["context"], 16
    p = context // page
    keys = jax.random.split(jax.random.key(2), 3)
    dt = jnp.float32 if interpret else jnp.bfloat16
    k_pages, v_pages = (jax.random.normal(x, (k, p + 1, page, h), dt) for x in keys[:2])
    q = jax.random.normal(keys[2], (n, k, g, h), dt)
    table, lens = jnp.asarray(contiguous_page_table(1, p)), jnp.asarray([context], jnp.int32)
    kernel = (functools.partial(ragged_paged_attention_gpu, interpret=True) if interpret
              else ragged_paged_attention)  # backend-dispatched
    ours = jax.jit(lambda q, kp, vp: kernel(q, kp, vp, lens, table, jnp.zeros((1,), jnp.int32),
                                            jnp.asarray([n], jnp.int32)))
    positions = jnp.arange(context - n, context, dtype=jnp.int32)[None]
    xla = jax.jit(lambda q, kp, vp: paged_attention_reference(
        q[None], kp, vp, table, positions, lens, num_pages_read=p)[0])
    flops = 4 * h * k * g * (n * (context - n) + n * (n + 1) // 2)
    rows = []
    for name, fn in (("ours", ours), ("XLA path", xla)):
        seconds = timed(lambda fn=fn: fn(q, k_pages, v_pages), 3 if interpret else 20)
        rows.append(dict(case=f"prefill attention: {name}, chunk {n}, context {context}",
                         ms=seconds * 1e3, rate=f"{flops / seconds / 1e12:,.1f} TFLOP/s",
                         fraction=flops / seconds / chip.peak_flops_bf16, of="of bf16 peak"))
    return rows


def spec_row(smoke: bool, new_tokens: int) -> dict:
    """Greedy tok/s at batch 1 with n-gram drafting over without, on a copy workload: the real
    default model and a prompt that asks to repeat a text (smoke: a toy random model whose
    prompt repeats a token sequence)."""
    from jaxinfer.engine.llm import LLM

    if smoke:
        from jaxinfer.model.params import init_params

        config = sizes(True)["model"]
        model, tok = Llama(config, init_params(config, seed=3)), None
        prompt = list(range(5, 25)) * 2
    else:
        from jaxinfer.checkpoint.loading import load_model, load_tokenizer
        from jaxinfer.config import RunConfig

        model, ckpt = load_model(RunConfig(dtype="bfloat16"))
        tok = load_tokenizer(ckpt)
        prompt = f"Repeat the following text exactly, once:\n\n{COPY_TEXT}"
    sampling = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
    rates = {}
    for method in ("none", "ngram"):
        llm = LLM(model, tok, cache=CacheConfig(max_seq_len=min(1024, model.config.max_position)),
                  engine=EngineConfig(max_slots=1, speculative_method=method))
        for _ in range(2):  # compiles; the second call is the timed one's shape (prefix hit)
            llm.generate([prompt], sampling, use_tqdm=False)
        t0 = time.perf_counter()
        out = llm.generate([prompt], sampling, use_tqdm=False)
        rates[method] = len(out[0].token_ids) / (time.perf_counter() - t0)
    speedup = rates["ngram"] / rates["none"]
    return dict(case="n-gram speculation, batch 1, copy workload", ms=1e3 / rates["ngram"],
                rate=f"{rates['ngram']:,.0f} vs {rates['none']:,.0f} tok/s", fraction=speedup,
                of="speedup (x)")


def speculation(smoke: bool, head: str) -> None:
    """Trains the head and prints the speculative decoding table (module doc); --smoke: a few
    steps and tokens, to check the commands."""
    import subprocess

    scripts = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    train, bench = [], []
    if smoke:
        head += "-smoke"
        train = ["--num_prompts=4", "--num_held_out=2", "--max_new_tokens=8", "--seq_len=48",
                 "--draft_vocab=256", "--steps=2", "--batch_size=2", "--eval_every=2",
                 "--eval_depth=2", "--depth=2"]
        bench = ["--workloads=chat", "--batch_sizes=1", "--max_new_tokens=8"]
    subprocess.run([sys.executable, os.path.join(scripts, "train_draft_head.py"), f"--out={head}",
                    *train], check=True)
    subprocess.run([sys.executable, os.path.join(scripts, "spec_benchmark.py"),
                    "--methods=ngram,self,eagle", "--num_spec=4", f"--draft_head_path={head}",
                    "--spec_tree=3,2,1", *bench], check=True)


def run(smoke: bool, chip_name: str) -> list[dict]:
    s, chip = sizes(smoke), planner.chip_spec(chip_name)
    impl = "xla" if jax.default_backend() == "cpu" else "pallas"
    graph, params = random_params(Llama.abstract(s["model"]))
    rows = [decode_row(graph, params, s["model"], b, s["context"], s["steps"], impl, chip)
            for b in s["batches"]]
    rows.append(prefill_row(graph, params, s["model"], s["prefill"], max(2, s["steps"] // 4),
                            impl, chip))
    del params
    rows += kernel_rows(s["kernel"], chip, interpret=jax.default_backend() == "cpu")
    rows += chunk_rows(s["chunk"], chip, interpret=jax.default_backend() == "cpu")
    rows.append(spec_row(smoke, s["new_tokens"]))
    return rows


def main(argv) -> int:
    del argv
    t0 = time.perf_counter()
    rows = run(FLAGS.smoke, FLAGS.chip)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, fractions of {FLAGS.chip}"
          + (" (SMOKE: toy sizes, numbers mean nothing)" if FLAGS.smoke else ""))
    print("| case | ms | rate | fraction | of |\n| --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['ms']:.3f} | {r['rate']} | {r['fraction']:.2f} | {r['of']} |")
    print(f"total {time.perf_counter() - t0:.0f} s")
    print(json.dumps({"smoke": FLAGS.smoke, "chip": FLAGS.chip, "rows": rows}), flush=True)
    if FLAGS.speculation:
        speculation(FLAGS.smoke, FLAGS.head_dir)
    return 0


if __name__ == "__main__":
    app.run(main)
