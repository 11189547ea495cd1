"""The serving engine: `Engine` (add_request / step / abort / stream), the only generation path.

Each `step()`:

1. `Scheduler.schedule()` picks this step's work on the host: one token for every decoding
   request plus prompt chunks, under the token budget (see `jaxinfer.engine.scheduler`);
2. the work is dispatched as `mixed_step` calls (`jaxinfer.engine.batching`: one per prompt
   chunk; the decode rows ride with the first), which JAX runs asynchronously;
3. only then does the host wait for the *previous* step's sampled ids — one `device_get` per
   step — and hand them to `Scheduler.update()`, which streams text and finishes requests.

So the host schedules and dispatches step n while the device still computes step n - 1, and
detokenizes step n - 1 while the device computes step n. This works because a decoding row's
input token never leaves the device (`SlotState.tokens`); the one thing the host learns late is
that a request ended (EOS or a stop string), in which case the row it already dispatched for it
is computed and dropped. Pages freed meanwhile are safe to reuse: the device runs steps in
order, so a dropped row's write lands before any later owner's. With a drafter, a step is the
synchronous `SpecDecoder.step` instead (`jaxinfer.engine.spec`).

Constrained requests (structured output, `jaxinfer.engine.constraints`) break that overlap: the
token mask of a constrained row's step n + 1 is a function of its token n, which is still on
the device when the overlapped host would build step n + 1. So while any running constrained
request has a token in flight, `step()` first collects the previous step (its tokens advance the
grammars), then schedules, fills the masks and dispatches: a synchronous step, for the whole
batch, counted in `stats()["sync_steps"]`. The other option, computing step n + 1's mask while
step n runs, works only where the grammar's next state does not depend on the sampled token
(forced tokens), which is the exception; the synchronous step is correct for every grammar, and
what it costs is measured in docs/benchmarks.md ("Structured output"). Unconstrained work keeps
the overlap, and a batch pays for it only while a constrained request decodes.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import Mesh

from jaxinfer import sharding
from jaxinfer.checkpoint.tokenizer import IncrementalDecoder, Tokenizer
from jaxinfer.config import CacheConfig, EngineConfig, ModelConfig, SamplingConfig
from jaxinfer.engine import steps, warmup
from jaxinfer.engine.adapters import Adapters
from jaxinfer.engine.batching import BatchBuilder, SampleSlot
from jaxinfer.engine.constraints import ConstraintCompiler
from jaxinfer.engine.outputs import (
    Completion,
    RequestOutput,
    record_logprobs,
    record_prompt_logprobs,
    request_outputs,
)
from jaxinfer.engine.prompts import GREEDY, encode_prompt, sampling_config
from jaxinfer.engine.request import (
    SchedulerOutput,
    TokenEvent,
    make_requests,
    release_rest,
    sample_ids,
)
from jaxinfer.engine.request_table import RequestTable
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sched_state import SchedulerConfig
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.spec import SpecDecoder, make_drafter
from jaxinfer.model import Llama
from jaxinfer.model.attention import resolve_impl
from jaxinfer.model.eagle import EagleHead
from jaxinfer.model.kv_heads import fit_kv_heads


@dataclasses.dataclass
class _Inflight:
    schedule: SchedulerOutput
    outputs: list  # SampleOutput per mixed_step call (device arrays)
    samples: list[SampleSlot]
    prompts: list  # (chunk, its prompt-logprob SampleOutput) per call that scores a prompt


def _scheduler_config(engine: EngineConfig, cache: CacheConfig, config: ModelConfig,
                      data_shards: int) -> SchedulerConfig:
    """The scheduler's view of the engine and its pools (validating their split)."""
    return SchedulerConfig(
        max_slots=engine.max_slots, token_budget=engine.max_num_batched_tokens,
        chunk_size=engine.chunk_size, page_size=cache.page_size, num_pages=cache.num_pages,
        pages_per_seq=cache.pages_per_seq, enable_prefix_caching=engine.enable_prefix_caching,
        policy=engine.scheduling_policy, watermark=engine.admission_watermark,
        data_shards=data_shards, window=cache.local_window(config),
        num_local_pages=cache.num_local_pages or 0)


