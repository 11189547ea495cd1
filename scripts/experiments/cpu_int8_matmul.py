"""Which int8-weight matmul is fastest on XLA CPU: SmolLM2-135M's weight matmuls at M rows.

30 layers of SmolLM2-135M's weight shapes (qkv 576x960, o 576x576, gate/up 576x3072, down
1536x576) plus the tied LM head (49152x576, contracted on its last axis), multiplied by M rows
(M = 1, 8, 32: decode batches), each weight stored as int8 with one f32 scale per output
channel (`jaxinfer.model.quant`'s int8 layout), computed as:

* f32:       the f32 weights (the reference speed; 4x the bytes);
* convert:   x @ q.astype(f32), scale on the output (what `quant.einsum` does by default);
* mixed:     lax.dot_general(x f32, q int8, preferred_element_type=f32): one dot, mixed operands;
* bf16:      x and q.astype(bf16), f32 accumulation;
* reduce:    sum(x[:, :, None] * q.astype(f32), axis=1): a reduction XLA fuses with the convert,
             so the int8 bytes are read once with no f32 temporary (M = 1 only);
* w8a8:      x quantized to int8 per row, int8 x int8 -> int32 (loses accuracy on this model:
             docs/benchmarks.md, "Quantized weights");
* w8a16:     x split into two int8 parts (hi + lo / 254 per row scale: ~15 bits), two
             int8 x int8 -> int32 dots summed: W8A8's speed twice, near-f32 activations.

Prints ms per pass of the whole stack (median of --repeats) / minor page faults per pass
(thousands: every 4 KiB page of a temporary that XLA maps afresh each call), and each
variant's max relative error against the f32 product of the dequantized weights.

  python scripts/experiments/cpu_int8_matmul.py --rows=1,8,32
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # qkv, o, gate|up, down
VOCAB = 49152


def _seconds(f, *args, repeats: int) -> tuple[float, float]:
    """(median seconds, minor page faults per call) of `repeats` calls after a warm-up."""
    jax.block_until_ready(f(*args))
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return float(np.median(times)), faults / repeats


# Each matmul takes x [M, K] and a weight dict: "w" f32 [K, N] or "q" i8 [K, N] + "s" f32 [N]
# (the LM head is stored [N, K], contracted on its last axis) and returns f32 [M, N].
def _dims(w):
    return ((1,), (1,)) if w["q" if "q" in w else "w"].shape[0] == VOCAB else ((1,), (0,))


def mm_f32(x, w):
    return jax.lax.dot_general(x, w["w"], (_dims(w), ((), ())))


def mm_convert(x, w):
    return jax.lax.dot_general(x, w["q"].astype(x.dtype), (_dims(w), ((), ()))) * w["s"]


def mm_mixed(x, w):
    return jax.lax.dot_general(x, w["q"], (_dims(w), ((), ())),
                               preferred_element_type=jnp.float32) * w["s"]


def mm_bf16(x, w):
    return jax.lax.dot_general(x.astype(jnp.bfloat16), w["q"].astype(jnp.bfloat16),
                               (_dims(w), ((), ())), preferred_element_type=jnp.float32) * w["s"]


def mm_reduce(x, w):
    q = w["q"].astype(x.dtype)
    if _dims(w)[1] == (1,):
        return jnp.sum(x[:, None, :] * q[None], axis=2) * w["s"]
    return jnp.sum(x[:, :, None] * q[None], axis=1) * w["s"]


def _int8_dot(a, w):
    return jax.lax.dot_general(a, w["q"], (_dims(w), ((), ())),
                               preferred_element_type=jnp.int32).astype(jnp.float32)


def mm_w8a8(x, w):
    sx = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), 1e-30) / 127
    a = jnp.round(x / sx).astype(jnp.int8)
    return _int8_dot(a, w) * sx * w["s"]


def mm_w8a16(x, w):
    sx = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), 1e-30) / 127
    y = x / sx
    hi = jnp.round(y)
    lo = jnp.round((y - hi) * 254)
    return ((_int8_dot(hi.astype(jnp.int8), w) + _int8_dot(lo.astype(jnp.int8), w) / 254)
            * sx * w["s"])


CHUNK_BYTES = [1 << 19]  # f32 temporary per chunk (--chunk_kib)


def _chunks(w):
    """(output axis of q, its length, columns per chunk) for a temporary of <= CHUNK_BYTES."""
    axis = 0 if _dims(w)[1] == (1,) else 1
    n, k = w["q"].shape[axis], w["q"].shape[1 - axis]
    size = max(1, CHUNK_BYTES[0] // (4 * k))
    while n % size:
        size -= 1
    return axis, n, size


def mm_chunk(x, w):
    """convert + dot per output chunk; each chunk's convert waits (optimization_barrier) for the
    previous chunk's product, so the f32 temporaries live one at a time and stay in cache."""
    axis, n, size = _chunks(w)
    outs, dep = [], x
    for start in range(0, n, size):
        dep, q = jax.lax.optimization_barrier((dep, jax.lax.slice_in_dim(w["q"], start,
                                                                          start + size, axis=axis)))
        out = jax.lax.dot_general(x, q.astype(x.dtype), (_dims(w), ((), ())))
        outs.append(out)
        dep = out
    return jnp.concatenate(outs, axis=1) * w["s"]


