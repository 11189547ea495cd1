"""Which int8 KV write rule (scale and codes per token and kv head) keeps the model closest to
f32, and where the disagreements come from.

Every variant is emulated exactly on an f32 pool: the rows are quantized and dequantized
(codes x f32 scale, the product the int8 readers form) as they are written, so K-only, V-only
and per-layer variants need no new storage. The reference is the f32 model with an f32 pool;
per variant the script reports mean KL(f32 || variant), top-1 agreement and perplexity over
the text (teacher-forced in prompt chunks, as `jaxinfer.proof.accuracy.compare`), and with
--dump a per-position .npz (KL, agreement, the reference's top-1 - top-2 log-prob margin).

Variants are `rule[:which[:layers]]`: rule one of RULES (or `k_rule/v_rule`, one for each),
which k|v|kv (default kv), layers `a-b` (inclusive; default all).

  python scripts/experiments/kv_int8_rules.py --max_tokens=513 --variants=absmax,lsq,mse
"""

from __future__ import annotations

import functools
import os
import sys
import time

from absl import app, flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)
FLAGS = flags.FLAGS
flags.DEFINE_string("text", os.path.join(REPO_ROOT, "tests", "fixtures",
                                         "public_domain_text.txt"), "UTF-8 text to score.")
flags.DEFINE_integer("max_tokens", 0, "Tokens of the text to use (0: all).")
flags.DEFINE_list("variants", ["absmax"], "rule[:k|v|kv[:first-last layer]] (module doc).")
flags.DEFINE_integer("chunk", 256, "Prompt chunk (tokens per forward).")
flags.DEFINE_string("dump", None, "Directory for per-position .npz files.")
flags.DEFINE_bool("real_int8", False, "Also run the engine's own int8 pool (checks emulation).")
flags.DEFINE_bool("row_stats", False, "Print per layer the median absmax / rms of the K and V "
                  "rows over the text's first chunk, as written and Hadamard-rotated.")

QMAX = 127.0


def _codes(x, scale):
    import jax.numpy as jnp
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    return jnp.clip(jnp.round(x * inv[..., None]), -QMAX, QMAX)


def _lsq_scale(x, q):
    """The scale minimising |x - s q|^2 for fixed codes q: <x, q> / <q, q>."""
    import jax.numpy as jnp
    qq = jnp.sum(q * q, -1)
    return jnp.where(qq > 0, jnp.sum(x * q, -1) / jnp.where(qq > 0, qq, 1.0), 0.0)


def absmax(x):
    s = abs(x).max(-1) / QMAX
    return _codes(x, s) * s[..., None]


def absmax_div(x):
    """Codes by x / s (an f32 division) rather than x * (1 / s)."""
    import jax.numpy as jnp
    s = jnp.max(jnp.abs(x), -1) / QMAX
    q = jnp.clip(jnp.round(x / jnp.where(s > 0, s, 1.0)[..., None]), -QMAX, QMAX)
    return q * s[..., None]


def lsq(x, iters: int = 1):
    """absmax codes, then the least-squares scale (alternating `iters` times)."""
    import jax.numpy as jnp
    s = jnp.max(jnp.abs(x), -1) / QMAX
    for _ in range(iters):
        q = _codes(x, s)
        s = _lsq_scale(x, q)
    return q * s[..., None]


def mse(x, grid: int = 33, lo: float = 0.7):
    """Clip at alpha x absmax, alpha on a grid in [lo, 1], codes rounded, scale refit by least
    squares; per row the alpha of least squared error."""
    import jax.numpy as jnp
    amax = jnp.max(jnp.abs(x), -1)
    best, best_err = None, None
    for alpha in jnp.linspace(lo, 1.0, grid):
        q = _codes(x, alpha * amax / QMAX)
        xh = q * _lsq_scale(x, q)[..., None]
        err = jnp.sum((x - xh) ** 2, -1)
        if best is None:
            best, best_err = xh, err
        else:
            take = err < best_err
            best, best_err = jnp.where(take[..., None], xh, best), jnp.minimum(err, best_err)
    return best


def _hadamard(n):
    import numpy as np
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def hadamard(x):
    """Rotate by an orthonormal Hadamard, absmax int8, rotate back (what the pool would hold
    if queries were rotated alike: q.k is invariant; values' output rotated back)."""
    h = _hadamard(x.shape[-1])
    return absmax(x @ h.T) @ h


def hadamard_lsq(x):
    h = _hadamard(x.shape[-1])
    return lsq(x @ h.T) @ h


RULES = {"hadamard_lsq": hadamard_lsq, "absmax": absmax, "absmax_div": absmax_div, "lsq": lsq,
         "lsq3": functools.partial(lsq, iters=3), "mse": mse, "hadamard": hadamard,
         "none": lambda x: x}


def parse(variant: str):
    parts = variant.split(":")
    names = parts[0].split("/")
    rule = tuple(RULES[n] for n in (names * 2)[:2])  # (K's rule, V's rule)
    which = parts[1] if len(parts) > 1 else "kv"
    if which not in ("k", "v", "kv"):
        raise ValueError(f"which {which!r} is not one of k, v, kv")
    layers = None
    if len(parts) > 2:
        a, b = parts[2].split("-")
        layers = range(int(a), int(b) + 1)
    return rule, which, layers


