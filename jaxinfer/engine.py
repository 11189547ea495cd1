"""The serving engine: `Engine` (add_request / step / abort / stream) and the offline `LLM`.

Each `step()`:

1. `Scheduler.schedule()` picks this step's work on the host: one token for every decoding
   request plus prompt chunks, under the token budget (see `jaxinfer.scheduler`);
2. the work is dispatched as `mixed_step` calls (one per prompt chunk; the decode rows ride
   with the first), which JAX runs asynchronously;
3. only then does the host wait for the *previous* step's sampled ids — one `device_get` per
   step — and hand them to `Scheduler.update()`, which streams text and finishes requests.

So the host schedules and dispatches step n while the device still computes step n - 1, and
detokenizes step n - 1 while the device computes step n. This works because a decoding row's
input token never leaves the device (`SlotState.tokens`); the one thing the host learns late is
that a request ended (EOS or a stop string), in which case the row it already dispatched for it
is computed and dropped. Pages freed meanwhile are safe to reuse: the device runs steps in
order, so a dropped row's write lands before any later owner's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer import sharding, speculative, steps
from jaxinfer.attention import resolve_impl
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.generate import GREEDY, Completion, batch_of, encode_prompt
from jaxinfer.kv_cache import create_cache, pages_bucket
from jaxinfer.metrics import RequestMetrics
from jaxinfer.model import Llama
from jaxinfer.sampling import SamplingParams
from jaxinfer.scheduler import Chunk, Request, Scheduler, SchedulerConfig, SchedulerOutput
from jaxinfer.tokenizer import IncrementalDecoder, Tokenizer


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One streamed token: its request, id, the text it added, and whether the request ended."""

    request_id: str
    token_id: int
    text: str
    finished: bool
    finish_reason: str | None


@dataclasses.dataclass
class _Inflight:
    schedule: SchedulerOutput
    outputs: list  # SampleOutput per mixed_step call (device arrays)
    rows: list[tuple[Request, int, int]]  # (request, call index, output row) per sample


