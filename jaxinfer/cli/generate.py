"""`jaxinfer-generate`: generate text from a checkpoint (default: embedded SmolLM2-135M-Instruct).

  jaxinfer-generate --prompt="What is the capital of France?" --chat --max_new_tokens=64
  jaxinfer-generate --prompts_file=prompts.txt --output_jsonl=out.jsonl --temperature=0.7

Prompts run on the serving engine (`jaxinfer.engine.engine`: continuous batching, chunked prefill,
prefix caching). One prompt streams to stdout; TTFT and decode tokens/s go to stderr. A prompts
file is text (one prompt per line) or JSONL (`jaxinfer.cli.prompt_file`).

Exit status: 2 = nothing ran: a bad flag or config value, an unreadable prompts or config file
or an unwritable output path, found before the model loads (one line on stderr). 1 = the run
finished and some request failed: a prompt that cannot run (a JSONL line that is not a usable
record, a prompt that does not fit the context, ...) fails alone, as a record with
finish_reason "error" and an `error` that starts with its `file:line` (or `--prompt`), and the
others run; stderr names the first failure. 0 = every request finished. The same rule holds
for one prompt and for many.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from absl import app, flags, logging

from jaxinfer.cli import flags as jflags
from jaxinfer.cli.prompt_file import (
    FORMATS,
    PromptRecord,
    file_format,
    jsonl_read_as_text,
    read_prompt_file,
)
from jaxinfer.engine.outputs import Completion

FLAGS = flags.FLAGS
flags.DEFINE_string("prompt", None, "One prompt (text).")
flags.DEFINE_string("prompts_file", None,
                    "File of prompts: text (one per line) or JSONL (objects with a 'prompt' and "
                    "optional sampling fields), see --prompts_format.")
flags.DEFINE_enum("prompts_format", "auto", list(FORMATS),
                  "auto: *.jsonl / *.ndjson files are JSONL, any other file is text.")
flags.DEFINE_string("output_jsonl", None, "Write one JSON record per sample here.")
flags.DEFINE_bool("warmup", True, "Compile the needed step variants before timing.")
flags.DEFINE_bool("print_config", False,
                  "Print the resolved run config (JSON) and exit without loading the model.")
jflags.define_run_flags(chat_default=False, system_help="System message for --chat.")


@jflags.reporting_errors("jaxinfer-generate")
def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run = jflags.resolve_config()
    if FLAGS.print_config:
        print(json.dumps(json.loads(run.to_json()), indent=2))
        return 0
    if (FLAGS.prompt is None) == (FLAGS.prompts_file is None):
        raise app.UsageError("give exactly one of --prompt or --prompts_file")
    if FLAGS.prompt is not None:
        records = [PromptRecord(where="--prompt", prompt=FLAGS.prompt, sampling=run.sampling)]
    else:
        records = _read_prompts(FLAGS.prompts_file, FLAGS.prompts_format, run.sampling)
    jflags.skip_absent_tpu()
    import jax

    from jaxinfer.sharding import maybe_initialize_distributed

    jflags.use_compilation_cache()
    maybe_initialize_distributed(run.multihost)  # before any other jax call
    lead = jax.process_index() == 0  # only process 0 writes outputs
    output = (jflags.open_output("--output_jsonl", FLAGS.output_jsonl)
              if lead and FLAGS.output_jsonl else None)
    run = _fit_to_workload(run, records)
    logging.debug("resolved config: %s", run.to_json())
    llm = _load(run)
    good = [r for r in records if r.error is None]
    if FLAGS.warmup:
        _warmup(llm, good)
    stream = lead and len(records) == 1 and run.sampling.n == 1 and output is None

    def on_output(i, out):
        if stream:
            sys.stdout.write(out.text)
            sys.stdout.flush()

    start = time.perf_counter()
    results = llm.generate([r.prompt for r in good], [r.sampling for r in good],
                           chat=FLAGS.chat, system=FLAGS.system, raise_on_error=False,
                           on_output=on_output, use_tqdm=not stream and sys.stderr.isatty())
    wall = time.perf_counter() - start
    if not lead:
        return 0
    samples = _samples(records, results)
    failed = any(c.error for _, c in samples)
    if stream and (samples[0][1].text or not failed):
        sys.stdout.write("\n")
    if output is not None:
        with output:
            for record, _ in samples:
                output.write(json.dumps(record) + "\n")
    else:
        _print_samples(samples, show_text=not stream)
    _report([c for _, c in samples], wall)
    return 1 if failed else 0


def _read_prompts(path: str, fmt: str, sampling) -> list[PromptRecord]:
    records = read_prompt_file(path, sampling, fmt=fmt)
    if not records:
        raise app.UsageError(f"--prompts_file={path} holds no prompts")
    if file_format(path, fmt) == "text" and jsonl_read_as_text(records):
        print(f"[jaxinfer] warning: every line of --prompts_file={path} is a JSON object with a "
              "\"prompt\" key, but the file is read as text, so each prompt is that raw JSON; "
              "for JSONL records name the file *.jsonl or pass --prompts_format=jsonl",
              file=sys.stderr)
    return records


def _samples(records, results) -> list[tuple[dict, Completion]]:
    """(JSON record, Completion) per sample, in file order: a prompt's n samples in a row; a
    line that failed to parse is one sample carrying its error. Every error starts with where
    its prompt came from (`file:line` or `--prompt`)."""
    out, done = [], iter(results)
    for index, record in enumerate(records):
        n = record.sampling.n if record.error is None else 1
        for sample in range(n):
            c = (next(done) if record.error is None else
                 Completion(prompt_ids=[], token_ids=[], text="", finish_reason="error",
                            error=record.error))
            if c.error is not None and not c.error.startswith(f"{record.where}: "):
                c = dataclasses.replace(c, error=f"{record.where}: {c.error}")
            out.append(({
                "index": index, "sample": sample, "source": record.where,
                "seed": record.sampling.seed + sample if record.error is None else None,
                "prompt": record.prompt, "text": c.text, "token_ids": c.token_ids,
                "num_prompt_tokens": len(c.prompt_ids), "finish_reason": c.finish_reason,
                "logprobs": c.logprobs, "top_logprobs": c.top_logprobs,
                **({"prompt_logprobs": c.prompt_logprobs,
                    "prompt_top_logprobs": c.prompt_top_logprobs}
                   if c.prompt_logprobs is not None else {}),
                "error": c.error, "metrics": c.metrics.as_dict()}, c))
    return out


def _print_samples(samples, *, show_text: bool) -> None:
    """Each sample's text (unless it was streamed) and, where asked for, its logprobs."""
    several = len(samples) > 1
    for record, c in samples:
        if several:
            print(f"--- prompt {record['index']}, sample {record['sample']} "
                  f"(seed {record['seed']})")
        if show_text:
            print(c.text if c.error is None else f"[error] {c.error}")
        if c.logprobs is not None or c.top_logprobs is not None:
            print(json.dumps({"token_ids": c.token_ids, "logprobs": c.logprobs,
                              "top_logprobs": c.top_logprobs}))
        if c.prompt_logprobs is not None:
            print(json.dumps({"prompt_ids": c.prompt_ids, "prompt_logprobs": c.prompt_logprobs,
                              "prompt_top_logprobs": c.prompt_top_logprobs}))