def _batch_builder(engine: EngineConfig, cache: CacheConfig,
                   sched: SchedulerConfig) -> BatchBuilder:
    """The step batches' builder (with a hybrid pool's local trash page per data shard)."""
    return BatchBuilder(
        max_slots=engine.max_slots, page_size=cache.page_size,
        pages_per_seq=cache.pages_per_seq, prefill_buckets=engine.prefill_buckets,
        min_bucket_pages=cache.min_bucket_pages,
        local_trash=tuple(sched.shard_local_pages(d).stop for d in range(sched.data_shards))
        if sched.hybrid else ())


def _check_limits(sampling: SamplingConfig, num_ids: int, *, max_top_logprobs: int,
                  max_seq_len: int, max_position: int) -> None:
    """ValueError naming the setting when a request of `num_ids` prompt tokens asks for more
    logprobs than the engine keeps or more tokens than its context holds."""
    for name in ("top_logprobs", "prompt_logprobs"):
        if (getattr(sampling, name) or 0) > max_top_logprobs:
            raise ValueError(f"{name}={getattr(sampling, name)} exceeds the engine's "
                             f"max_top_logprobs={max_top_logprobs}")
    total = num_ids + sampling.max_new_tokens
    if total > max_seq_len:
        raise ValueError(
            f"prompt ({num_ids} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
            f"{total} exceeds the context of {max_seq_len} tokens "
            f"(cache max_seq_len; model max_position={max_position})")


