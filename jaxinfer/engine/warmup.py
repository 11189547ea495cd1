"""Warm-up: compile the engine's step variants before serving, so serving compiles nothing.

A variant of `mixed_step` is a (chunk bucket, page bucket) pair (`jaxinfer.engine.batching`);
`verify_step` adds widths and row counts (`jaxinfer.engine.spec`). Either every variant that
requests up to some length can use is compiled (`step_variants`), or only those a known workload
uses, found by a dry run of the host scheduler with no device work (`planned_variants`; the CLI
uses this). With a drafter, a step's schedule depends on how many drafts get accepted, which no
dry run knows: a workload then only bounds the length.

Two ways to compile them, giving the same executables (`tests/test_warmup.py` counts them):

- serial (`workers=1`, and an abstract engine's ahead-of-time check, `jaxinfer.proof.aot`):
  each variant runs once on dummy rows that write only the trash page, handed over as a real
  step's rows are (`ModelRunner`), so they compile the executables serving runs;
- concurrent (the default): each variant is a task making the same calls on a compile-only
  twin of the runner, on a pool of threads (`jaxinfer.engine.precompile`): nothing runs, and
  each executable is compiled once whichever tasks need it.

A server starts the concurrent warm-up with its common shapes first (`common_variants`: what
one request on an otherwise idle server uses) and reports ready once those are compiled, while
the rest compile in the background (`start_warmup`); a step that needs one of them meanwhile
waits for it, or compiles it if no thread has started it (`precompile.Precompiler.guarded`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.precompile import Precompiler, Warmup
from jaxinfer.engine.request import make_requests
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.steps import MixedBatch

if TYPE_CHECKING:
    from jaxinfer.config import CacheConfig, EngineConfig
    from jaxinfer.engine.batching import BatchBuilder
    from jaxinfer.engine.runner import ModelRunner
    from jaxinfer.engine.spec import SpecDecoder

Workload = Sequence[tuple[Sequence[int], SamplingConfig]]


class EngineView(Protocol):
    """What warm-up reads of the engine it compiles for (`jaxinfer.engine.engine.Engine`,
    which calls warm-up: the dependency runs one way)."""

    engine_config: EngineConfig
    cache_config: CacheConfig
    max_context: int  # the longest request, prompt and output, in tokens
    scheduler: Scheduler  # its config and fan-out are what the dry run schedules with
    builder: BatchBuilder
    runner: ModelRunner
    spec: SpecDecoder | None  # the speculative decoder, if a drafter is set


def page_buckets(engine: EngineView, max_len: int | None, *, chunk: bool = False) -> list[int]:
    """Every page bucket a decode step (`chunk`: a step with a prompt chunk) of requests of at
    most `max_len` tokens can read (default: the engine's context)."""
    c = engine.cache_config
    bucket = engine.builder.chunk_pages if chunk else engine.builder.pages
    max_len = min(max_len or engine.max_context, engine.max_context)
    return sorted({bucket(n) for n in range(1, bucket(max_len) * c.page_size + 1, c.page_size)})


def step_variants(engine: EngineView, max_len: int | None = None) -> list[tuple[int, int]]:
    """(chunk bucket, page bucket) of every `mixed_step` variant that requests of at most
    `max_len` tokens (default: the engine's context) can use: the decode steps (chunk bucket
    0) at each page bucket, and the chunks: a chunk holds at most min(chunk size, max_len)
    tokens, and more than the bucket below its own (a chunk takes the smallest bucket that
    holds it), so it ends past that many tokens and its page bucket covers them."""
    e = engine.engine_config
    longest = min(e.chunk_size, max_len or engine.max_context)
    top = next(s for s in e.prefill_buckets if s >= longest)
    buckets = [s for s in e.prefill_buckets if s <= top]
    least = {t: engine.builder.chunk_pages(below + 1) for below, t in zip([0, *buckets], buckets)}
    return [(0, p) for p in page_buckets(engine, max_len)] + [
        (t, p) for t in buckets for p in page_buckets(engine, max_len, chunk=True)
        if p >= least[t]]


def planned_variants(engine: EngineView, workload: Workload) -> list[tuple[int, int]]:
    """The step variants that serving `workload` (all added at once, each running to its
    max_new_tokens) uses, found by a dry run of the host scheduler: no device work. An
    earlier EOS can change which chunk meets which page bucket; such a step compiles
    when it first occurs."""
    return _dry_run(engine, workload)[0]


def _dry_run(engine: EngineView, workload: Workload) -> tuple[list[tuple[int, int]], bool]:
    """`planned_variants(engine, workload)`, and whether serving it copies a page (a fork's
    partial page: only requests of n > 1 fork)."""
    dry = Scheduler(engine.scheduler.config, fanout=engine.scheduler.fanout)
    for i, (ids, sc) in enumerate(workload):
        for req in make_requests(str(i), list(ids), sc, arrival=0.0):
            dry.add(req)
    variants, previous, copies = set(), [], False
    while dry.has_unfinished() or previous:
        schedule = dry.schedule()
        copies = copies or bool(schedule.copies or schedule.post_copies)
        if schedule.chunks:
            variants.update((call.size, call.pages) for call in engine.builder.calls(schedule))
        dry.update(previous)
        previous = [(ch.request, 0) for ch in schedule.chunks if ch.samples]
        previous += [(child, 0) for child, _ in schedule.fanouts]
    return sorted(variants), copies


def common_variants(engine: EngineView, max_len: int) -> list[tuple[int, int]]:
    """The variants one request of at most `max_len` tokens (prompt and output) uses on an
    otherwise idle engine: the chunks of each prompt length (the scheduler's dry run) and the
    decode steps at each cache length."""
    max_len = min(max_len, engine.max_context)
    one = SamplingConfig(max_new_tokens=1)
    prompts = {v for n in range(1, max_len) for v in planned_variants(engine, [([0] * n, one)])}
    return sorted(prompts | {(0, engine.builder.pages(k)) for k in range(2, max_len)})


# Threads of a concurrent warm-up: XLA compiles one program per thread; each holds its
# program's compiler memory, which grows with the model.
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a warm-up compiles: `variants`, the (chunk bucket, page bucket) of each
    `mixed_step` variant (with `scored`, also the prompt-logprob variant of each with a chunk);
    with a drafter, the verification and the drafter's steps at each of `pages`; with
    `copies`, the forks' page copy."""

    variants: list[tuple[int, int]]
    scored: bool
    pages: list[int]
    copies: bool = True


def plan(engine: EngineView, max_len: int | None = None, *, workload: Workload | None = None,
         prompt_logprobs: bool = False) -> Plan:
    """The variants (all for `max_len`, or those `workload` uses; with a drafter, all for the
    workload's longest request); with `prompt_logprobs` (or a workload request that asks for
    them) also the prompt-logprob variants; the page copy unless a workload that never forks
    is known (it compiles in about a second, on first use if a later request forks)."""
    spec = engine.spec
    scored = prompt_logprobs or any(sc.prompt_logprobs is not None for _, sc in workload or ())
    if workload is not None and max_len is None:
        max_len = max((len(ids) + sc.max_new_tokens for ids, sc in workload), default=None)
    copies = workload is None or any(sc.n > 1 for _, sc in workload)
    if workload is not None and spec is None:
        variants, copies = _dry_run(engine, workload)
    else:
        variants = step_variants(engine, max_len)
    if spec is not None and not spec.drafter.one_hot:  # their decodes are verify_steps
        variants = [(size, pages) for size, pages in variants if size > 0]
    return Plan(variants, scored, page_buckets(engine, max_len), copies)


def warmup(engine: EngineView, max_len: int | None = None, *, workload: Workload | None = None,
           prompt_logprobs: bool = False, workers: int | None = None,
           cancelled: Callable[[], bool] | None = None) -> int:
    """Compiles the variants of `plan(engine, max_len, workload=..., prompt_logprobs=...)`,
    the page copy of forks, and with a drafter the verification and the drafter's steps, on
    `workers` threads (None: `DEFAULT_WORKERS`; 1, or an abstract engine: serially, running
    them; concurrently compiled variants then run once each, serially). `cancelled` is asked
    before each variant: True stops there (what is left compiles when first used). Returns how
    many step variants were compiled."""
    p = plan(engine, max_len, workload=workload, prompt_logprobs=prompt_logprobs)
    if (workers or DEFAULT_WORKERS) <= 1 or engine.runner.abstract:
        return _run_serially(engine, p, cancelled)
    w = _start(engine, p, workers or DEFAULT_WORKERS, common=None, cancelled=cancelled)
    w.wait()
    if not (cancelled is not None and cancelled()):
        # Each executable then runs once, compiling nothing: the costs of a first run (jit's
        # dispatch path filling its fast-path cache, XLA's first execution) are paid here and
        # not by the first request's time to first token.
        _run_serially(engine, p, cancelled)
    return w.num_compiled_variants


def start_warmup(engine: EngineView, max_len: int | None = None, *, common_len: int,
                 prompt_logprobs: bool = False, workers: int | None = None,
                 on_done: Callable[[], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Warmup:
    """Starts the concurrent warm-up of `warmup(engine, max_len, ...)` with the tasks that
    `common_variants(engine, common_len)` need first, and returns it at once: its
    `wait(ready)` returns when those are compiled. `on_done` runs when all are; `cancelled`
    is asked before each task (True: no further task starts)."""
    p = plan(engine, max_len, prompt_logprobs=prompt_logprobs)
    return _start(engine, p, workers or DEFAULT_WORKERS,
                  common=set(common_variants(engine, common_len)), on_done=on_done,
                  cancelled=cancelled)


def _run_serially(engine: EngineView, p: Plan, cancelled: Callable[[], bool] | None) -> int:
    e, runner, spec = engine.engine_config, engine.runner, engine.spec
    prefill, n = [], 0
    for size, pages in p.variants:
        if cancelled is not None and cancelled():
            runner.block_until_ready()
            return n
        batch = MixedBatch.idle(e.max_slots, engine.builder.table_width, size)
        runner.mixed(batch, pages)
        prefill.append((batch, pages))
        n += 1
        if p.scored and size > 0:
            runner.mixed(batch, pages, prompt_logprobs=True)
            n += 1
    if p.copies:
        _copy_trash(runner, spec.drafter if spec is not None else None)
    if spec is not None:
        n += spec.warmup(p.pages, prefill)
    runner.block_until_ready()
    return n


def _copy_trash(runner, drafter) -> None:
    """A page copy of padding pairs only, on the runner and the drafter (None: no drafter):
    compiles the forks' copy-on-write."""
    pairs = [(runner.trash_page, runner.trash_page)]
    local = [(runner.local_trash_page, runner.local_trash_page)]
    runner.copy_pages(pairs, local)
    if drafter is not None:
        drafter.copy_pages(pairs, local)


@dataclasses.dataclass(frozen=True)
class _Task:
    """One piece of a concurrent warm-up: `body(runner twin, drafter twin or None)` makes the
    calls; `variant`: the (chunk bucket, page bucket) of the steps it compiles (a
    verification or a draft: a decode step, chunk bucket 0; None: the forks' page copy);
    `count`: how many step variants it compiles."""

    variant: tuple[int, int] | None
    body: Callable
    count: int = 0


def _tasks(engine: EngineView, p: Plan) -> list[_Task]:
    """The calls of `_run_serially` as tasks on compile-only twins."""
    e, spec = engine.engine_config, engine.spec
    width = engine.builder.table_width
    tasks = [_Task(None, _copy_trash)] if p.copies else []
    for size, pages in p.variants:
        batch = MixedBatch.idle(e.max_slots, width, size)
        scored = p.scored and size > 0

        def mixed(r, d, batch=batch, pages=pages, scored=scored):
            r.mixed(batch, pages)
            if scored:
                r.mixed(batch, pages, prompt_logprobs=True)

        tasks.append(_Task((size, pages), mixed, 1 + scored))
        if spec is not None and spec.drafter.runners:
            tasks.append(_Task((size, pages), lambda r, d, v=(batch, pages): d.warmup(
                e.num_speculative_tokens, e.max_slots, width, [], [v])))
    if spec is not None:
        tasks += [_Task((0, args[2]), lambda r, d, args=args: r.verify(*args), 1)
                  for args in spec.verify_variants(p.pages)]
        if spec.drafter.runners:
            tasks += [_Task((0, pages), lambda r, d, pages=pages: d.warmup(
                e.num_speculative_tokens, e.max_slots, width, [pages], []))
                for pages in p.pages]
    return tasks


def _start(engine: EngineView, p: Plan, workers: int, common: set | None,
           on_done: Callable[[], None] | None = None,
           cancelled: Callable[[], bool] | None = None) -> Warmup:
    """Runs `_tasks` on `workers` threads; with `common`, those tagged with a common variant
    first, then the forks' page copy (a fork is not one plain request), then the others by
    page bucket then chunk bucket."""
    tasks = _tasks(engine, p)
    ready = len(tasks)
    if common is not None:
        first = [t for t in tasks if t.variant in common]
        rest = sorted((t for t in tasks if t.variant not in common),
                      key=lambda t: (-1, -1) if t.variant is None else (t.variant[1], t.variant[0]))
        tasks, ready = first + rest, len(first)
    precompiler = Precompiler()
    runner = engine.runner.compiling(precompiler.compile)
    drafter = engine.spec.drafter.compiling(precompiler.compile) if engine.spec else None
    runners = [engine.runner] + (engine.spec.drafter.runners if engine.spec else [])

    def run(body):
        return lambda: body(runner.compiling(precompiler.compile),
                            drafter.compiling(precompiler.compile) if drafter else None)

    return Warmup([run(t.body) for t in tasks], precompiler=precompiler, runners=runners,
                  workers=workers, ready=ready, on_done=on_done, cancelled=cancelled,
                  counts=[t.count for t in tasks])