def _fit_to_workload(run, records):
    """The workload is known up front: never decode more rows than there are samples (rounded
    up to a multiple of the data axis: each data shard serves an equal group of slots), and
    make the static top-logprobs width as wide as a request asks."""
    import jax

    from jaxinfer.sharding import parse_mesh

    data = parse_mesh(run.mesh, jax.device_count())["data"] if run.mesh else 1
    good = [r.sampling for r in records if r.error is None] or [run.sampling]
    slots = min(run.engine.max_slots, sum(sc.n for sc in good))
    engine = dataclasses.replace(
        run.engine, max_slots=-(-slots // data) * data,
        max_top_logprobs=max(run.engine.max_top_logprobs,
                             *(max(sc.top_logprobs, sc.prompt_logprobs or 0) for sc in good)))
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


def _warmup(llm, records) -> None:
    """Compiles the step variants these prompts use (bad prompts are reported per request by
    `generate`, so they are left out here)."""
    from jaxinfer.engine.prompts import encode_prompt

    t0 = time.perf_counter()
    engine = llm.engine
    workload = []
    for r in records:
        try:
            ids = encode_prompt(engine.tokenizer, engine.config.vocab_size, r.prompt,
                                chat=FLAGS.chat, system=FLAGS.system)
        except ValueError:
            continue
        if len(ids) + r.sampling.max_new_tokens <= engine.cache_config.max_seq_len:
            workload.append((ids, r.sampling))
    n = engine.warmup(workload=workload)
    print(f"[jaxinfer] compiled {n} step variants in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)


def _report(results, wall: float) -> None:
    """Latency and throughput of the requests that produced tokens, then the failures (how
    many, and the first one's error, which names its prompt's file and line)."""
    ok = [r for r in results if r.error is None and r.token_ids]
    if ok:
        _report_metrics(ok, wall)
    errors = [r for r in results if r.error]
    if errors:
        print(f"[jaxinfer] {len(errors)} request(s) failed: first error: {errors[0].error}",
              file=sys.stderr)


def _report_metrics(ok, wall: float) -> None:
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


def run() -> None:
    jflags.run_app(main, doc=__doc__)


if __name__ == "__main__":
    run()