class Engine:
    """Continuous batching over the paged cache with chunked prefill, prefix caching,
    preemption, forks and speculative decoding (docs/architecture.md, decisions 2, 3, 5, 6, 10)."""

    def __init__(self, model: Llama, tokenizer: Tokenizer | None, *,
                 cache: CacheConfig | None = None, engine: EngineConfig | None = None,
                 mesh: Mesh | None = None, draft_model: Llama | None = None,
                 draft_head: EagleHead | None = None, call: steps.Call = steps.run):
        """mesh: a ("data", "model") or ("data", "expert", "model") mesh
        (`sharding.make_mesh`): weights and KV pages are placed by `sharding.RULES` and every
        step runs SPMD over it; a mixture's experts must split evenly over its expert axis
        (`ModelConfig.check_mesh`). None = one device.
        draft_model: the drafter of `engine.speculative_method="draft"` (same vocabulary).
        draft_head: the head of `engine.speculative_method="eagle"`, made for `model`
        (`jaxinfer.model.eagle`; loaded by `jaxinfer.checkpoint.eagle.load_draft_head`).
        call: how the runner invokes each jitted step (`ModelRunner`; an abstract model's
        engine compiles them: `jaxinfer.proof.aot`). On a model axis wider than the model's kv
        heads, the engine runs a copy of `model` with them duplicated to its size
        (`kv_heads.fit_kv_heads`: one per chip) and `self.config` is that model's."""
        if mesh is not None:
            model.config.check_mesh(dict(mesh.shape))
        base = model.config
        engine = engine or EngineConfig()
        if engine.max_loras:  # the LoRA adapter pool (docs/architecture.md, decision 18)
            model = model.with_lora_pool(engine.max_loras, engine.max_lora_rank)
        model = fit_kv_heads(model, mesh)
        self.config = model.config
        self.mesh = mesh
        self.tokenizer = tokenizer
        self.engine_config = engine
        self.adapters = (Adapters(config=model.config, base=base,
                                  write=lambda slot, values: self.runner.write_lora(slot, values))
                         if engine.max_loras else None)
        speculative = engine.speculative_method != "none"
        self.cache_config = cache = (cache or CacheConfig()).with_pools(
            model.config, max_slots=engine.max_slots, chunk_size=engine.chunk_size,
            extra_tokens=engine.spec_width if speculative else 0)
        self.data_shards = sharding.data_shards(mesh) if mesh is not None else 1
        # The scheduler's config validates the slot and pool split before any weight moves.
        self.scheduler = Scheduler(
            _scheduler_config(engine, cache, model.config, self.data_shards),
            fanout=not speculative, adapters=self.adapters.slots if self.adapters else None)
        graph, params = steps.split_model(model, mesh)
        self.runner = ModelRunner(graph, params, config=model.config, cache=cache,
                                  max_slots=engine.max_slots, mesh=mesh,
                                  attention_impl=resolve_impl(engine.attention_impl),
                                  max_top_logprobs=engine.max_top_logprobs, call=call)
        self.builder = _batch_builder(engine, cache, self.scheduler.config)
        self.constraints = (ConstraintCompiler(tokenizer, model.config.vocab_size)
                            if tokenizer is not None else None)
        drafter = make_drafter(engine, runner=self.runner, cache=self.cache_config, mesh=mesh,
                               draft_model=draft_model, draft_head=draft_head)
        self.spec = (SpecDecoder(drafter, config=engine, runner=self.runner,
                                 scheduler=self.scheduler, builder=self.builder,
                                 constraints=self.constraints) if drafter is not None else None)
        self._inflight: _Inflight | None = None
        self.request_table = RequestTable(self.scheduler)
        # Steps; device step calls; steps that collected the previous one first (constraints);
        # prompt tokens of the requests added; tokens streamed.
        self.num_steps = self.num_calls = self.num_sync_steps = 0
        self.num_input_tokens = self.num_output_tokens = 0
        self._first_step: float | None = None
        self.max_context = min(cache.max_seq_len,
                               cache.num_pages // self.data_shards * cache.page_size)

    # ----- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], sampling: SamplingConfig = GREEDY, *,
                    request_id: str | None = None, chat: bool = False,
                    system: str | None = None, arrival: float | None = None) -> str:
        """Queues a request (text or token ids); returns its id. Bad input raises ValueError
        naming the bad value; nothing already queued or running is affected.

        With `sampling.n` > 1 the n samples are requests "<id>/0" .. "<id>/<n-1>" (sample i
        seeded `seed + i`, `sample_ids`), and the prompt is prefilled once: a prefill-only
        parent computes it, then each sample holds the parent's full pages, gets a device copy
        of its partial last page, and samples its first token with its own seed from the
        parent's last logits, in the same step (a sample that finds no free slot then computes
        the last prompt token itself, later). Requests with penalties (whose penalty state
        needs the whole prompt to pass through their slot) are n independent requests instead,
        as are one-token prompts."""
        sampling = sampling_config(sampling)
        ids = encode_prompt(self.tokenizer, self.config.vocab_size, prompt, chat=chat,
                            system=system)
        _check_limits(sampling, len(ids), max_top_logprobs=self.engine_config.max_top_logprobs,
                      max_seq_len=self.cache_config.max_seq_len,
                      max_position=self.config.max_position)
        constraint = None
        if sampling.constraint is not None:
            if self.constraints is None:
                raise ValueError(f"{sampling.constraint} needs a tokenizer; this engine has none")
            constraint = self.constraints.compile(sampling)
        lora_key = self._lora_key(sampling.lora)
        rid = self.request_table.new_id(request_id, sampling.n)
        eos = (frozenset() if sampling.ignore_eos or self.tokenizer is None
               else frozenset(self.tokenizer.eos_ids))
        detokenizer = (functools.partial(IncrementalDecoder, self.tokenizer)
                       if self.tokenizer is not None else None)
        requests = make_requests(rid, ids, sampling, eos_ids=eos, detokenizer=detokenizer,
                                 constraint=constraint, lora=lora_key,
                                 arrival=time.perf_counter() if arrival is None else arrival)
        for req in requests:  # validate every request before queueing any
            self.scheduler.check(req)
        for req in requests:
            self.scheduler.add(req)
        self.request_table.add(rid, requests)
        self.num_input_tokens += len(ids) * sampling.n
        if sampling.lora is not None:
            self.adapters.registry.requests[sampling.lora] += 1
        return rid

    # ----- LoRA adapters ----------------------------------------------------------------------
    def _pool(self, what: str) -> Adapters:
        if self.adapters is None:
            raise ValueError(f"{what}: this engine has no LoRA adapter pool (start it with "
                             "max_loras > 0 and register adapters with add_lora)")
        return self.adapters

    def _lora_key(self, name: str | None) -> str | None:
        return None if name is None else self._pool(f"lora={name!r}").key_of(name)

    def add_lora(self, name: str, path: str) -> None:
        """Registers the PEFT adapter in directory `path` under `name`, for requests that name
        it (`SamplingConfig.lora`); it pages into the device pool when a request needs it. A bad
        adapter raises ValueError naming it and the bad file, setting or tensor; nothing
        already queued or running is affected."""
        self._pool(f"cannot load LoRA adapter {name!r}").add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregisters adapter `name` (ValueError if unknown, or while a request that has not
        finished runs with it: those finish first)."""
        key = self._pool(f"cannot remove LoRA adapter {name!r}").key_of(name)
        busy = any(r.lora == key and not r.finished for r in self.scheduler.requests.values())
        self.adapters.remove(name, busy)

    def loras(self) -> list[str]:
        """The names of the registered adapters, in registration order."""
        return [a.name for a in self.adapters.listing()] if self.adapters else []

    sample_ids = staticmethod(sample_ids)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Ends a request now ("abort"): all its samples, or the one sample "<id>/<i>" names;
        their pages and slots are free for the next step. Finished samples keep their
        results. Returns the last output of each sample it ended (no token: `token_id` None;
        finish_reason "abort"), whose text is what the stream held back of the sample's text
        (`request.accept_token`), so that a stream still adds up to `Completion.text`."""
        outs = []
        for req in self.request_table.resolve(request_id, with_parent=True):
            if not req.finished:
                self.scheduler.abort(req.request_id)
                if not req.prefill_only:
                    outs.append(RequestOutput(req.request_id, None, release_rest(req), True,
                                              "abort"))
        return outs

    def result(self, request_id: str) -> Completion:
        """The result of a finished request of one sample (`RequestTable.result`)."""
        return self.request_table.result(request_id)

    def results(self, request_id: str) -> list[Completion]:
        """One `Completion` per sample of a finished request (`RequestTable.results`)."""
        return self.request_table.results(request_id)

    def forget(self, request_id: str) -> None:
        """Drops a finished request's records (`RequestTable.forget`)."""
        self.request_table.forget(request_id)

    # ----- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and dispatches one step, then collects the previous step's tokens (first,
        while a constrained request has a token in flight: its next mask needs that token)."""
        if self._first_step is None:
            self._first_step = time.perf_counter()
        self.num_steps += 1
        early = []
        if self._inflight is not None and any(
                r.constraint is not None and r.num_pending for r in self.scheduler.running):
            early = self._collect(self._inflight)
            self._inflight = None
            self.num_sync_steps += 1
        schedule = self.scheduler.schedule()
        if self.spec is not None:
            if not schedule.chunks:
                return []
            self._sync_sampling()
            events, calls = self.spec.step(schedule)
            self.num_calls += calls
            return self._outputs(events)
        launched = self._dispatch(schedule) if schedule.chunks else None
        events = self._collect(self._inflight) if self._inflight is not None else []
        self._inflight = launched
        return early + events

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def stream(self) -> Iterator[RequestOutput]:
        """Steps until every request has finished, yielding each token as it arrives."""
        while self.has_unfinished():
            yield from self.step()

    def run(self) -> None:
        for _ in self.stream():
            pass

    def _sync_sampling(self) -> None:
        """Every slot's sampling parameters on device (a model drafter draws with them too)."""
        configs = [None] * self.engine_config.max_slots
        for req in self.scheduler.running:
            configs[req.slot] = req.params
        self.runner.set_sampling(configs)
        if self.spec is not None:
            self.spec.drafter.set_sampling(configs)

    def _dispatch(self, schedule: SchedulerOutput) -> _Inflight:
        self.runner.copy_pages(schedule.copies, schedule.local_copies)
        self._sync_sampling()
        batches, samples = self.builder.build(schedule, self.scheduler.running)
        allowed = (self.constraints.masks([s.request for s in samples],
                                          self.engine_config.max_slots)
                   if self.constraints is not None else None)
        outputs, prompts = [], []
        for batch, pages, scored in batches:
            out, prompt = self.runner.mixed(batch, pages, allowed, scored is not None)
            outputs.append(out)
            if scored is not None:
                prompts.append((scored, prompt))
        self.num_calls += len(batches)
        self.runner.copy_pages(schedule.post_copies, schedule.local_post_copies)
        return _Inflight(schedule, outputs, samples, prompts)

    def _collect(self, inflight: _Inflight) -> list[RequestOutput]:
        # The step's one transfer to the host.
        host, prompts = jax.device_get((inflight.outputs, [p for _, p in inflight.prompts]))
        now = time.perf_counter()
        for (chunk, _), prompt in zip(inflight.prompts, prompts):
            record_prompt_logprobs(chunk.request, prompt, chunk.start, chunk.num_tokens)
        sampled = []
        for s in inflight.samples:
            out = host[s.call]
            record_logprobs(s.request, out, s.row)
            sampled.append((s.request, int(out.tokens[s.row])))
        return self._outputs(self.scheduler.update(sampled, now))

    def _outputs(self, events: list[TokenEvent]) -> list[RequestOutput]:
        self.num_output_tokens += len(events)
        return request_outputs(events)

    # ----- warm-up and metrics ----------------------------------------------------------------
    def warmup(self, max_len: int | None = None, *,
               workload: Sequence[tuple[Sequence[int], SamplingConfig]] | None = None,
               prompt_logprobs: bool = False, workers: int | None = None,
               cancelled: Callable[[], bool] | None = None) -> int:
        """Compiles the step variants; returns how many. Default: every variant requests of
        up to `max_len` tokens can use, after which serving compiles nothing. With `workload`
        ((prompt ids, sampling) pairs): just the ones serving that workload uses
        (`jaxinfer.engine.warmup.planned_variants`). With `prompt_logprobs`: the
        prompt-logprob variants too (`SamplingConfig.prompt_logprobs`). workers: compiling
        threads (None: `warmup.DEFAULT_WORKERS`; 1: one variant after another, each run on
        dummy rows that write only the trash page). `cancelled`: asked before each variant;
        True ends warm-up there (a server told to shut down while it warms up), leaving the
        rest to compile when first used."""
        if self.has_unfinished():
            raise RuntimeError("warmup() must run before any request is added")
        if self.adapters is not None:
            self.adapters.warm()
        return warmup.warmup(self, max_len, workload=workload, prompt_logprobs=prompt_logprobs,
                             workers=workers, cancelled=cancelled)

    def start_warmup(self, max_len: int | None = None, *, common_len: int,
                     prompt_logprobs: bool = False, workers: int | None = None,
                     on_done: Callable[[], None] | None = None,
                     cancelled: Callable[[], bool] | None = None) -> warmup.Warmup:
        """Starts compiling what `warmup(max_len, prompt_logprobs=...)` compiles, the
        variants of one request of up to `common_len` tokens first, and returns at once the
        `Warmup`: its `wait(ready)` returns when those are compiled, `wait()` when all are.
        Requests may be served meanwhile: a step whose variant is not compiled yet waits for
        it (`jaxinfer.engine.warmup.start_warmup`). `on_done` runs (on a warm-up thread) when
        all are compiled; `cancelled` is asked before each variant (True: no further one
        starts, and `wait` returns False)."""
        if self.has_unfinished():
            raise RuntimeError("start_warmup() must run before any request is added")
        return warmup.start_warmup(self, max_len, common_len=common_len,
                                   prompt_logprobs=prompt_logprobs, workers=workers,
                                   on_done=on_done, cancelled=cancelled)

    def stats(self) -> dict:
        """Scheduler counters (running/waiting, pages, preemptions, prefix hits, token rows),
        speculation counters, the engine's step and device-call counts, and input/output tokens
        per second since the first step."""
        elapsed = time.perf_counter() - self._first_step if self._first_step else 0.0
        c = self.constraints
        return {**self.scheduler.stats(), **(self.spec.counters.stats() if self.spec else {}),
                **(self.adapters.stats() if self.adapters else {}), "steps": self.num_steps,
                "device_calls": self.num_calls, "sync_steps": self.num_sync_steps,
                "mask_fills": c.fill_calls if c else 0,
                "mask_fill_seconds": c.fill_seconds if c else 0.0,
                "input_tokens": self.num_input_tokens, "output_tokens": self.num_output_tokens,
                "input_throughput": self.num_input_tokens / elapsed if elapsed else 0.0,
                "output_throughput": self.num_output_tokens / elapsed if elapsed else 0.0}
