"""Which XLA formulation of the batched multi-adapter LoRA product is fastest on CPU?

A decode step's weight traffic on SmolLM2-135M's shapes (30 layers, D 576, q [D, 576],
k and v [D, 192], o [576, D], gate and up [D, 1536], down [1536, D], f32), attention left
out: one matmul chain per layer over B rows, plus, per row n with adapter slot s(n) (-1: none),
the LoRA term (x A_s(n)) B_s(n) on every projection, from a pool of S slots of rank r
(A: [S, D_in, r] per input, the projections that share an input sharing one fused A; B:
[S, r, D_out] per projection). The forms:

  base       no LoRA at all (the floor)
  onehot     every slot for every row: u = x A_all (one dot over all S adapters), zeroed
             outside the row's slot, then one dot contracting (slot, rank) with B_all; reads the
             pool once, computes S times the rows' product
  gather     each row's A and B gathered (A[s(n)], B[s(n)]), a batched product per row; reads
             B copies of what the rows use
  ragged     rows sorted by slot, `jax.lax.ragged_dot` per factor, unsorted after (the
             segmented form; in jax 0.10 XLA:CPU expands it densely)
  loop       rows sorted by slot, a `fori_loop` over the slots that have rows: each multiplies
             the rows by its A and B and keeps its own (the segmented form reading only the
             used adapters)

Each at --batches rows, with the rows spread over --adapters adapters (round robin) and with all
rows on one adapter. Prints a table (ms per step, the median of --repeats runs of --steps
steps; XLA's bytes accessed per step), then one JSON line.

  python scripts/experiments/cpu_lora_forms.py --batches=8,32 --slots=8 --rank=16

Results: docs/benchmarks.md, "LoRA adapters".
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("batches", ["8", "32"], "Rows B per step.")
flags.DEFINE_integer("layers", 30, "Layers.")
flags.DEFINE_integer("slots", 8, "Adapter slots S in the pool.")
flags.DEFINE_integer("rank", 16, "LoRA rank r (every slot).")
flags.DEFINE_integer("adapters", 8, "Distinct adapters the rows are spread over.")
flags.DEFINE_integer("steps", 10, "Steps per timed run.")
flags.DEFINE_integer("repeats", 5, "Timed runs per variant (median reported).")
flags.DEFINE_integer("tile_rows", 4, "Rows per step of the tiles form.")
flags.DEFINE_list("forms", ["base", "onehot", "onehot2d", "gather", "ragged", "loop", "tiles"],
                  "Forms to run.")

D, Q, KV, F = 576, 576, 192, 1536  # SmolLM2-135M
# input group -> (input width, [(projection, output width)])
GROUPS = {"attn_in": (D, [("q", Q), ("k", KV), ("v", KV)]), "o": (Q, [("o", D)]),
          "mlp_in": (D, [("gate", F), ("up", F)]), "down": (F, [("down", D)])}


def make_params(num_layers: int, s: int, r: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(0.02 * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    layers = []
    for _ in range(num_layers):
        p = {"qkv": f(D, Q + 2 * KV), "o": f(Q, D), "gate_up": f(D, 2 * F), "down": f(F, D)}
        lora = {}
        for g, (din, outs) in GROUPS.items():
            lora[g + ".a"] = f(s, din, len(outs), r)
            for name, dout in outs:
                lora[name + ".b"] = f(s, r, dout)
        layers.append((p, lora))
    return layers


def delta_onehot(x, lora, group, ids, s):
    _, outs = GROUPS[group]
    onehot = jax.nn.one_hot(ids, s, dtype=x.dtype)  # -1: all zeros
    u = jnp.einsum("nd,sdpr->nspr", x, lora[group + ".a"]) * onehot[:, :, None, None]
    return [jnp.einsum("nsr,sro->no", u[:, :, i], lora[name + ".b"])
            for i, (name, _) in enumerate(outs)]


def delta_gather(x, lora, group, ids, s):
    _, outs = GROUPS[group]
    safe = jnp.maximum(ids, 0)
    on = (ids >= 0).astype(x.dtype)[:, None]
    u = jnp.einsum("nd,ndpr->npr", x, lora[group + ".a"][safe])
    return [on * jnp.einsum("nr,nro->no", u[:, i], lora[name + ".b"][safe])
            for i, (name, _) in enumerate(outs)]


def _sorted(ids, s):
    key = jnp.where(ids < 0, s, ids)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=s + 1)[:s].astype(jnp.int32)
    return order, sizes


def delta_ragged(x, lora, group, ids, s):
    _, outs = GROUPS[group]
    order, sizes = _sorted(ids, s)
    a = lora[group + ".a"]
    u = jax.lax.ragged_dot(x[order], a.reshape(s, a.shape[1], -1), sizes)  # [N, P r]
    u = u.reshape(x.shape[0], len(outs), -1)
    inverse = jnp.argsort(order)
    return [jax.lax.ragged_dot(u[:, i], lora[name + ".b"], sizes)[inverse]
            for i, (name, _) in enumerate(outs)]


def delta_loop(x, lora, group, ids, s):
    _, outs = GROUPS[group]
    key = jnp.where(ids < 0, s, ids)
    present = jnp.zeros((s + 1,), bool).at[key].set(True)[:s]
    used = jnp.nonzero(present, size=s, fill_value=0)[0]
    count = present.sum()
    a = lora[group + ".a"]
    init = [jnp.zeros((x.shape[0], lora[name + ".b"].shape[-1]), x.dtype) for name, _ in outs]

    def body(j, acc):
        slot = used[j]
        mine = (key == slot)[:, None]
        u = jnp.einsum("nd,dpr->npr", x, jax.lax.dynamic_index_in_dim(a, slot, 0, False))
        return [acc_i + jnp.where(mine, u[:, i] @ jax.lax.dynamic_index_in_dim(
            lora[name + ".b"], slot, 0, False), 0) for i, ((name, _), acc_i)
            in enumerate(zip(outs, acc))]

    return jax.lax.fori_loop(0, count, body, init)


def delta_onehot2d(x, lora, group, ids, s):
    """onehot with the pool laid out for plain 2-D dots: A [P, D_in, S r], B [S r, D_out]."""
    _, outs = GROUPS[group]
    a2 = lora[group + ".a2"]  # [P, D_in, S r]
    r = a2.shape[-1] // s
    mask = jnp.repeat(jax.nn.one_hot(ids, s, dtype=x.dtype), r, axis=1)  # [N, S r]
    return [((x @ a2[i]) * mask) @ lora[name + ".b2"] for i, (name, _) in enumerate(outs)]


def prepare(layers):
    """Adds the 2-D layouts of onehot2d (made once, outside the step)."""
    out = []
    for p, lora in layers:
        lora = dict(lora)
        for g in GROUPS:
            a = lora[g + ".a"]
            lora[g + ".a2"] = jnp.transpose(a, (2, 1, 0, 3)).reshape(a.shape[2], a.shape[1], -1)
        for name in [n for _, outs in GROUPS.values() for n, _ in outs]:
            b = lora[name + ".b"]
            lora[name + ".b2"] = b.reshape(-1, b.shape[-1])
        out.append((p, lora))
    return out


def tile_plan(ids, s, tm):
    """Rows sorted by slot (-1 last), and the (slot, row tile) steps covering each used slot's
    rows: (order [N], slot [T], tile start [T], number of steps), T = N / tm + S static."""
    n = ids.shape[0]
    key = jnp.where(ids < 0, s, ids)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=s + 1)[:s]
    end = jnp.cumsum(sizes)
    start = end - sizes
    first, last = start // tm, (end + tm - 1) // tm
    steps = jnp.where(sizes > 0, last - first, 0)
    cum = jnp.cumsum(steps)
    total = cum[-1]
    t = -(-n // tm) + s
    idx = jnp.arange(t)
    slot = jnp.minimum(jnp.searchsorted(cum, idx, side="right"), s - 1)
    tile = first[slot] + idx - (cum[slot] - steps[slot])
    row0 = jnp.minimum(tile * tm, n - tm)
    return order, key[order], slot, row0, total


def delta_tiles(x, lora, group, ids, s, plan):
    """Rows sorted by slot, a fori_loop over (slot, row tile) steps: each multiplies tm rows by
    its slot's A and B and writes the rows of its slot (the segmented form)."""
    _, outs = GROUPS[group]
    order, keys, slot, row0, total = plan
    tm = FLAGS.tile_rows
    xs = x[order]
    a = lora[group + ".a"]
    init = [jnp.zeros((x.shape[0], lora[name + ".b"].shape[-1]), x.dtype) for name, _ in outs]

    def body(j, acc):
        g, r0 = slot[j], row0[j]
        xt = jax.lax.dynamic_slice_in_dim(xs, r0, tm)
        mine = (jax.lax.dynamic_slice_in_dim(keys, r0, tm) == g)[:, None]
        u = jnp.einsum("nd,dpr->npr", xt, jax.lax.dynamic_index_in_dim(a, g, 0, False))
        new = []
        for i, (name, _) in enumerate(outs):
            y = u[:, i] @ jax.lax.dynamic_index_in_dim(lora[name + ".b"], g, 0, False)
            old = jax.lax.dynamic_slice_in_dim(acc[i], r0, tm)
            new.append(jax.lax.dynamic_update_slice_in_dim(acc[i], jnp.where(mine, y, old),
                                                           r0, 0))
        return new

    out = jax.lax.fori_loop(0, total, body, init)
    inverse = jnp.argsort(order)
    return [o[inverse] for o in out]