class Engine:
    """Continuous batching over the paged cache with chunked prefill, prefix caching and
    preemption (DESIGN.md decisions 2, 3, 6, 10)."""

    def __init__(self, model: Llama, tokenizer: Tokenizer | None, *,
                 cache: CacheConfig | None = None, engine: EngineConfig | None = None,
                 mesh: Mesh | None = None, draft_model: Llama | None = None):
        """mesh: a ("data", "model") mesh (`sharding.make_mesh`): weights and KV pages are
        placed by `sharding.RULES` and every step runs SPMD over it. None = one device.
        draft_model: the drafter of `engine.speculative_method="draft"` (same vocabulary)."""
        self.config = model.config
        self.mesh = mesh
        self.tokenizer = tokenizer
        engine = engine or EngineConfig()
        cache = (cache or CacheConfig()).resolved(model.config)
        num_pages = cache.num_pages or engine.max_slots * cache.pages_per_seq
        self.cache_config = dataclasses.replace(cache, num_pages=num_pages)
        self.engine_config = engine
        self.graph, self.params = steps.split_model(model, mesh)
        self.attention_impl = resolve_impl(engine.attention_impl)
        self.data_shards = mesh.shape.get("data", 1) if mesh is not None else 1
        if engine.max_slots % self.data_shards or num_pages % self.data_shards:
            raise ValueError(
                f"max_slots={engine.max_slots} and num_pages={num_pages} must both be divisible "
                f"by the mesh's data axis ({self.data_shards}): each data shard serves an equal "
                "group of slots from its own part of the KV pool; e.g. max_slots="
                f"{-(-engine.max_slots // self.data_shards) * self.data_shards}")
        make_cache = functools.partial(create_cache, self.config, self.cache_config,
                                       engine.max_slots, data_shards=self.data_shards)
        self.state = steps.create_slot_state(engine.max_slots, self.config.vocab_size)
        if mesh is None:
            self.kv = make_cache()
        else:  # allocated in its shards: the whole pool never sits on one device
            shardings = sharding.cache_sharding(jax.eval_shape(make_cache), mesh)
            self.kv = jax.jit(make_cache, out_shardings=shardings)()
            self.state = sharding.replicated(self.state, mesh)
        self.scheduler = Scheduler(SchedulerConfig(
            max_slots=engine.max_slots, token_budget=engine.max_num_batched_tokens,
            chunk_size=engine.chunk_size, page_size=cache.page_size,
            num_pages=num_pages, pages_per_seq=cache.pages_per_seq,
            enable_prefix_caching=engine.enable_prefix_caching,
            policy=engine.scheduling_policy, data_shards=self.data_shards),
            fanout=engine.speculative_method == "none")
        self._slot_configs: list[SamplingConfig | None] = [None] * engine.max_slots
        self._sampling = SamplingParams.from_configs(self._slot_configs)
        self._inflight: _Inflight | None = None
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_calls = 0
        self.num_input_tokens = 0  # prompt tokens of the requests added
        self.num_output_tokens = 0  # tokens streamed
        self._first_step: float | None = None
        self.max_context = min(cache.max_seq_len,
                               num_pages // self.data_shards * cache.page_size)
        self.drafter = self._make_drafter(model, draft_model)
        self.spec_rows = 0  # verification rows (one per decoding request per step)
        self.spec_drafted = 0  # draft tokens proposed and verified
        self.spec_accepted = 0  # ... and accepted
        self.spec_verify_calls = 0  # verify_step calls (a step without drafts decodes plainly)
        # Verifications of host drafts (n-gram: rows draft 0..R tokens) feed the weight matmuls
        # a ragged batch (one row per real token, `verify_step`'s num_rows) with the XLA
        # attention path (CPU) and more than one slot: there the matmuls are compute-bound at
        # batch 8 and padding rows cost time. With the Pallas kernels (TPU/GPU) they are bound
        # by reading the weights, padding rows are nearly free, and the padded layout needs
        # fewer compiled variants; model drafters draft R for nearly every row.
        self.ragged_verify = (self.drafter is not None and self.drafter.one_hot
                              and self.attention_impl == "xla" and engine.max_slots > 1)
        self.spec_ragged_rows = 0  # flat rows those verifications needed (before bucketing)

    def _make_drafter(self, model: Llama, draft_model: Llama | None):
        e = self.engine_config
        method = e.speculative_method
        if draft_model is not None and method != "draft":
            raise ValueError(f"a draft model was given but speculative_method={method!r}; "
                             "use speculative_method='draft'")
        if method == "none":
            return None
        if method == "ngram":
            return speculative.NGramDrafter(e.ngram_max, e.ngram_min)
        args = (self.cache_config, e.max_slots, self.mesh, self.attention_impl)
        if method == "draft":
            if draft_model is None:
                raise ValueError("speculative_method='draft' needs a draft model "
                                 "(--draft_model_path)")
            return speculative.ModelDrafter.from_model(draft_model, self.config, *args)
        layers = e.self_spec_layers or max(1, self.config.num_layers // 4)
        return speculative.ModelDrafter.self_speculative(self.params, self.config, layers, *args)

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
        ids = encode_prompt(self.tokenizer, self.config.vocab_size, prompt, chat=chat,
                            system=system)
        if sampling.top_logprobs > self.engine_config.max_top_logprobs:
            raise ValueError(f"top_logprobs={sampling.top_logprobs} exceeds the engine's "
                             f"max_top_logprobs={self.engine_config.max_top_logprobs}")
        total = len(ids) + sampling.max_new_tokens
        if total > self.cache_config.max_seq_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
                f"{total} exceeds the context of {self.cache_config.max_seq_len} tokens "
                f"(cache max_seq_len; model max_position={self.config.max_position})")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests or f"{rid}/0" in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        eos = (frozenset() if sampling.ignore_eos or self.tokenizer is None
               else frozenset(self.tokenizer.eos_ids))
        penalties = (sampling.repetition_penalty != 1.0 or sampling.presence_penalty != 0.0
                     or sampling.frequency_penalty != 0.0)
        arrival = time.perf_counter() if arrival is None else arrival

        def make(request_id, sc, **kw) -> Request:
            req = Request(
                request_id=request_id, prompt_ids=ids, max_new_tokens=sc.max_new_tokens,
                params=sc, eos_ids=eos, stop=sc.stop,
                detokenizer=IncrementalDecoder(self.tokenizer) if self.tokenizer else None,
                # Penalties need every token of the sequence to pass through the step once.
                cacheable=not penalties, arrival=arrival, **kw)
            req.logprobs = [] if sc.logprobs else None
            req.top_logprobs = [] if sc.top_logprobs else None
            return req

        if sampling.n == 1:
            self.scheduler.add(make(rid, sampling))
        else:
            parent = None
            if not penalties and len(ids) >= 2:
                parent = Request(request_id=f"{rid}/prefill", prompt_ids=ids,
                                 max_new_tokens=1, prefill_only=True, arrival=arrival,
                                 children_left=sampling.n)
            samples = [make(sid, dataclasses.replace(sampling, n=1, seed=sampling.seed + i),
                            fork_of=parent)
                       for i, sid in enumerate(self.sample_ids(rid, sampling.n))]
            # Validate every request before queueing any (a bad request changes nothing).
            for req in [parent, *samples] if parent else samples:
                self.scheduler.check(req)
            for req in [parent, *samples] if parent else samples:
                self.scheduler.add(req)
        self.num_input_tokens += len(ids) * sampling.n
        return rid

    @staticmethod
    def sample_ids(request_id: str, n: int) -> list[str]:
        """The ids of the n samples of a request added with `SamplingConfig(n=n)` (n > 1)."""
        return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]

    def abort(self, request_id: str) -> None:
        """Ends a request now ("abort"); its pages and slot are free for the next step."""
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def result(self, request_id: str) -> Completion:
        req = self.scheduler.requests[request_id]
        return Completion(
            prompt_ids=req.prompt_ids, token_ids=list(req.output_ids), text=req.text,
            finish_reason=req.finish_reason or req.status, logprobs=req.logprobs,
            top_logprobs=req.top_logprobs, error=req.error,
            metrics=RequestMetrics(arrival=req.arrival, token_times=list(req.token_times),
                                   prompt_computed=req.prompt_computed,
                                   prompt_reused=req.prompt_reused,
                                   num_preemptions=req.num_preemptions,
                                   spec_drafted=req.spec_drafted,
                                   spec_accepted=req.spec_accepted))

    def forget(self, request_id: str) -> None:
        """Drops a finished request's record (a long-running server calls this after reading
        its result)."""
        req = self.scheduler.requests[request_id]
        if not req.finished:
            raise ValueError(f"request {request_id!r} is {req.status}, not finished")
        del self.scheduler.requests[request_id]

    # ----- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and dispatches one step, then collects the previous step's tokens."""
        if self._first_step is None:
            self._first_step = time.perf_counter()
        if self.drafter is not None:
            return self._spec_step()
        schedule = self.scheduler.schedule()
        launched = self._dispatch(schedule) if schedule.chunks else None
        events = self._collect(self._inflight) if self._inflight is not None else []
        self._inflight = launched
        self.num_steps += 1
        return events

    def stream(self) -> Iterator[RequestOutput]:
        """Steps until every request has finished, yielding each token as it arrives."""
        while self.has_unfinished():
            yield from self.step()

    def run(self) -> None:
        for _ in self.stream():
            pass

    def _sync_slots(self) -> None:
        configs = [None] * self.engine_config.max_slots
        for req in self.scheduler.running:
            configs[req.slot] = req.params
        if configs != self._slot_configs:
            self._slot_configs = configs
            self._sampling = SamplingParams.from_configs(configs)

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Runs a step's copy-on-write page copies (forks) on the device, before its chunks,
        in the target's pool and a model drafter's."""
        if not copies:
            return
        trash = self.kv.k_pages[0].shape[1] - 1  # padding (with more data shards: the last's)
        n = max(8, 1 << (len(copies) - 1).bit_length())  # few static sizes
        src = np.full((n,), trash, np.int32)
        dst = np.full((n,), trash, np.int32)
        src[:len(copies)], dst[:len(copies)] = zip(*copies)
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            self.kv = steps.copy_pages(self.kv, src, dst)
            if isinstance(self.drafter, speculative.ModelDrafter):
                self.drafter.kv = steps.copy_pages(self.drafter.kv, src, dst)

    def _dispatch(self, schedule: SchedulerOutput) -> _Inflight:
        b = self.engine_config.max_slots
        pages_per_seq = self.cache_config.pages_per_seq
        self._copy_pages(schedule.copies)
        self._sync_slots()
        table = np.zeros((b, pages_per_seq), np.int32)
        for req in self.scheduler.running:
            table[req.slot, :len(req.pages)] = req.pages
        decode = np.zeros((b,), bool)
        decode_pos = np.zeros((b,), np.int32)
        host = np.zeros((b,), bool)
        host_tokens = np.zeros((b,), np.int32)
        rows = []
        for c in self._decode_rows(schedule):
            decode[c.slot] = True
            decode_pos[c.slot] = c.start
            if not c.is_decode:
                host[c.slot], host_tokens[c.slot] = True, c.tokens[0]
            rows.append((c.request, 0, c.slot))
        outputs = []
        for i, (chunk, size, pages) in enumerate(self._calls(schedule)):
            fanout = None
            if chunk is None:
                chunk_args = (np.zeros((0,), np.int32), 0, 0, 0, False, False, 0)
            else:
                tokens = np.zeros((size,), np.int32)
                tokens[:chunk.num_tokens] = chunk.tokens
                chunk_args = (tokens, chunk.slot, chunk.start, chunk.num_tokens, chunk.samples,
                              chunk.start == 0, len(chunk.request.prompt_ids))
                if chunk.samples:
                    rows.append((chunk.request, i, b))
                # Forked samples that take their first token from this chunk's last logits.
                for child, parent in schedule.fanouts:
                    if parent is chunk.request:
                        if fanout is None:
                            fanout = np.zeros((b,), bool)
                        fanout[child.slot] = True
                        decode_pos[child.slot] = child.num_computed  # = the prompt's length
                        rows.append((child, i, child.slot))
            first = i == 0
            batch = _batch(table, decode if first else np.zeros_like(decode), decode_pos,
                           *chunk_args, host=host if first else None, host_tokens=host_tokens,
                           fanout=fanout)
            outputs.append(self._run_step(batch, pages))
            self.num_calls += 1
        self._copy_pages(schedule.post_copies)
        return _Inflight(schedule, outputs, rows)

    # ----- speculative decoding ---------------------------------------------------------------
    def _spec_step(self) -> list[RequestOutput]:
        """A step with speculation: prompt chunks run as `mixed_step` calls without decode rows
        (mirrored into a model drafter's pool), and every decoding request is verified with its
        drafts in one `verify_step`. Drafting needs the newest tokens on the host, so this step
        is synchronous: it collects its own results (no lookahead)."""
        schedule = self.scheduler.schedule()
        self.num_steps += 1
        if not schedule.chunks:
            return []
        e = self.engine_config
        b, r = e.max_slots, e.num_speculative_tokens
        ps, pages_per_seq = self.cache_config.page_size, self.cache_config.pages_per_seq
        self._copy_pages(schedule.copies)
        self._sync_slots()
        rows = []
        for c in schedule.decodes:
            req = c.request
            room = req.max_new_tokens - len(req.output_ids) - 1
            extra = self.scheduler.reserve_lookahead(req, min(r, room)) if room > 0 else 0
            rows.append(speculative.DraftRow(c.slot, req.known_tokens(), c.start, extra))
        table = np.zeros((b, pages_per_seq), np.int32)
        for req in self.scheduler.running:
            table[req.slot, :len(req.pages)] = req.pages
        outputs, sampled = [], []
        idle = np.zeros((b,), bool)
        for chunk, size, pages in self._calls(dataclasses.replace(schedule, chunks=[
                c for c in schedule.chunks if not c.is_decode])):
            if chunk is None:
                continue
            tokens = np.zeros((size,), np.int32)
            tokens[:chunk.num_tokens] = chunk.tokens
            batch = _batch(table, idle, np.zeros((b,), np.int32), tokens, chunk.slot,
                           chunk.start, chunk.num_tokens, chunk.samples, chunk.start == 0,
                           len(chunk.request.prompt_ids))
            outputs.append(self._run_step(batch, pages))
            self.drafter.mirror(batch, pages, self._sampling)
            self.num_calls += 1
            if chunk.samples:
                sampled.append((chunk.request, len(outputs) - 1))
        verify = plain = None
        if rows:
            pages = pages_bucket(max(row.pos + row.max_draft + 1 for row in rows), ps,
                                 pages_per_seq)
            ids, probs, num = self.drafter.propose(rows, r, b, table, self._sampling, pages)
            active = np.zeros((b,), bool)
            pos = np.zeros((b,), np.int32)
            for row in rows:
                active[row.slot], pos[row.slot] = True, row.pos
            width = r
            if self.drafter.one_hot:  # host drafts: verify only as wide as the longest
                longest = int(num.max())
                width = next(w for w in self.spec_widths() if w >= longest) if longest else 0
            if width == 0:  # nothing drafted: a plain decode step (one row per request)
                batch = _batch(table, active, pos, np.zeros((0,), np.int32), 0, 0, 0, False,
                               False, 0)
                plain = self._run_step(batch, pages_bucket(int(pos.max()) + 1, ps,
                                                           pages_per_seq))
            else:
                self.spec_verify_calls += 1
                vb = steps.VerifyBatch(page_table=table, active=active, pos=pos,
                                       draft_ids=np.asarray(ids)[:, :width] if
                                       self.drafter.one_hot else ids, num_draft=num)
                num_rows = 0
                if self.ragged_verify:  # one flat row per real token, not B x (width + 1)
                    need = sum(int(num[row.slot]) + 1 for row in rows)
                    self.spec_ragged_rows += need
                    num_rows = steps.ragged_rows(need, b, width)
                with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
                    self.kv, self.state, verify = steps.verify_step(
                        self.graph, self.params, self.kv, self.state, self._sampling, vb, probs,
                        num_pages_read=pages, num_top_logprobs=e.max_top_logprobs,
                        attention_impl=self.attention_impl, num_rows=num_rows)
            self.num_calls += 1
        host_outputs, host_verify, host_plain, num = jax.device_get(
            (outputs, verify, plain, num if rows else None))
        now = time.perf_counter()
        items = []
        for req, call in sampled:
            self._record_logprobs(req, host_outputs[call], b)
            items.append((req, int(host_outputs[call].tokens[b])))
        if host_plain is not None:
            for c in schedule.decodes:
                self.spec_rows += 1
                self._record_logprobs(c.request, host_plain, c.slot)
                items.append((c.request, int(host_plain.tokens[c.slot])))
            host_verify = None
        for c in schedule.decodes if host_verify is not None else ():
            req, slot = c.request, c.slot
            n = int(host_verify.num_emitted[slot])
            toks = [int(t) for t in host_verify.tokens[slot, :n]]
            self.spec_rows += 1
            self.spec_drafted += int(num[slot])
            self.spec_accepted += n - 1
            req.spec_drafted += int(num[slot])
            req.spec_accepted += n - 1
            for j in range(n):
                self._record_logprobs(req, host_verify, (slot, j))
            items.append((req, toks))
        events = self.scheduler.update(items, now)
        self.num_output_tokens += len(events)
        return [RequestOutput(ev.request.request_id, ev.token, ev.text, ev.finished,
                              ev.request.finish_reason) for ev in events]

    def spec_widths(self) -> list[int]:
        """Verification widths (drafts per row) a host drafter's step may use: powers of two
        below R, and R. A step verifies at the smallest width covering its longest draft, so
        rows without a match do not pay for R + 1 query rows (model drafters: always R)."""
        r = self.engine_config.num_speculative_tokens
        if not self.drafter.one_hot:
            return [r]
        return [w for w in (1 << i for i in range(r.bit_length())) if w < r] + [r]

    def _record_logprobs(self, req: Request, out, row) -> None:
        """Appends the logprobs of one sampled token (`out`: host SampleOutput or VerifyOutput;
        `row`: its index) to the request, if it asked for them."""
        if req.finished:
            return
        if req.logprobs is not None:
            req.logprobs.append(float(out.logprobs[row]))
        if req.top_logprobs is not None:
            n = req.params.top_logprobs
            req.top_logprobs.append([(int(t), float(lp)) for t, lp in zip(
                out.top_ids[row][:n], out.top_logprobs[row][:n])])

    def _run_step(self, batch: steps.MixedBatch, pages: int):
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            self.kv, self.state, out = steps.mixed_step(
                self.graph, self.params, self.kv, self.state, self._sampling, batch,
                num_pages_read=pages, num_top_logprobs=self.engine_config.max_top_logprobs,
                attention_impl=self.attention_impl)
        return out

    def _decode_rows(self, schedule: SchedulerOutput) -> list[Chunk]:
        """Chunks run as decode rows: decodes, and one-token prompt chunks that sample, of
        requests without penalties (their slot's penalty state is never read), with the token
        from the host — so n forked samples' last prompt tokens cost one call, not n."""
        if self.drafter is not None:
            return schedule.decodes
        return [c for c in schedule.chunks if c.is_decode or (
            c.num_tokens == 1 and c.samples and c.request.cacheable)]

    def _calls(self, schedule: SchedulerOutput) -> list[tuple[Chunk | None, int, int]]:
        """The `mixed_step` calls of a step: (prompt chunk or None, chunk bucket, page bucket).
        One call per chunk; the decode rows ride with the first."""
        ps, pages_per_seq = self.cache_config.page_size, self.cache_config.pages_per_seq
        rows = self._decode_rows(schedule)
        longest = max((c.start + 1 for c in rows), default=0)
        prefills = [c for c in schedule.chunks if not any(c is r for r in rows)]
        calls = []
        for i, chunk in enumerate(prefills or [None]):
            if chunk is None:
                calls.append((None, 0, pages_bucket(longest, ps, pages_per_seq)))
                continue
            size = next(s for s in self.engine_config.prefill_buckets if s >= chunk.num_tokens)
            end = max(longest if i == 0 else 0, chunk.start + chunk.num_tokens)
            calls.append((chunk, size, pages_bucket(end, ps, pages_per_seq)))
        return calls

    def _collect(self, inflight: _Inflight) -> list[RequestOutput]:
        host = jax.device_get(inflight.outputs)  # the step's one transfer to the host
        now = time.perf_counter()
        sampled = []
        for req, call, row in inflight.rows:
            out = host[call]
            self._record_logprobs(req, out, row)
            sampled.append((req, int(out.tokens[row])))
        events = self.scheduler.update(sampled, now)
        self.num_output_tokens += len(events)
        return [RequestOutput(e.request.request_id, e.token, e.text, e.finished,
                              e.request.finish_reason) for e in events]

    # ----- warm-up and metrics ----------------------------------------------------------------
    def step_variants(self, max_len: int | None = None) -> list[tuple[int, int]]:
        """(chunk bucket, page bucket) of every `mixed_step` variant that requests of at most
        `max_len` tokens (default: the cache's max_seq_len) can use."""
        ps, pages_per_seq = self.cache_config.page_size, self.cache_config.pages_per_seq
        max_len = min(max_len or self.max_context, self.max_context)
        chunk = self.engine_config.chunk_size
        buckets = [s for s in self.engine_config.prefill_buckets if s < chunk]
        buckets.append(next(s for s in self.engine_config.prefill_buckets if s >= chunk))
        top = pages_bucket(max_len, ps, pages_per_seq)
        pages = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
        if top not in pages:
            pages.append(top)
        return [(t, p) for t in [0, *buckets] for p in pages]

    def planned_variants(self, workload: Sequence[tuple[Sequence[int], SamplingConfig]]
                         ) -> list[tuple[int, int]]:
        """The step variants that serving `workload` (all added at once, each running to its
        max_new_tokens) uses, found by a dry run of the host scheduler: no device work. An
        earlier EOS can change which chunk meets which page bucket; such a step compiles
        when it first occurs."""
        c = self.scheduler.config
        dry = Scheduler(c, fanout=self.scheduler.fanout)
        for i, (ids, sc) in enumerate(workload):
            penalties = (sc.repetition_penalty != 1.0 or sc.presence_penalty != 0.0
                         or sc.frequency_penalty != 0.0)
            parent = None
            if sc.n > 1 and len(ids) >= 2 and not penalties:  # as add_request forks
                parent = Request(request_id=f"{i}/prefill", prompt_ids=list(ids),
                                 max_new_tokens=1, prefill_only=True, children_left=sc.n)
                dry.add(parent)
            for j in range(sc.n):
                dry.add(Request(request_id=f"{i}/{j}", prompt_ids=list(ids),
                                max_new_tokens=sc.max_new_tokens, fork_of=parent))
        variants, previous = set(), []
        while dry.has_unfinished() or previous:
            schedule = dry.schedule()
            if schedule.chunks:
                variants.update((size, pages) for _, size, pages in self._calls(schedule))
            dry.update(previous)
            previous = [(ch.request, 0) for ch in schedule.chunks if ch.samples]
            previous += [(child, 0) for child, _ in schedule.fanouts]
        return sorted(variants)

    def warmup(self, max_len: int | None = None, *,
               workload: Sequence[tuple[Sequence[int], SamplingConfig]] | None = None) -> int:
        """Compiles step variants on dummy rows that write only the trash page; returns how
        many. Default: every variant requests of up to `max_len` tokens can use
        (`step_variants`), after which serving compiles nothing. With `workload`: just the
        ones that workload uses (`planned_variants`)."""
        if self.has_unfinished():
            raise RuntimeError("warmup() must run before any request is added")
        b, pages_per_seq = self.engine_config.max_slots, self.cache_config.pages_per_seq
        table = np.zeros((b, pages_per_seq), np.int32)
        idle = np.zeros((b,), bool)
        variants = (self.planned_variants(workload) if workload is not None
                    else self.step_variants(max_len))
        if self.drafter is not None and not self.drafter.one_hot:  # decodes: verify_step
            variants = [(size, pages) for size, pages in variants if size > 0]
        prefill = []
        for size, pages in variants:
            batch = _batch(table, idle, np.zeros((b,), np.int32), np.zeros((size,), np.int32),
                           0, 0, 0, False, False, 0)
            self._run_step(batch, pages)
            prefill.append((batch, pages))
        trash = self.kv.k_pages[0].shape[1] - 1
        self._copy_pages([(trash, trash)])  # forks
        n = len(variants)
        if self.drafter is not None:
            if workload is not None and max_len is None:
                max_len = max(len(ids) + sc.max_new_tokens for ids, sc in workload)
            n += self._warmup_spec(max_len, prefill)
        jax.block_until_ready((self.kv, self.state))
        return n

    def _warmup_spec(self, max_len: int | None, prefill) -> int:
        """Compiles verify_step (and the drafter's steps) for every page bucket a verification
        of requests of at most `max_len` tokens can read."""
        e, c = self.engine_config, self.cache_config
        b, r = e.max_slots, e.num_speculative_tokens
        top = pages_bucket(min(max_len or self.max_context, self.max_context), c.page_size,
                           c.pages_per_seq)
        buckets = sorted({pages_bucket(n, c.page_size, c.pages_per_seq)
                          for n in range(1, top * c.page_size + 1, c.page_size)})
        table = np.zeros((b, c.pages_per_seq), np.int32)
        zeros = np.zeros((b,), np.int32)
        n = 0
        for width in self.spec_widths():
            vb = steps.VerifyBatch(page_table=table, active=np.zeros((b,), bool), pos=zeros,
                                   draft_ids=np.zeros((b, width), np.int32), num_draft=zeros)
            probs = None if self.drafter.one_hot else np.zeros(
                (b, width, self.config.vocab_size), np.float32)
            sizes = [0]
            if self.ragged_verify:
                sizes = sorted({steps.ragged_rows(k, b, width)
                                for k in range(1, b * (width + 1) + 1)})
            for pages, num_rows in itertools.product(buckets, sizes):
                with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
                    self.kv, self.state, _ = steps.verify_step(
                        self.graph, self.params, self.kv, self.state, self._sampling, vb,
                        probs, num_pages_read=pages, num_top_logprobs=e.max_top_logprobs,
                        attention_impl=self.attention_impl, num_rows=num_rows)
                n += 1
        self.drafter.warmup(r, b, c.pages_per_seq, buckets, self._sampling, prefill)
        return n

    def stats(self) -> dict:
        """Scheduler counters (running/waiting, pages, preemptions, prefix hits, token rows),
        the engine's step and device-call counts, and input/output tokens per second since the
        first step."""
        elapsed = time.perf_counter() - self._first_step if self._first_step else 0.0
        spec = {}
        if self.drafter is not None:
            spec = {"spec_verify_rows": self.spec_rows, "spec_verify_calls": self.spec_verify_calls,
                    "spec_drafted_tokens": self.spec_drafted,
                    "spec_ragged_rows": self.spec_ragged_rows,
                    "spec_accepted_tokens": self.spec_accepted,
                    "acceptance_rate": self.spec_accepted / max(self.spec_drafted, 1),
                    # tokens a verification row emits: accepted drafts + the correction/bonus
                    "mean_accepted_length": (self.spec_accepted + self.spec_rows)
                    / max(self.spec_rows, 1)}
        return {**self.scheduler.stats(), **spec, "steps": self.num_steps,
                "device_calls": self.num_calls,
                "input_tokens": self.num_input_tokens, "output_tokens": self.num_output_tokens,
                "input_throughput": self.num_input_tokens / elapsed if elapsed else 0.0,
                "output_throughput": self.num_output_tokens / elapsed if elapsed else 0.0}


def _batch(table, decode, decode_pos, tokens, slot, start, length, samples, fresh,
           prompt_len, host=None, host_tokens=None, fanout=None) -> steps.MixedBatch:
    b = decode.shape[0]
    return steps.MixedBatch(
        page_table=table, decode=decode, decode_pos=decode_pos,
        fanout=np.zeros((b,), bool) if fanout is None else fanout,
        decode_host=np.zeros((b,), bool) if host is None else host,
        decode_tokens=np.zeros((b,), np.int32) if host_tokens is None else host_tokens,
        chunk_tokens=tokens,
        chunk_slot=np.int32(slot), chunk_start=np.int32(start), chunk_len=np.int32(length),
        chunk_samples=np.bool_(samples), chunk_fresh=np.bool_(fresh),
        chunk_prompt_len=np.int32(prompt_len))


class LLM:
    """Offline batch generation on the engine: `LLM(model, tokenizer).generate(prompts)`."""

    def __init__(self, model: Llama, tokenizer: Tokenizer | None, *,
                 cache: CacheConfig | None = None, engine: EngineConfig | None = None,
                 mesh: Mesh | None = None, draft_model: Llama | None = None):
        self.engine = Engine(model, tokenizer, cache=cache, engine=engine, mesh=mesh,
                             draft_model=draft_model)

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 sampling: SamplingConfig | Sequence[SamplingConfig] = GREEDY, *,
                 chat: bool = False, system: str | None = None, use_tqdm: bool = True,
                 raise_on_error: bool = True,
                 on_output: Callable[[int, RequestOutput], None] | None = None
                 ) -> list[Completion]:
        """Runs every prompt to completion; results in prompt order. A prompt whose sampling
        has n > 1 contributes n Completions in a row (sample i seeded seed + i; its prompt is
        prefilled once, see `Engine.add_request`).

        raise_on_error: bad input raises ValueError (naming the prompt) before anything runs;
        with False a bad request gets finish_reason "error" and the others run.
        on_output: streaming callback (result index, RequestOutput) for every token.
        """
        prompts, configs = batch_of(prompts, sampling)
        ids: list[str | None] = []  # one per sample
        owner: list[int] = []  # prompt index of each sample
        errors: dict[int, str] = {}
        for i, (p, sc) in enumerate(zip(prompts, configs)):
            try:
                rid = self.engine.add_request(p, sc, chat=chat, system=system)
                ids.extend(self.engine.sample_ids(rid, sc.n))
            except ValueError as e:
                if raise_on_error:
                    for rid in ids:
                        self.engine.abort(rid)
                    self.engine.run()
                    raise ValueError(f"prompt {i}: {e}") from None
                ids.extend([None] * sc.n)
                errors[i] = str(e)
            owner.extend([i] * sc.n)
        progress = _Progress(sum(r is not None for r in ids)) if use_tqdm else None
        index = {rid: i for i, rid in enumerate(ids) if rid is not None}
        for event in self.engine.stream():
            if on_output is not None:
                on_output(index[event.request_id], event)
            if progress is not None:
                progress.update(event)
        if progress is not None:
            progress.close()
        results = []
        for i, rid in enumerate(ids):
            if rid is None:
                results.append(Completion(prompt_ids=[], token_ids=[], text="",
                                          finish_reason="error", error=errors[owner[i]]))
            else:
                results.append(self.engine.result(rid))
                self.engine.forget(rid)
        return results


class _Progress:
    """A dependency-free progress bar on stderr: requests done, output tok/s."""

    def __init__(self, total: int):
        self.total, self.done, self.tokens = total, 0, 0
        self.start = self.last = time.perf_counter()

    def update(self, event: RequestOutput) -> None:
        self.tokens += 1
        self.done += event.finished
        now = time.perf_counter()
        if now - self.last > 0.25 or self.done == self.total:
            self.last = now
            width = 30
            fill = width * self.done // max(self.total, 1)
            rate = self.tokens / max(now - self.start, 1e-9)
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                             f"requests, {rate:.1f} output tok/s")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
