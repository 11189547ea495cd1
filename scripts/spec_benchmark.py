"""Speculative decoding benchmark: decode tokens/s with and without speculation, per drafter and R.

Two workloads on the default model (SmolLM2-135M-Instruct, f32 on CPU), chat-templated, greedy:

* copy — the answer copies from the prompt: repeat / fix the spelling of / reformat / refactor a
         given passage or function (the prompt-lookup drafter's home ground);
* chat — open-ended questions (stories, explanations, advice): little to copy.

For each batch size (1 and 8 by default: the workload's 8 prompts one at a time, or all together,
on an engine with b slots) the engine runs without speculation, then with each drafter (n-gram
prompt lookup, self-speculative first-k layers, a draft model with --draft_model_path, an EAGLE /
EAGLE-3 draft head with --draft_head_path) for each R in --num_spec (eagle chains: for each
--draft_confidence, shown as R>c), and with each draft tree
of --spec_tree (repeatable: a tree spelling per flag) for each drafter in --methods that drafts
trees (`jaxinfer.config.TREE_METHODS`). Every output is
checked against the run without speculation (greedy: identical token for token). Each engine is
warmed up on the exact workload first (persistent XLA cache in ~/.cache/jaxinfer/xla), so no
compile lands in a measurement.

Reported per run: acceptance rate (accepted / drafted tokens), the mean accepted length (tokens
per verification row: accepted drafts + 1), decode tokens/s = (tokens - one per request) / (last
token time - first token time, summed over the groups of b prompts), and the speedup over the
run without speculation at the same batch size.

  python scripts/spec_benchmark.py                                 # about 15 min on this CPU
  python scripts/spec_benchmark.py --workloads=copy --batch_sizes=1 --methods=ngram --num_spec=3
  python scripts/spec_benchmark.py --methods=eagle,ngram --num_spec=4 \
      --draft_head_path=/tmp/smollm2-eagle3 --spec_tree=3,2,1        # trees: n-gram and eagle

Output: one table, and one JSON line per run (prefixed "RESULT ") on stdout.
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags
from spec_workloads import WORKLOADS  # scripts/ is on sys.path

from jaxinfer.checkpoint.eagle import load_draft_head
from jaxinfer.checkpoint.loading import load_model, load_tokenizer
from jaxinfer.checkpoint.weights import load_checkpoint
from jaxinfer.cli import flags as jflags
from jaxinfer.config import TREE_METHODS, CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.llm import LLM

FLAGS = flags.FLAGS
flags.DEFINE_list("workloads", ["copy", "chat"], "Workloads: copy, chat.")
flags.DEFINE_list("batch_sizes", ["1", "8"], "Requests decoded together.")
flags.DEFINE_list("methods", ["ngram", "self"], "Drafters: ngram, self, draft, eagle.")
flags.DEFINE_list("num_spec", ["1", "3", "5"], "R values (drafts per step).")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per request (greedy; EOS ends).")
flags.DEFINE_integer("ngram_max", EngineConfig.ngram_max, "n-gram drafter: longest match.")
flags.DEFINE_integer("ngram_min", EngineConfig.ngram_min, "n-gram drafter: shortest match.")
flags.DEFINE_integer("self_spec_layers", 8, "Self-speculative drafter depth (of 30 layers).")
flags.DEFINE_string("draft_model_path", None, "Draft model checkpoint for --methods=draft.")
flags.DEFINE_string("draft_head_path", None, "EAGLE / EAGLE-3 head directory for "
                    "--methods=eagle (scripts/train_draft_head.py exports one).")
flags.DEFINE_multi_string("spec_tree", [], "Draft trees (EngineConfig.spec_tree spellings, e.g. "
                          "3,2,1), one per flag: each runs with every --methods drafter that "
                          "drafts trees.")
flags.DEFINE_list("draft_confidence", ["0"], "EngineConfig.draft_confidence values: each eagle "
                  "chain run repeats with each (0: chains of R drafts).")
flags.DEFINE_string("model_path", None, "Target checkpoint (default: embedded SmolLM2).")
jflags.define_compilation_cache_flag()


def _decode_span(results) -> tuple[int, float]:
    """(decoded tokens: all but each request's first, seconds from first to last token)."""
    first = min(r.metrics.token_times[0] for r in results)
    last = max(r.metrics.token_times[-1] for r in results)
    return sum(len(r.token_ids) - 1 for r in results), last - first


def _run(llm: LLM, prompts: list[str], sampling: SamplingConfig, batch: int):
    """Runs the prompts `batch` at a time; decode tokens/s = decoded tokens over the summed
    decode spans of the groups."""
    eng = llm.engine
    before = {k: eng.stats().get(k, 0) for k in ("spec_drafted_tokens", "spec_accepted_tokens",
                                                 "spec_verify_rows")}
    t0 = time.perf_counter()
    results, decoded, span = [], 0, 0.0
    for i in range(0, len(prompts), batch):
        group = llm.generate(prompts[i:i + batch], sampling, chat=True, use_tqdm=False)
        results += group
        n, seconds = _decode_span(group)
        decoded += n
        span += seconds
    wall = time.perf_counter() - t0
    after = eng.stats()
    delta = {k: after.get(k, 0) - v for k, v in before.items()}
    rate = decoded / span if span > 0 else float("nan")
    return results, rate, sum(len(r.token_ids) for r in results), wall, delta


def _drafters(model):
    """(draft model or None, draft head or None) the --methods need."""
    draft = head = None
    if "draft" in FLAGS.methods:
        if not FLAGS.draft_model_path:
            raise app.UsageError("--methods=draft needs --draft_model_path")
        draft, _ = load_model(RunConfig(model_path=FLAGS.draft_model_path, dtype="float32"),
                              load_checkpoint(FLAGS.draft_model_path))
    if "eagle" in FLAGS.methods:
        if not FLAGS.draft_head_path:
            raise app.UsageError("--methods=eagle needs --draft_head_path")
        head = load_draft_head(FLAGS.draft_head_path, model.config)
    return draft, head


def _configs() -> list[tuple[str, int, str | None, float]]:
    """(method, R, tree spelling or None, draft confidence) of every run, the one without
    speculation first."""
    trees = [(m, 0, t, 0.0) for t in FLAGS.spec_tree for m in FLAGS.methods
             if m in TREE_METHODS]
    if FLAGS.spec_tree and not trees:
        raise app.UsageError(f"--spec_tree needs a drafter that drafts trees in --methods "
                             f"(one of {TREE_METHODS}); got --methods={','.join(FLAGS.methods)}")
    cuts = [float(c) for c in FLAGS.draft_confidence]
    chains = [(m, int(r), None, c) for m in FLAGS.methods for r in FLAGS.num_spec
              for c in (cuts if m == "eagle" else [0.0])]
    return [("none", 0, None, 0.0)] + chains + trees


def _print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':8} {'batch':>5} {'method':6} {'R/tree':>7} {'accept':>7} "
          f"{'tok/row':>7} {'decode tok/s':>12} {'speedup':>7} identical")
    for x in rows:
        acc = f"{x['acceptance']:.1%}" if x["acceptance"] is not None else "-"
        shape = x["tree"] or str(x["R"]) + (f">{x['confidence']:g}" if x["confidence"] else "")
        print(f"{x['workload']:8} {x['batch']:5d} {x['method']:6} {shape:>7} {acc:>7} "
              f"{x['tokens_per_row']:7.2f} {x['decode_tok_s']:12.1f} {x['speedup']:6.2f}x "
              f"{'yes' if x['identical'] else 'NO'}")