def patched_write_kv(rule, which, layers, num_layers):
    """attention.write_kv, fake-quantizing the chosen rows (layer = call index mod L: the
    layers are unrolled, so each trace calls it once per layer in order)."""
    from jaxinfer.model import attention
    original = attention.write_kv
    calls = [0]

    def write_kv(k_pages, v_pages, k_new, v_new, pages, offsets, valid):
        layer = calls[0] % num_layers
        calls[0] += 1
        if layers is None or layer in layers:
            if "k" in which:
                k_new = rule[0](k_new.astype("float32"))
            if "v" in which:
                v_new = rule[1](v_new.astype("float32"))
        return original(k_pages, v_pages, k_new, v_new, pages, offsets, valid)
    return original, write_kv


def row_stats(model, ids, chunk):
    """Median over rows (tokens x kv heads) of absmax / rms per layer, for K and V, plain and
    rotated: what sets a per-row absmax int8 error (rms error = absmax / 127 / sqrt(12))."""
    import jax
    import numpy as np

    from jaxinfer.model import attention
    original, stats = attention.write_kv, []

    def ratio(x):
        x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        x = x[np.abs(x).max(-1) > 0]
        return float(np.median(np.abs(x).max(-1) / np.sqrt((x ** 2).mean(-1))))

    def write_kv(k_pages, v_pages, k_new, v_new, *rest):
        h = _hadamard(k_new.shape[-1])
        jax.debug.callback(lambda k, v: stats.append(
            (ratio(k), ratio(k @ h.T), ratio(v), ratio(v @ h.T))), k_new, v_new)
        return original(k_pages, v_pages, k_new, v_new, *rest)
    attention.write_kv = write_kv
    try:
        run_stream(model, ids[:chunk + 1], chunk)
    finally:
        attention.write_kv = original
    print("layer  K absmax/rms  K rotated  V absmax/rms  V rotated")
    for layer, (k, kr, v, vr) in enumerate(stats):
        print(f"{layer:>5} {k:>12.2f} {kr:>10.2f} {v:>12.2f} {vr:>10.2f}")


def run_stream(model, ids, chunk, kv_dtype=None):
    """Per-chunk logits (numpy) of a fresh teacher-forced pass (a fresh jit: picks up patches)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.proof import accuracy
    stream = accuracy._Stream(model, len(ids), 16, kv_dtype)
    def step(*args, **kwargs):  # a new function per pass: jit's trace cache is keyed by it
        return accuracy._chunk_logits.__wrapped__(*args, **kwargs)
    fn = jax.jit(step, static_argnames=("num_pages_read",), donate_argnums=(2, 3))
    out = []
    for start in range(0, len(ids) - 1, chunk):
        logits, stream.k, stream.v = fn(model, jnp.asarray(ids[start:start + chunk], jnp.int32),
                                        stream.k, stream.v, jnp.int32(start),
                                        num_pages_read=stream.num_pages)
        out.append(np.asarray(jax.nn.log_softmax(logits, -1)))
    return out


def position_stats(ref, got, targets):
    import numpy as np
    kl = np.sum(np.exp(ref) * (ref - got), -1)
    top2 = np.sort(ref, -1)[:, -2:]
    return {"kl": kl, "agree": ref.argmax(-1) == got.argmax(-1), "margin": top2[:, 1] - top2[:, 0],
            "nll": -got[np.arange(len(targets)), targets],
            "ref_nll": -ref[np.arange(len(targets)), targets]}


def main(argv):
    del argv
    import numpy as np

    from jaxinfer.checkpoint.loading import load_model, load_tokenizer
    from jaxinfer.checkpoint.weights import load_checkpoint
    from jaxinfer.config import RunConfig
    from jaxinfer.model import attention

    ckpt = load_checkpoint(None)
    with open(FLAGS.text, encoding="utf-8") as f:
        ids = np.asarray(load_tokenizer(ckpt).encode(f.read()), np.int32)
    if FLAGS.max_tokens:
        ids = ids[:FLAGS.max_tokens]
    ids = ids[:(len(ids) - 1) // FLAGS.chunk * FLAGS.chunk + 1]
    targets = ids[1:]
    model, _ = load_model(RunConfig(dtype="float32"), ckpt)
    if FLAGS.row_stats:
        row_stats(model, ids, FLAGS.chunk)
    t0 = time.perf_counter()
    ref = run_stream(model, ids, FLAGS.chunk)
    print(f"{len(ids) - 1} positions; reference {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    runs = list(FLAGS.variants) + (["real-int8"] if FLAGS.real_int8 else [])
    print(f"{'variant':<22} {'mean KL':>9} {'top-1':>8} {'agree':>9} {'ppl':>8} {'ref ppl':>8}")
    for variant in runs:
        t0 = time.perf_counter()
        if variant == "real-int8":
            got = run_stream(model, ids, FLAGS.chunk, "int8")
        else:
            rule, which, layers = parse(variant)
            original, patched = patched_write_kv(rule, which, layers, model.config.num_layers)
            attention.write_kv = patched
            try:
                got = run_stream(model, ids, FLAGS.chunk)
            finally:
                attention.write_kv = original
        parts = [position_stats(r, g, targets[i * FLAGS.chunk:(i + 1) * FLAGS.chunk])
                 for i, (r, g) in enumerate(zip(ref, got))]
        st = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        n = len(st["kl"])
        print(f"{variant:<22} {st['kl'].mean():>9.5f} {st['agree'].mean():>8.4f} "
              f"{int(st['agree'].sum()):>4}/{n:<4} {np.exp(st['nll'].mean()):>8.3f} "
              f"{np.exp(st['ref_nll'].mean()):>8.3f}   ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        if FLAGS.dump:
            os.makedirs(FLAGS.dump, exist_ok=True)
            name = variant.replace(":", "_").replace("/", "+")
            np.savez(os.path.join(FLAGS.dump, name + ".npz"), **st)
    return 0


if __name__ == "__main__":
    app.run(main)
