"""Distil a small draft model from the target with optax; measure acceptance before and after.

  taskset -c 1 python scripts/experiments/distill_draft.py        # defaults: ~18 min on one core
  taskset -c 1 python scripts/experiments/distill_draft.py --num_prompts=16 --steps=10 \\
      --eval_prompts=2                                               # smoke

1. The draft starts as the target's first `--draft_layers` layers + final norm + embedding/head
   (canonical params of the default model; `jaxinfer.checkpoint.weights`).
2. The target writes the training text on the engine: sampled chat answers to a built-in list of
   instructions (stories, explanations, lists, code).
3. The draft learns from the target's distribution at every answer position: `--loss=kl` is
   KL(target || draft) over the full vocabulary, `--loss=ce` cross-entropy on the target's greedy
   token. Both run a plain full-sequence forward (`forward_hidden`: causal attention without the
   paged cache, the same math as `jaxinfer.model.llama`), checked against the engine's model logits.
   The target's final hidden states are computed once; its logits are re-projected per step.
4. The trained draft is written as a Hugging Face directory (`--out`), loadable with
   `--draft_model_path`.
5. Acceptance (greedy, batch 1, `speculative_method="draft"`) of the untrained and the trained
   draft on held-out instructions, and decode tokens/s with and without speculation. Prints a
   table, then one JSON line.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxinfer.cli import flags as jflags
from jaxinfer.config import ModelConfig
from jaxinfer.model.llama import rms_norm
from jaxinfer.model.rope import apply_rope, rope_inv_freq

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags; defined when it runs (not on import: the tests import its
    functions beside other modules' flags)."""
    flags.DEFINE_integer("draft_layers", 4, "Layers of the draft (the target's first ones).")
    flags.DEFINE_integer("num_prompts", 128, "Training instructions the target answers.")
    flags.DEFINE_integer("gen_tokens", 96, "Tokens the target writes per training instruction.")
    flags.DEFINE_float("temperature", 0.8, "Sampling temperature of the training text.")
    flags.DEFINE_integer("max_slots", 32, "Engine slots while generating the training text.")
    flags.DEFINE_integer("seq_len", 256, "Training sequences (prompt + answer) are cut to this.")
    flags.DEFINE_enum("loss", "kl", ["kl", "ce"], "KL(target || draft) or CE on target greedy ids.")
    flags.DEFINE_integer("steps", 200, "Optimizer steps.")
    flags.DEFINE_integer("batch_size", 4, "Sequences per step.")
    flags.DEFINE_float("lr", 5e-4, "Peak learning rate (warmup, then cosine decay to 10%).")
    flags.DEFINE_integer("warmup_steps", 20, "Linear warmup steps.")
    flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
    flags.DEFINE_bool("freeze_embed", True, "Keep the embedding / tied head frozen (faster).")
    flags.DEFINE_integer("eval_prompts", 8, "Held-out instructions for the acceptance measurement.")
    flags.DEFINE_integer("eval_tokens", 64, "Greedy tokens per held-out instruction.")
    flags.DEFINE_integer("num_speculative_tokens", 3, "R: drafts per verification.")
    flags.DEFINE_integer("seed", 0, "Seed of the data order and the sampled text.")
    flags.DEFINE_string("out", "/tmp/distilled_draft", "Output HF directory of the trained draft.")
    jflags.define_compilation_cache_flag()


# ----- built-in instructions: training and held-out use disjoint subjects ------------------------
TEMPLATES = [
    "Write a short story about {}.", "Explain {} to a ten-year-old.",
    "List five interesting facts about {}.", "Write a poem about {}.",
    "What are the pros and cons of {}?", "Give me three tips related to {}.",
    "Describe {} in one paragraph.", "Write a short dialogue between two friends about {}.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "counts the vowels in a string", "returns the largest element of a list",
    "merges two sorted lists", "computes Fibonacci numbers", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "checks whether a word is a palindrome",
    "sums the digits of an integer", "finds the second smallest number in a list",
]
TRAIN_SUBJECTS = [
    "the ocean", "a lost robot", "volcanoes", "photosynthesis", "the moon", "a friendly dragon",
    "coffee", "electric cars", "the Roman Empire", "honey bees", "learning a new language",
    "rainbows", "a haunted lighthouse", "the internet", "winter", "dinosaurs", "gardening",
    "black holes", "a small bakery", "music", "recycling", "a time traveler", "the desert",
    "chess", "friendship", "mountains", "a rainy day", "computers",
]
EVAL_SUBJECTS = ["penguins", "a city at night", "glaciers", "the printing press",
                 "a jazz musician", "earthquakes", "tea", "solar panels"]
