"""`jaxinfer-generate`: generate text from a checkpoint (default: embedded SmolLM2-135M-Instruct).

  jaxinfer-generate --prompt="What is the capital of France?" --chat --max_new_tokens=64
  jaxinfer-generate --prompts_file=prompts.txt --output_jsonl=out.jsonl --temperature=0.7

Prompts run on the serving engine (`jaxinfer.engine.engine`: continuous batching, chunked prefill,
prefix caching). One prompt streams to stdout; TTFT and decode tokens/s go to stderr. A prompts
file holds one prompt per line (or JSONL objects with a "prompt" key); a bad prompt fails alone
(its record carries the error) and the others run.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from absl import app, flags, logging

from jaxinfer.cli import flags as jflags

FLAGS = flags.FLAGS
flags.DEFINE_string("prompt", None, "One prompt (text).")
flags.DEFINE_string("prompts_file", None, "File of prompts: one per line, or JSONL {'prompt'}.")
flags.DEFINE_string("output_jsonl", None, "Write one JSON record per prompt here.")
flags.DEFINE_bool("chat", False, "Render prompts with the checkpoint's chat template.")
flags.DEFINE_string("system", None, "System message for --chat.")
flags.DEFINE_bool("warmup", True, "Compile the needed step variants before timing.")
jflags.define_compilation_cache_flag()
jflags.define_flags()


def _read_prompts(path: str) -> list[str]:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    line = json.loads(line)["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' key "
                                     f"({e})") from None
            prompts.append(line)
    return prompts


def main(argv: list[str]) -> int:
    """Bad input (a config value, a prompt, a checkpoint) ends with one clear line and exit 2."""
    try:
        return _generate(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxinfer-generate: error: {e}", file=sys.stderr)
        return 2


def _generate(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if (FLAGS.prompt is None) == (FLAGS.prompts_file is None):
        raise app.UsageError("give exactly one of --prompt or --prompts_file")
    import jax

    from jaxinfer.engine.llm import load_llm
    from jaxinfer.engine.prompts import encode_prompt

    jflags.use_compilation_cache()
    run = jflags.resolve_config()
    from jaxinfer.sharding import describe, maybe_initialize_distributed

    maybe_initialize_distributed(run.multihost)  # before any other jax call
    lead = jax.process_index() == 0  # only process 0 writes outputs
    prompts = [FLAGS.prompt] if FLAGS.prompt is not None else _read_prompts(FLAGS.prompts_file)
    if not prompts:
        raise app.UsageError(f"--prompts_file={FLAGS.prompts_file} holds no prompts")
    # The workload is known up front: never decode more rows than there are samples (rounded
    # up to a multiple of the data axis: each data shard serves an equal group of slots), and
    # make the static top-logprobs width as wide as the request asks.
    from jaxinfer.sharding import parse_mesh

    data = parse_mesh(run.mesh, jax.device_count())["data"] if run.mesh else 1
    slots = min(run.engine.max_slots, len(prompts) * run.sampling.n)
    engine = dataclasses.replace(
        run.engine, max_slots=-(-slots // data) * data,
        max_top_logprobs=max(run.engine.max_top_logprobs, run.sampling.top_logprobs))
    run = dataclasses.replace(run, engine=engine)
    logging.info("resolved config: %s", run.to_json())
    t0 = time.perf_counter()
    llm = load_llm(run)
    config = llm.engine.config
    mesh = llm.engine.mesh
    print(f"[jaxinfer] loaded {config.arch} ({config.num_params() / 1e6:.1f}M params, "
          f"{config.dtype}) in {time.perf_counter() - t0:.1f}s"
          + (f" on mesh {describe(mesh)}" if mesh is not None else ""), file=sys.stderr)
    if FLAGS.warmup:
        t0 = time.perf_counter()
        workload = []
        for p in prompts:
            try:
                workload.append((encode_prompt(llm.engine.tokenizer, config.vocab_size, p,
                                               chat=FLAGS.chat, system=FLAGS.system),
                                 run.sampling))
            except ValueError:
                continue  # reported per request by generate()
        workload = [(ids, sc) for ids, sc in workload
                    if len(ids) + sc.max_new_tokens <= llm.engine.cache_config.max_seq_len]
        n = llm.engine.warmup(workload=workload)
        print(f"[jaxinfer] compiled {n} step variants in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr)

    n = run.sampling.n
    stream = lead and len(prompts) == 1 and n == 1 and not FLAGS.output_jsonl

    def on_output(i, out):
        if stream:
            sys.stdout.write(out.text)
            sys.stdout.flush()

    start = time.perf_counter()
    results = llm.generate(prompts, run.sampling, chat=FLAGS.chat, system=FLAGS.system,
                           raise_on_error=len(prompts) == 1, on_output=on_output,
                           use_tqdm=not stream and sys.stderr.isatty())
    wall = time.perf_counter() - start
    if not lead:
        return 0
    if stream:
        sys.stdout.write("\n")
    elif not FLAGS.output_jsonl:
        for i, r in enumerate(results):
            if n > 1:
                print(f"--- prompt {i // n}, sample {i % n} (seed {run.sampling.seed + i % n})")
            print(r.text if r.error is None else f"[error] {r.error}")
    if FLAGS.output_jsonl:
        with open(FLAGS.output_jsonl, "w") as f:
            for i, r in enumerate(results):
                f.write(json.dumps({
                    "index": i // n, "sample": i % n, "seed": run.sampling.seed + i % n,
                    "prompt": prompts[i // n], "text": r.text, "token_ids": r.token_ids,
                    "num_prompt_tokens": len(r.prompt_ids), "finish_reason": r.finish_reason,
                    "logprobs": r.logprobs, "top_logprobs": r.top_logprobs, "error": r.error,
                    "metrics": r.metrics.as_dict()}) + "\n")
    _report(results, wall)
    return 1 if any(r.error for r in results) and len(prompts) == 1 else 0


def _report(results, wall: float) -> None:
    ok = [r for r in results if r.error is None and r.token_ids]
    if not ok:
        return
    ttfts = sorted(r.metrics.ttft for r in ok)
    decode_tokens = sum(len(r.token_ids) - 1 for r in ok)
    first = min(r.metrics.token_times[0] for r in ok)
    last = max(r.metrics.token_times[-1] for r in ok)
    rate = decode_tokens / (last - first) if last > first else float("nan")
    print(f"[jaxinfer] {len(ok)} request(s): TTFT {ttfts[len(ttfts) // 2] * 1e3:.1f} ms (median), "
          f"decode {rate:.1f} tok/s, {sum(len(r.token_ids) for r in ok)} tokens in {wall:.2f}s",
          file=sys.stderr)
    drafted = sum(r.metrics.spec_drafted for r in ok)
    if drafted:
        accepted = sum(r.metrics.spec_accepted for r in ok)
        print(f"[jaxinfer] speculation: {accepted}/{drafted} draft tokens accepted "
              f"({accepted / drafted:.1%})", file=sys.stderr)
    errors = [r for r in results if r.error]
    if errors:
        print(f"[jaxinfer] {len(errors)} request(s) failed: first error: {errors[0].error}",
              file=sys.stderr)


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