def mm_loop(x, w):
    """convert + dot per output chunk in a fori_loop (one chunk-sized temporary, reused)."""
    axis, n, size = _chunks(w)

    def body(i, out):
        q = jax.lax.dynamic_slice_in_dim(w["q"], i * size, size, axis=axis)
        part = jax.lax.dot_general(x, q.astype(x.dtype), (_dims(w), ((), ())))
        return jax.lax.dynamic_update_slice_in_dim(out, part, i * size, axis=1)
    out = jnp.zeros((x.shape[0], n), x.dtype)
    return jax.lax.fori_loop(0, n // size, body, out) * w["s"]


def mm_barrier(x, w):
    """convert + dot of the whole weight, the convert made to wait for x (optimization_barrier):
    the weights' temporaries live one at a time instead of all at once."""
    x, q = jax.lax.optimization_barrier((x, w["q"]))
    return jax.lax.dot_general(x, q.astype(x.dtype), (_dims(w), ((), ()))) * w["s"]


VARIANTS = {"f32": mm_f32, "convert": mm_convert, "mixed": mm_mixed, "bf16": mm_bf16,
            "reduce": mm_reduce, "w8a8": mm_w8a8, "w8a16": mm_w8a16, "barrier": mm_barrier,
            "chunk": mm_chunk, "loop": mm_loop}


def _weights(rng, f32: bool):
    """The stack as weight dicts: f32 (dequantized int8) or int8 + scale."""
    def one(k, n, t):
        w = rng.standard_normal((n, k) if t else (k, n), np.float32) * 0.03
        amax = np.abs(w).max(axis=1 if t else 0)
        s = (amax / 127).astype(np.float32)
        q = np.clip(np.rint(w / (s[:, None] if t else s)), -127, 127).astype(np.int8)
        if f32:
            deq = q.astype(np.float32) * (s[:, None] if t else s)
            return {"w": jnp.asarray(deq)}
        return {"q": jnp.asarray(q), "s": jnp.asarray(s)}
    layers = [[one(k, n, False) for k, n in SHAPES] for _ in range(LAYERS)]
    return layers, one(576, VOCAB, True)


def _forward(matmul):
    def forward(x, layers, head):
        for qkv, o, gate_up, down in layers:
            h = matmul(x, qkv)
            x = x + matmul(h[:, :576], o)
            g = matmul(x, gate_up)
            x = x + matmul(jax.nn.silu(g[:, :1536]) * g[:, 1536:], down) * 0.1
            x = x / jnp.sqrt(jnp.mean(x * x, axis=1, keepdims=True) + 1e-6)
        return matmul(x, head)
    return jax.jit(forward)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,32", help="M values")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--chunk_kib", type=int, default=512, help="f32 temporary per chunk (chunk, "
                   "loop)")
    args = p.parse_args()
    CHUNK_BYTES[0] = args.chunk_kib << 10
    rng = np.random.default_rng(0)
    # Same int8 values for both: the f32 stack is the int8 one dequantized.
    q_layers, q_head = _weights(np.random.default_rng(0), f32=False)
    f_layers, f_head = _weights(np.random.default_rng(0), f32=True)
    nbytes = {"f32": sum(w["w"].nbytes for layer in f_layers for w in layer) + f_head["w"].nbytes,
              "int8": sum(w["q"].nbytes for layer in q_layers for w in layer) + q_head["q"].nbytes}
    print(f"{LAYERS} layers + LM head: f32 {nbytes['f32'] / 1e6:.0f} MB, int8 "
          f"{nbytes['int8'] / 1e6:.0f} MB; backend {jax.default_backend()}, jax {jax.__version__}")
    names = args.variants.split(",")
    print(f"{'M':>3} " + " ".join(f"{n + ' ms':>11}" for n in names) + "   max rel err vs f32")
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((m, 576), np.float32))
        ref = np.asarray(_forward(mm_f32)(x, f_layers, f_head))
        cells, errs = [], []
        for name in names:
            if name == "reduce" and m > 1:
                cells.append(f"{'-':>11}")
                continue
            fn = _forward(VARIANTS[name])
            weights = (f_layers, f_head) if name == "f32" else (q_layers, q_head)
            secs, faults = _seconds(fn, x, *weights, repeats=args.repeats)
            cells.append(f"{secs * 1e3:6.1f}/{faults / 1e3:4.0f}k")
            out = np.asarray(fn(x, *weights))
            errs.append(f"{name} {np.abs(out - ref).max() / np.abs(ref).max():.1e}")
        print(f"{m:3d} " + " ".join(cells) + "   " + ", ".join(errs), flush=True)


if __name__ == "__main__":
    main()