EVAL_CODE = ["sorts a list of tuples by their second item", "counts words in a sentence"]


def instructions(subjects: list[str], code: list[str], n: int, seed: int) -> list[str]:
    """n distinct instructions: every (template, subject) pair and every code task, shuffled."""
    pool = [t.format(s) for t, s in itertools.product(TEMPLATES, subjects)]
    pool += [f"Write a Python function that {task}." for task in code]
    rng = np.random.default_rng(seed)
    return [pool[i] for i in rng.permutation(len(pool))[:n]]


# ----- the training forward: plain jnp over canonical params -------------------------------------
def forward_hidden(config: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """Final-normed hidden states f32[B, T, D] of tokens i32[B, T] at positions 0..T-1: causal
    attention without a cache, otherwise `jaxinfer.model.llama.Llama`'s math (f32 RMSNorm, HF
    rotate-half RoPE, GQA with query head k * G + g on kv head k, SwiGLU). Padding at the end of a
    row does not change the earlier positions."""
    c = config
    b, t = tokens.shape
    g = c.q_per_kv
    inv_freq = rope_inv_freq(c.rope, c.head_dim)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    query, key = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    visible = key <= query
    if c.sliding_window is not None:
        visible &= key > query - c.sliding_window
    x = params["embed"][tokens].astype(jnp.float32)
    for i in range(c.num_layers):
        p = functools.partial(lambda i, name: params[f"layers.{i}.{name}"], i)
        h = rms_norm(x, p("attn_norm"), c.rms_norm_eps)
        q = jnp.einsum("BTD,DNH->BTNH", h, p("q"))
        k = jnp.einsum("BTD,DKH->BTKH", h, p("k"))
        v = jnp.einsum("BTD,DKH->BTKH", h, p("v"))
        if c.qkv_bias:
            q, k, v = q + p("q_bias"), k + p("k_bias"), v + p("v_bias")
        q = apply_rope(q, positions, inv_freq).reshape(b, t, c.num_kv_heads, g, c.head_dim)
        k = apply_rope(k, positions, inv_freq)
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k) / math.sqrt(c.head_dim)
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(b, t, c.num_q_heads, c.head_dim)
        x = x + jnp.einsum("BTNH,NHD->BTD", attn, p("o"))
        h = rms_norm(x, p("mlp_norm"), c.rms_norm_eps)
        act = jax.nn.silu(h @ p("gate")) * (h @ p("up"))
        x = x + act @ p("down")
    return rms_norm(x, params["final_norm"], c.rms_norm_eps)


def head_weight(config: ModelConfig, params: dict) -> jax.Array:
    """The output projection as [V, D]: the tied embedding, or lm_head [D, V] transposed."""
    return params["embed"] if config.tie_embeddings else params["lm_head"].T


def forward_logits(config: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """Logits f32[B, T, V] of every position (the training forward + head)."""
    hidden = forward_hidden(config, params, tokens)
    return jnp.einsum("BTD,VD->BTV", hidden, head_weight(config, params))


@functools.partial(jax.jit, static_argnames=("config",))
def target_hidden_step(config: ModelConfig, params: dict, tokens: jax.Array,
                       loss_idx: jax.Array) -> jax.Array:
    """Target hidden states f32[B, M, D] at the loss positions loss_idx i32[B, M]."""
    hidden = forward_hidden(config, params, tokens)
    return jnp.take_along_axis(hidden, loss_idx[:, :, None], axis=1)


def distill_loss(trainable: dict, frozen: dict, config: ModelConfig, kind: str,
                 tokens: jax.Array, loss_idx: jax.Array, mask: jax.Array,
                 target_hidden: jax.Array, target_head: jax.Array):
    """Mean loss over the masked positions, and the share of them where the draft's argmax is the
    target's (greedy acceptance of one draft token, teacher-forced).

    Args:
      tokens: i32[B, T]; loss_idx: i32[B, M] positions scored; mask: bool[B, M];
      target_hidden: f32[B, M, D] the target's final-normed states there; target_head: f32[V, D].
    """
    params = {**frozen, **trainable}
    hidden = forward_hidden(config, params, tokens)
    hidden = jnp.take_along_axis(hidden, loss_idx[:, :, None], axis=1)
    draft_logp = jax.nn.log_softmax(
        jnp.einsum("BMD,VD->BMV", hidden, head_weight(config, params)), axis=-1)
    target_logits = jnp.einsum("BMD,VD->BMV", target_hidden, target_head)
    greedy = jnp.argmax(target_logits, axis=-1)
    if kind == "kl":
        target_logp = jax.nn.log_softmax(target_logits, axis=-1)
        per_pos = jnp.sum(jnp.exp(target_logp) * (target_logp - draft_logp), axis=-1)
    else:
        per_pos = -jnp.take_along_axis(draft_logp, greedy[..., None], axis=-1)[..., 0]
    weight = mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(weight), 1.0)
    agree = jnp.sum((jnp.argmax(draft_logp, axis=-1) == greedy) * weight) / count
    return jnp.sum(per_pos * weight) / count, agree