def main(argv):
    del argv
    jflags.use_compilation_cache(0.5)
    run = RunConfig(model_path=FLAGS.model_path, dtype="float32")
    model, ckpt = load_model(run)
    tok = load_tokenizer(ckpt)
    configs = _configs()
    draft, head = _drafters(model)
    sampling = SamplingConfig(max_new_tokens=FLAGS.max_new_tokens)
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    cache = CacheConfig(page_size=16, max_seq_len=512)
    rows, baseline = [], {}
    for b in batch_sizes:  # an engine per batch size: idle slots would compute too
        for method, r, tree, cut in configs:
            engine = EngineConfig(max_slots=b, prefill_buckets=(64, 256),
                                  max_num_batched_tokens=512, speculative_method=method,
                                  num_speculative_tokens=max(r, 1), spec_tree=tree,
                                  draft_confidence=cut,
                                  self_spec_layers=FLAGS.self_spec_layers,
                                  ngram_max=FLAGS.ngram_max, ngram_min=FLAGS.ngram_min)
            llm = LLM(model, tok, cache=cache, engine=engine,
                      draft_model=draft if method == "draft" else None,
                      draft_head=head if method == "eagle" else None)
            t0 = time.perf_counter()
            # One untimed pass over the prompts compiles what the timed run uses.
            for name in FLAGS.workloads:
                _run(llm, WORKLOADS[name], sampling, b)
            print(f"[batch {b} {method} {tree or f'R={r}'} cut {cut:g}] warm-up "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
            for name in FLAGS.workloads:
                results, rate, tokens, wall, d = _run(llm, WORKLOADS[name], sampling, b)
                key = (name, b)
                ids = [x.token_ids for x in results]
                if method == "none":
                    baseline[key] = (rate, ids)
                base_rate, base_ids = baseline[key]
                row = {
                    "workload": name, "batch": b, "method": method, "R": r, "tree": tree,
                    "confidence": cut,
                    "acceptance": (d["spec_accepted_tokens"] / d["spec_drafted_tokens"]
                                   if d["spec_drafted_tokens"] else None),
                    "tokens_per_row": ((d["spec_accepted_tokens"] + d["spec_verify_rows"])
                                       / d["spec_verify_rows"] if d["spec_verify_rows"]
                                       else 1.0),
                    "decode_tok_s": rate, "speedup": rate / base_rate,
                    "identical": ids == base_ids, "tokens": tokens, "wall_s": wall,
                }
                rows.append(row)
                print("RESULT " + json.dumps(row), flush=True)
            del llm
    _print_table(rows)


if __name__ == "__main__":
    app.run(main)