FORMS = {"tiles": delta_tiles, "onehot2d": delta_onehot2d, "onehot": delta_onehot,
         "gather": delta_gather, "ragged": delta_ragged, "loop": delta_loop}


def step_fn(form: str, s: int):
    delta = FORMS.get(form)

    def layer(x, p, lora, ids, plan):
        def proj(v, w, group):
            out = v @ w
            if delta is None:
                return out
            extra = (plan,) if form == "tiles" else ()
            return out + jnp.concatenate(delta(v, lora, group, ids, s, *extra), axis=-1)

        qkv = proj(x, p["qkv"], "attn_in")
        x = x + proj(qkv[:, :Q], p["o"], "o")
        gu = proj(x, p["gate_up"], "mlp_in")
        return x + proj(jax.nn.silu(gu[:, :F]) * gu[:, F:], p["down"], "down")

    @jax.jit
    def step(x, layers, ids):
        plan = tile_plan(ids, s, FLAGS.tile_rows) if form == "tiles" else None
        for p, lora in layers:
            x = layer(x, p, lora, ids, plan)
        return x

    return step


def compiled_step(form: str, layers, b: int, ids: np.ndarray, s: int):
    """(run() -> ms per step, bytes accessed per step) of `form`."""
    step = step_fn(form, s)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((b, D)) * 0.1, jnp.float32)
    ids = jnp.asarray(ids, jnp.int32)
    cost = step.lower(x, layers, ids).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    jax.block_until_ready(step(x, layers, ids))

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(FLAGS.steps):
            y = step(x, layers, ids)
        jax.block_until_ready(y)
        return (time.perf_counter() - t0) / FLAGS.steps * 1e3

    return run, float(cost.get("bytes accessed", float("nan")))