def make_optimizer(steps: int, lr: float, warmup: int, weight_decay: float):
    """AdamW, linear warmup then cosine decay to 10% of the peak, global-norm clipping at 1."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1),
                                                  end_value=0.1 * lr)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=weight_decay))


@functools.partial(jax.jit, static_argnames=("config", "kind", "optimizer"),
                   donate_argnames=("trainable", "opt_state"))
def train_step(trainable, opt_state, frozen, batch, *, config, kind, optimizer):
    """One optax step on `trainable`; batch = (tokens, loss_idx, mask, target_hidden,
    target_head). Returns (trainable, opt_state, loss, agreement)."""
    import optax

    (loss, agree), grads = jax.value_and_grad(distill_loss, has_aux=True)(
        trainable, frozen, config, kind, *batch)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, loss, agree


# ----- data ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Data:
    """Training sequences, padded: tokens i32[N, T]; the scored positions loss_idx i32[N, M]
    (from the last prompt token on, so the first answer token is predicted), mask bool[N, M]."""

    tokens: np.ndarray
    loss_idx: np.ndarray
    mask: np.ndarray


def build_data(sequences: list[tuple[list[int], list[int]]], seq_len: int) -> Data:
    """(prompt ids, answer ids) pairs -> padded arrays (T, M rounded up to multiples of 16)."""
    rows = [(p + a)[:seq_len] for p, a in sequences]
    t = -(-max(len(r) for r in rows) // 16) * 16
    m = -(-max(len(r) - len(p) + 1 for r, (p, _) in zip(rows, sequences)) // 16) * 16
    tokens = np.zeros((len(rows), t), np.int32)
    loss_idx = np.zeros((len(rows), m), np.int32)
    mask = np.zeros((len(rows), m), bool)
    for i, (row, (prompt, _)) in enumerate(zip(rows, sequences)):
        tokens[i, :len(row)] = row
        start = len(prompt) - 1
        n = len(row) - start
        loss_idx[i] = np.minimum(start + np.arange(m), t - 1)
        mask[i, :n] = True
    return Data(tokens, loss_idx, mask)


def generate_text(model, tokenizer, prompts: list[str]) -> list[tuple[list[int], list[int]]]:
    from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
    from jaxinfer.engine.llm import LLM

    llm = LLM(model, tokenizer, cache=CacheConfig(max_seq_len=FLAGS.seq_len + 16),
              engine=EngineConfig(max_slots=FLAGS.max_slots, max_num_batched_tokens=256))
    sampling = [SamplingConfig(temperature=FLAGS.temperature, max_new_tokens=FLAGS.gen_tokens,
                               seed=FLAGS.seed * 100_000 + i) for i in range(len(prompts))]
    outs = llm.generate(prompts, sampling, chat=True, use_tqdm=sys.stderr.isatty())
    return [(o.prompt_ids, o.token_ids) for o in outs]


def target_states(config, target_params, data: Data, batch: int = 4) -> np.ndarray:
    """The target's hidden states f32[N, M, D] at every scored position."""
    out = []
    for i in range(0, len(data.tokens), batch):
        sl = slice(i, i + batch)
        out.append(np.asarray(target_hidden_step(config, target_params, data.tokens[sl],
                                                 data.loss_idx[sl])))
    return np.concatenate(out)


