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
flags.DEFINE_bool("warmup", True, "Compile the needed step variants before timing.")
jflags.define_run_flags(chat_default=False, system_help="System message for --chat.")


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


@jflags.reporting_errors("jaxinfer-generate")
def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if (FLAGS.prompt is None) == (FLAGS.prompts_file is None):
        raise app.UsageError("give exactly one of --prompt or --prompts_file")
    import jax

    from jaxinfer.sharding import maybe_initialize_distributed

    jflags.use_compilation_cache()
    run = jflags.resolve_config()
    maybe_initialize_distributed(run.multihost)  # before any other jax call
    lead = jax.process_index() == 0  # only process 0 writes outputs
    prompts = [FLAGS.prompt] if FLAGS.prompt is not None else _read_prompts(FLAGS.prompts_file)
    if not prompts:
        raise app.UsageError(f"--prompts_file={FLAGS.prompts_file} holds no prompts")
    run = _fit_to_workload(run, len(prompts))
    logging.info("resolved config: %s", run.to_json())
    llm = _load(run)
    if FLAGS.warmup:
        _warmup(llm, prompts, run.sampling)

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
        _write_jsonl(FLAGS.output_jsonl, prompts, results, run.sampling)
    _report(results, wall)
    return 1 if any(r.error for r in results) and len(prompts) == 1 else 0


def _fit_to_workload(run, num_prompts: int):
    """The workload is known up front: never decode more rows than there are samples (rounded
    up to a multiple of the data axis: each data shard serves an equal group of slots), and
    make the static top-logprobs width as wide as the request asks."""
    import jax

    from jaxinfer.sharding import parse_mesh

    data = parse_mesh(run.mesh, jax.device_count())["data"] if run.mesh else 1
    slots = min(run.engine.max_slots, num_prompts * run.sampling.n)
    engine = dataclasses.replace(
        run.engine, max_slots=-(-slots // data) * data,
        max_top_logprobs=max(run.engine.max_top_logprobs, run.sampling.top_logprobs))
    return dataclasses.replace(run, engine=engine)


def _load(run):
    from jaxinfer.engine.llm import load_llm
    from jaxinfer.sharding import describe

    t0 = time.perf_counter()
    llm = load_llm(run)
    config, mesh = llm.engine.config, llm.engine.mesh
    print(f"[jaxinfer] loaded {config.arch} ({config.num_params() / 1e6:.1f}M params, "
          f"{config.dtype}) in {time.perf_counter() - t0:.1f}s"
          + (f" on mesh {describe(mesh)}" if mesh is not None else ""), file=sys.stderr)
    return llm


def _warmup(llm, prompts: list[str], sampling) -> None:
    """Compiles the step variants these prompts use (bad prompts are reported per request by
    `generate`, so they are left out here)."""
    from jaxinfer.engine.prompts import encode_prompt

    t0 = time.perf_counter()
    engine = llm.engine
    workload = []
    for p in prompts:
        try:
            ids = encode_prompt(engine.tokenizer, engine.config.vocab_size, p, chat=FLAGS.chat,
                                system=FLAGS.system)
        except ValueError:
            continue
        if len(ids) + sampling.max_new_tokens <= engine.cache_config.max_seq_len:
            workload.append((ids, sampling))
    n = engine.warmup(workload=workload)
    print(f"[jaxinfer] compiled {n} step variants in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)


def _write_jsonl(path: str, prompts: list[str], results, sampling) -> None:
    n = sampling.n
    with open(path, "w") as f:
        for i, r in enumerate(results):
            f.write(json.dumps({
                "index": i // n, "sample": i % n, "seed": sampling.seed + i % n,
                "prompt": prompts[i // n], "text": r.text, "token_ids": r.token_ids,
                "num_prompt_tokens": len(r.prompt_ids), "finish_reason": r.finish_reason,
                "logprobs": r.logprobs, "top_logprobs": r.top_logprobs, "error": r.error,
                "metrics": r.metrics.as_dict()}) + "\n")


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