def main(argv):
    del argv
    s, r = FLAGS.slots, FLAGS.rank
    layers = make_params(FLAGS.layers, s, r)
    layers = prepare(layers) if "onehot2d" in FLAGS.forms else layers
    rows = []
    for b in map(int, FLAGS.batches):
        spreads = {f"{FLAGS.adapters} adapters": np.arange(b) % FLAGS.adapters,
                   "1 adapter": np.zeros(b, np.int64), "no adapter": np.full(b, -1)}
        for spread, ids in spreads.items():
            # The forms run round robin, so a change of the machine's load hits them alike.
            forms = [f for f in FLAGS.forms if f != "base" or spread == "no adapter"]
            runs = {f: compiled_step(f, layers, b, ids, s) for f in forms}
            times = {f: [] for f in forms}
            for _ in range(FLAGS.repeats):
                for f in forms:
                    times[f].append(runs[f][0]())
            for f in forms:
                ms, nbytes = statistics.median(times[f]), runs[f][1]
                rows.append({"batch": b, "rows": spread, "form": f, "ms": round(ms, 3),
                             "mbytes": round(nbytes / 1e6, 2)})
                print(f"B={b:3d} {spread:12s} {f:8s} {ms:8.2f} ms  {nbytes / 1e6:8.1f} MB",
                      file=sys.stderr, flush=True)
    print("| B | rows | form | ms/step | MB accessed |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} | {row['rows']} | {row['form']} | {row['ms']} | "
              f"{row['mbytes']} |")
    print(json.dumps({"slots": s, "rank": r, "layers": FLAGS.layers, "rows": rows}))


if __name__ == "__main__":
    app.run(main)