def train(config, draft_params, data: Data, hidden: np.ndarray, head: jax.Array):
    """Runs the optax loop; returns (trained canonical params (numpy), loss curve rows)."""
    trainable = {k: jnp.asarray(v) for k, v in draft_params.items()
                 if not (FLAGS.freeze_embed and k == "embed")}
    frozen = {k: jnp.asarray(v) for k, v in draft_params.items() if k not in trainable}
    optimizer = make_optimizer(FLAGS.steps, FLAGS.lr, FLAGS.warmup_steps, FLAGS.weight_decay)
    opt_state = optimizer.init(trainable)
    rng = np.random.default_rng(FLAGS.seed)
    order, curve, window, t0 = np.array([], int), [], [], time.perf_counter()
    for step in range(1, FLAGS.steps + 1):
        if len(order) < FLAGS.batch_size:
            order = np.concatenate([order, rng.permutation(len(data.tokens))])
        idx, order = order[:FLAGS.batch_size], order[FLAGS.batch_size:]
        batch = (data.tokens[idx], data.loss_idx[idx], data.mask[idx], hidden[idx], head)
        trainable, opt_state, loss, agree = train_step(
            trainable, opt_state, frozen, batch, config=config, kind=FLAGS.loss,
            optimizer=optimizer)
        window.append((float(loss), float(agree)))
        if step == 1 or step % 25 == 0 or step == FLAGS.steps:
            loss_m, agree_m = np.mean(window, axis=0)
            curve.append({"step": step, "loss": round(float(loss_m), 4),
                          "agreement": round(float(agree_m), 4),
                          "elapsed_s": round(time.perf_counter() - t0, 1)})
            print(f"step {step:4d}  {FLAGS.loss} {loss_m:.4f}  top-1 agreement {agree_m:.3f}  "
                  f"({curve[-1]['elapsed_s']} s)", flush=True)
            window = []
    return {**{k: np.asarray(v) for k, v in frozen.items()},
            **{k: np.asarray(v) for k, v in trainable.items()}}, curve


# ----- acceptance and speed on the engine ---------------------------------------------------------
def measure(model, tokenizer, prompts: list[str], draft=None) -> dict:
    """Greedy, batch 1 (one slot): decode tok/s (after the first token, compile excluded) and,
    with a draft model, acceptance."""
    from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.prompts import encode_prompt

    method = "none" if draft is None else "draft"
    llm = LLM(model, tokenizer, cache=CacheConfig(max_seq_len=256),
              engine=EngineConfig(max_slots=1, speculative_method=method,
                                  num_speculative_tokens=FLAGS.num_speculative_tokens),
              draft_model=draft)
    sampling = SamplingConfig(max_new_tokens=FLAGS.eval_tokens)
    llm.engine.warmup(workload=[(encode_prompt(tokenizer, model.config.vocab_size, p, chat=True),
                                 sampling) for p in prompts])
    outs = llm.generate(prompts, sampling, chat=True, use_tqdm=False)
    tokens = sum(len(o.metrics.token_times) - 1 for o in outs)
    seconds = sum(o.metrics.token_times[-1] - o.metrics.token_times[0] for o in outs)
    stats = llm.engine.stats()
    return {"decode_tok_s": tokens / seconds, "acceptance_rate": stats.get("acceptance_rate"),
            "mean_accepted_length": stats.get("mean_accepted_length"),
            "token_ids": [o.token_ids for o in outs]}


