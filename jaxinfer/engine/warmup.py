"""Warm-up: compile the engine's step variants before serving, so serving compiles nothing.

A variant of `mixed_step` is a (chunk bucket, page bucket) pair (`jaxinfer.engine.batching`);
`verify_step` adds widths and row counts (`jaxinfer.engine.spec`). Either every variant that
requests up to some length can use is compiled (`step_variants`), or only those a known workload
uses, found by a dry run of the host scheduler with no device work (`planned_variants`; the CLI
uses this). With a drafter, a step's schedule depends on how many drafts get accepted, which no
dry run knows: a workload then only bounds the length. Each variant runs once on dummy rows that
write only the trash page, handed over as a real step's rows are (`ModelRunner`), so they
compile the executables serving runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.kv_cache import pages_bucket
from jaxinfer.engine.request import make_requests
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.steps import MixedBatch

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine

Workload = Sequence[tuple[Sequence[int], SamplingConfig]]


def page_buckets(engine: Engine, max_len: int | None) -> list[int]:
    """Every page bucket a request of at most `max_len` tokens can read (default: the
    engine's context)."""
    c = engine.cache_config
    max_len = min(max_len or engine.max_context, engine.max_context)
    top = pages_bucket(max_len, c.page_size, c.pages_per_seq)
    return sorted({pages_bucket(n, c.page_size, c.pages_per_seq)
                   for n in range(1, top * c.page_size + 1, c.page_size)})


def step_variants(engine: Engine, max_len: int | None = None) -> list[tuple[int, int]]:
    """(chunk bucket, page bucket) of every `mixed_step` variant that requests of at most
    `max_len` tokens (default: the engine's context) can use: a chunk holds at most
    min(chunk size, max_len) tokens."""
    e = engine.engine_config
    longest = min(e.chunk_size, max_len or engine.max_context)
    top = next(s for s in e.prefill_buckets if s >= longest)
    buckets = [s for s in e.prefill_buckets if s <= top]
    return [(t, p) for t in [0, *buckets] for p in page_buckets(engine, max_len)]


def planned_variants(engine: Engine, workload: Workload) -> list[tuple[int, int]]:
    """The step variants that serving `workload` (all added at once, each running to its
    max_new_tokens) uses, found by a dry run of the host scheduler: no device work. An
    earlier EOS can change which chunk meets which page bucket; such a step compiles
    when it first occurs."""
    dry = Scheduler(engine.scheduler.config, fanout=engine.scheduler.fanout)
    for i, (ids, sc) in enumerate(workload):
        for req in make_requests(str(i), list(ids), sc, arrival=0.0):
            dry.add(req)
    variants, previous = set(), []
    while dry.has_unfinished() or previous:
        schedule = dry.schedule()
        if schedule.chunks:
            variants.update((call.size, call.pages) for call in engine.builder.calls(schedule))
        dry.update(previous)
        previous = [(ch.request, 0) for ch in schedule.chunks if ch.samples]
        previous += [(child, 0) for child, _ in schedule.fanouts]
    return sorted(variants)


def warmup(engine: Engine, max_len: int | None = None, *, workload: Workload | None = None,
           prompt_logprobs: bool = False, cancelled: Callable[[], bool] | None = None) -> int:
    """Compiles the variants (all for `max_len`, or those `workload` uses; with a drafter, all
    for the workload's longest request), the page copy of forks, and with a drafter the
    verification and the drafter's steps. With `prompt_logprobs` (or a workload request that
    asks for them) also the prompt-logprob variant of every chunk variant. `cancelled` is
    asked before each variant: True stops there (what is left compiles when first used).
    Returns how many step variants ran."""
    e, runner, spec = engine.engine_config, engine.runner, engine.spec
    scored = prompt_logprobs or any(sc.prompt_logprobs is not None for _, sc in workload or ())
    if workload is not None and max_len is None:
        max_len = max((len(ids) + sc.max_new_tokens for ids, sc in workload), default=None)
    if workload is not None and spec is None:
        variants = planned_variants(engine, workload)
    else:
        variants = step_variants(engine, max_len)
    if spec is not None and not spec.drafter.one_hot:  # their decodes are verify_steps
        variants = [(size, pages) for size, pages in variants if size > 0]
    prefill, n = [], 0
    for size, pages in variants:
        if cancelled is not None and cancelled():
            break
        batch = MixedBatch.idle(e.max_slots, engine.builder.table_width, size)
        runner.mixed(batch, pages)
        prefill.append((batch, pages))
        n += 1
        if scored and size > 0:
            runner.mixed(batch, pages, prompt_logprobs=True)
            n += 1
    else:
        trash = runner.trash_page
        local_trash = runner.local_trash_page
        runner.copy_pages([(trash, trash)], [(local_trash, local_trash)])  # forks
        if spec is not None:
            spec.drafter.copy_pages([(trash, trash)], [(local_trash, local_trash)])
            n += spec.warmup(page_buckets(engine, max_len), prefill)
    runner.block_until_ready()
    return n