def check_forward(model, config, params, ids: list[int]) -> float:
    """Relative error of the training forward's logits against the engine model's forward (the
    prompt as one chunk through the paged pool, logits of every position)."""
    from flax import nnx

    from jaxinfer.config import CacheConfig
    from jaxinfer.engine.kv_cache import create_cache, pages_bucket
    from jaxinfer.model import CHUNK, StepBatch

    cache = create_cache(config, CacheConfig(page_size=16, max_seq_len=64), 1)
    graphdef, state = nnx.split(model)
    t = len(ids)

    @jax.jit
    def engine_logits(state, k_pages, v_pages):
        batch = StepBatch.per_slot(
            jnp.asarray([ids], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None],
            jnp.ones((1, t), bool), cache.page_table, jnp.array([t], jnp.int32),
            num_pages_read=pages_bucket(t, 16, cache.pages_per_seq), kind=CHUNK)
        logits, _, _ = nnx.merge(graphdef, state)(batch, k_pages, v_pages)
        return logits  # [T, V]: every position (logits_index is None)

    want = engine_logits(state, cache.k_pages, cache.v_pages)
    got = forward_logits(config, params, jnp.asarray([ids]))[0]
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def main(argv: list[str]) -> None:
    del argv
    jflags.use_compilation_cache()
    from jaxinfer.checkpoint.loading import load_model, load_tokenizer
    from jaxinfer.checkpoint.weights import Checkpoint, load_checkpoint, save_hf
    from jaxinfer.config import RunConfig
    from jaxinfer.model import Llama

    t_start = time.perf_counter()
    target, ckpt = load_model(RunConfig(dtype="float32"))
    config, tokenizer = target.config, load_tokenizer(ckpt)
    k = FLAGS.draft_layers
    draft_config = dataclasses.replace(config, num_layers=k)
    draft_params = {n: v for n, v in ckpt.params.items()
                    if not n.startswith("layers.") or int(n.split(".")[1]) < k}
    target_params = {n: jnp.asarray(v) for n, v in ckpt.params.items()}
    err = check_forward(target, config, target_params, tokenizer.encode("The capital of France"))
    print(f"training forward vs engine logits: rel err {err:.2e}", flush=True)

    train_prompts = instructions(TRAIN_SUBJECTS, CODE_TASKS, FLAGS.num_prompts, FLAGS.seed)
    eval_prompts = instructions(EVAL_SUBJECTS, EVAL_CODE, FLAGS.eval_prompts, FLAGS.seed + 1)
    assert not set(train_prompts) & set(eval_prompts)
    t0 = time.perf_counter()
    data = build_data(generate_text(target, tokenizer, train_prompts), FLAGS.seq_len)
    gen_s = time.perf_counter() - t0
    num_scored = int(data.mask.sum())
    print(f"training text: {len(train_prompts)} sequences, {num_scored} scored positions, "
          f"T={data.tokens.shape[1]}, {gen_s:.0f} s", flush=True)
    t0 = time.perf_counter()
    hidden = target_states(config, target_params, data)
    head = head_weight(config, target_params)
    del target_params
    target_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trained, curve = train(draft_config, draft_params, data, hidden, head)
    train_s = time.perf_counter() - t0
    save_hf(Checkpoint(config=draft_config, params=trained, path="", format=ckpt.format,
                       metadata=ckpt.metadata), FLAGS.out)

    draft_before = Llama(draft_config, draft_params)
    draft_after, _ = load_model(RunConfig(dtype="float32"), load_checkpoint(FLAGS.out))
    plain = measure(target, tokenizer, eval_prompts)
    before = measure(target, tokenizer, eval_prompts, draft_before)
    after = measure(target, tokenizer, eval_prompts, draft_after)
    for res in (before, after):  # greedy speculation is lossless
        assert res["token_ids"] == plain["token_ids"], "speculative output differs from plain"
    rows = [("no speculation", plain), ("untrained draft", before), ("distilled draft", after)]
    print(f"\n| R={FLAGS.num_speculative_tokens}, greedy, batch 1 | acceptance | mean accepted "
          "length | decode tok/s | speedup |\n|---|---|---|---|---|")
    for name, r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"| {name} | {acc} | {mal} | {r['decode_tok_s']:.1f} | "
              f"{r['decode_tok_s'] / plain['decode_tok_s']:.2f}x |")
    summary = {
        "draft_layers": k, "loss": FLAGS.loss, "steps": FLAGS.steps,
        "num_prompts": len(train_prompts), "scored_positions": num_scored,
        "forward_rel_err": err, "generate_s": round(gen_s, 1),
        "target_states_s": round(target_s, 1),
        "train_s": round(train_s, 1), "curve": curve, "out": FLAGS.out,
        "total_s": round(time.perf_counter() - t_start, 1),
        **{f"{name}_{key}": r[key] for name, r in (("plain", plain), ("before", before),
                                                   ("after", after))
           for key in ("decode_tok_s", "acceptance_rate", "mean_accepted_length")},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    define_flags()
    app.run(main)
