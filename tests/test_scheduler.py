"""Scheduler, page pool and prefix cache without a device (jaxinfer.engine's scheduler, request
and pages modules import no jax).

`SimDevice` drives a `Scheduler` exactly as `Engine.step` does, one-step lookahead included, over
a host KV pool `kv[page][offset] = (position, token)`. A sampled token is a hash of the sequence
read back from that pool through the request's pages, so a wrong page, a page shared or written
wrongly, or a wrong recompute changes the outputs (or fails an assert) against `ideal`, the same
function run as a plain loop over one request.
"""

from __future__ import annotations

import collections
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.config import local_pages_bound
from jaxinfer.engine.pages import PagePool, PrefixCache, usable_blocks
from jaxinfer.engine.request import RUNNING, WAITING, Request, held_back, release_rest
from jaxinfer.engine.sched_state import SchedulerConfig
from jaxinfer.engine.scheduler import Scheduler, admission_reserve

VOCAB = 13  # sampled tokens; prompts use a smaller alphabet so that prefixes are shared
REPO = pathlib.Path(__file__).resolve().parents[1]


def next_token(seq) -> int:
    """The simulated model: a deterministic function of the whole sequence."""
    return (hash(tuple(seq)) * 0x9E3779B1 >> 16) % VOCAB


def char(token: int) -> str:
    return chr(97 + token % 26)


class Detok:
    """A fake incremental detokenizer: token t is the letter chr(97 + t % 26)."""

    def __init__(self, fail_on: int | None = None):
        self.fail_on = fail_on

    def push(self, token: int) -> str:
        if token == self.fail_on:
            raise RuntimeError(f"cannot decode token {token}")
        return char(token)

    def flush(self) -> str:
        return ""


def ideal(prompt, max_new, eos=(), stop=()):
    """(output ids, text, finish reason) of one request run alone, without any scheduler."""
    seq, out, text = list(prompt), [], ""
    while True:
        tok = next_token(seq)
        seq.append(tok)
        out.append(tok)
        if tok in eos:
            return out, text, "eos"
        text += char(tok)
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return out, text[:min(hits)], "stop"
        if len(out) >= max_new:
            return out, text, "length"


def make(rid, prompt, max_new, **kw) -> Request:
    return Request(request_id=rid, prompt_ids=list(prompt), max_new_tokens=max_new, **kw)


def config(**kw) -> SchedulerConfig:
    base = dict(max_slots=4, token_budget=16, chunk_size=8, page_size=4, num_pages=64,
                pages_per_seq=16)
    return SchedulerConfig(**{**base, **kw})


Step = collections.namedtuple("Step", "out admitted running_before")


class SimDevice:
    """The engine's loop over a simulated device: each `step()` schedules, "dispatches" (writes
    every chunk's K/V into the host pool, samples from what the pool reads back), then hands the
    PREVIOUS step's samples to `update()` and keeps this step's in flight."""

    def __init__(self, sched: Scheduler):
        self.sched, cfg = sched, sched.config
        self.ps = cfg.page_size
        # Every page id of the device pool: the data shards' parts, each with a trash page.
        self.kv = [[None] * cfg.page_size
                   for _ in range(cfg.data_shards * (cfg.pages_per_shard + 1))]
        # Hybrid: the local layers' pool, which holds each sequence's window only.
        self.local_kv = [[None] * cfg.page_size
                         for _ in range(cfg.num_local_pages + cfg.data_shards)]
        self.slot_tokens = [None] * cfg.max_slots  # SlotState.tokens: each slot's newest sample
        self.truth: dict[str, list[int]] = {}  # prompt + every token sampled for the request
        self.inflight: list | None = None  # the previous step's (request, token) samples
        self.history: list[Step] = []
        self.events: list = []

    def busy(self) -> bool:
        return self.sched.has_unfinished() or self.inflight is not None

    def step(self):
        sched = self.sched
        was_waiting, was_running = list(sched.waiting), list(sched.running)
        decoding = [r for r in sched.running if r.device_token and not r.done_sampling()]
        out = sched.schedule()
        assert out.num_tokens <= sched.config.token_budget, out.num_tokens
        assert len(sched.running) <= sched.config.max_slots
        for r in decoding:  # a decoding request gets one token per step unless preempted
            mine = [c for c in out.chunks if c.request is r]
            assert r in out.preempted or [(c.num_tokens, c.is_decode) for c in mine] == [
                (1, True)], (r.request_id, mine)
        launched = self._dispatch(out) if out.chunks else None
        events = sched.update(self.inflight) if self.inflight is not None else []
        self.inflight = launched
        admitted = [r for r in was_waiting if r.status == RUNNING]
        self.history.append(Step(out, admitted, was_running))
        self.events += events
        return out, events

    def _dispatch(self, out) -> list:
        sched, ps = self.sched, self.ps
        holders = collections.defaultdict(set)
        for r in sched.running:
            for p in r.pages:
                holders[p].add(r.request_id)
        cached = {p for pool in sched.pools if pool.cache is not None for p in pool.cache.nodes}
        for src, dst in out.copies:  # copy-on-write of forks, before the step's chunks
            self.kv[dst] = list(self.kv[src])
        for src, dst in out.local_copies:
            self.local_kv[dst] = list(self.local_kv[src])
        # Samples fanned out of a parent's last chunk hold its full pages already; they read
        # them only in later steps.
        fanned = collections.defaultdict(set)
        for child, parent in out.fanouts:
            fanned[parent.request_id].add(child.request_id)
        writer, sampled = {}, []
        # As Engine._dispatch: the decode rows ride with the first prompt chunk, then one call
        # per further chunk; a call writes all its rows before any of them reads.
        for call in [out.decodes + out.prefills[:1]] + [[c] for c in out.prefills[1:]]:
            for c in call:
                req = c.request
                assert req.status == RUNNING and c.slot == req.slot, req.request_id
                assert c.num_tokens <= (1 if c.is_decode else sched.config.chunk_size)
                self.truth.setdefault(req.request_id, list(req.prompt_ids))
                tokens = [self.slot_tokens[c.slot]] if c.is_decode else c.tokens
                assert len(tokens) == c.num_tokens > 0
                for pos, tok in enumerate(tokens, c.start):
                    page = req.pages[pos // ps]
                    assert writer.setdefault(page, req.request_id) == req.request_id, (
                        f"page {page} written by {writer[page]} and {req.request_id}")
                    assert holders[page] - fanned[req.request_id] == {req.request_id}, (
                        page, holders[page])
                    assert page not in cached, f"{req.request_id} writes cached page {page}"
                    self.kv[page][pos % ps] = (pos, tok)
                    if sched.config.hybrid:
                        self._write_local(req, pos, tok, writer, fanned[req.request_id])
            for c in call:  # every query of the chunk sees its window in the local pool
                if sched.config.hybrid:
                    self._read_local(c)
            new = {}
            for c in call:
                if not c.samples:
                    continue
                req, end = c.request, c.start + c.num_tokens
                truth = self.truth[req.request_id]
                read = [self.kv[req.pages[pos // ps]][pos % ps] for pos in range(end)]
                assert read == [(pos, truth[pos]) for pos in range(end)], req.request_id
                tok = next_token([t for _, t in read])
                if end == len(truth):
                    truth.append(tok)
                else:
                    assert truth[end] == tok, (req.request_id, end)
                new[c.slot] = tok
                sampled.append((req, tok))
            for c in call:  # forked samples draw their first token from the parent's chunk
                for child, parent in out.fanouts:
                    if parent is not c.request:
                        continue
                    end = c.start + c.num_tokens
                    assert end == len(parent.prompt_ids) == len(child.prompt_ids)
                    assert child.num_computed == end and child.slot not in new
                    read = [self.kv[parent.pages[pos // ps]][pos % ps] for pos in range(end)]
                    assert read == [(pos, t) for pos, t in enumerate(parent.prompt_ids)]
                    tok = next_token([t for _, t in read])
                    truth = self.truth.setdefault(child.request_id, list(child.prompt_ids))
                    if end == len(truth):
                        truth.append(tok)
                    else:
                        assert truth[end] == tok, (child.request_id, end)
                    new[child.slot] = tok
                    sampled.append((child, tok))
            for slot, tok in new.items():
                self.slot_tokens[slot] = tok
        assert len(sampled) == sum(c.samples for c in out.chunks) + len(out.fanouts)
        for src, dst in out.post_copies:  # after the step: the source was written by it
            self.kv[dst] = list(self.kv[src])
        for src, dst in out.local_post_copies:
            self.local_kv[dst] = list(self.local_kv[src])
        return sampled

    def _write_local(self, req, pos, tok, writer, fanned) -> None:
        """A hybrid pool's local write: into the request's own local page of that block (samples
        fanned out of it in this step hold its pages too; they read them only later)."""
        sched, ps = self.sched, self.ps
        page = req.local_pages[pos // ps]
        assert page is not None, (req.request_id, pos)
        assert writer.setdefault(("local", page), req.request_id) == req.request_id, page
        others = {r.request_id for r in sched.running + sched.forking
                  if page in r.local_pages and r is not req}
        assert not others - fanned, (req.request_id, page, others)
        assert not any(page in pool.cache for pool in sched.local_pools
                       if pool.cache is not None), (req.request_id, "cached local", page)
        self.local_kv[page][pos % ps] = (pos, tok)

    def _read_local(self, c) -> None:
        """What the chunk's queries read from the local pool: positions from the window of its
        first query to its last, each held by the request and holding its token."""
        req, ps, window = c.request, self.ps, self.sched.config.window
        truth = self.truth[req.request_id]
        for pos in range(max(0, c.start - window + 1), c.start + c.num_tokens):
            page = req.local_pages[pos // ps]
            assert page is not None, (req.request_id, "window page released", pos)
            assert self.local_kv[page][pos % ps] == (pos, truth[pos]), (
                req.request_id, pos, page, self.local_kv[page], req.local_pages)

    def run_until(self, done, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
            check(self.sched)
        raise AssertionError(f"not there after {max_steps} steps")

    def run(self) -> None:
        self.run_until(lambda: not self.busy())


def check(sched: Scheduler) -> None:
    """The scheduler's own invariants, and: a request that holds a cached node holds its
    ancestors too, so every cached page that no request holds can really be evicted (the pool
    counts those pages as available)."""
    sched.check_invariants()
    cfg = sched.config
    if cfg.hybrid:  # the local pages a sequence holds are bounded by its window
        bound = local_pages_bound(cfg.window, cfg.page_size, cfg.chunk_size)
        for r in sched.running + sched.forking:
            assert sum(p is not None for p in r.local_pages) <= bound, (r.request_id, bound)
    if not sched.config.enable_prefix_caching:
        return
    for r in sched.running:
        held, cache = set(r.pages), sched.pools[r.shard].cache
        for page in held & cache.nodes.keys():
            node = cache.nodes[page].parent
            while node is not cache.root:
                assert node.page in held, (r.request_id, page, node.page)
                node = node.parent


def assert_drained(sched: Scheduler) -> None:
    assert not sched.has_unfinished()
    for pool in sched.pools + sched.local_pools:
        assert pool.num_available() == pool.num_pages
        assert not any(pool.refcount)
    assert sorted(sched.free_slots) == list(range(sched.config.max_slots))
    check(sched)


def serve_all(sched, reqs):
    """Adds every request, runs the simulated device to the end, checks each output is the
    ideal one and the pool drained; returns the SimDevice."""
    sim = SimDevice(sched)
    for r in reqs:
        sched.add(r)
    sim.run()
    for r in reqs:
        assert_ideal(r)
    assert_drained(sched)
    return sim


def assert_ideal(req: Request) -> None:
    out, text, reason = ideal(req.prompt_ids, req.max_new_tokens, req.eos_ids, req.stop)
    assert (req.output_ids, req.finish_reason) == (out, reason), req.request_id
    if req.detokenizer is not None:
        assert req.text == text, req.request_id


def chunks_of(sim: SimDevice, req: Request) -> list[tuple[int, int, int, bool]]:
    """(step, start, num_tokens, is_decode) of every chunk of `req`."""
    return [(i, c.start, c.num_tokens, c.is_decode) for i, step in enumerate(sim.history)
            for c in step.out.chunks if c.request is req]


def admissions(sim: SimDevice) -> list[tuple[int, str]]:
    """(step, request id) of every admission (re-admissions after preemption too)."""
    return [(i, r.request_id) for i, step in enumerate(sim.history) for r in step.admitted]


# ----------------------------------------------------------------------------------------------
def test_scheduler_imports_no_jax():
    modules = ("jaxinfer.engine.request, jaxinfer.engine.pages, jaxinfer.engine.forks, "
               "jaxinfer.engine.scheduler")
    code = (f"import sys, {modules}; "
            "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_admission_fcfs_slots_budget_and_chunking():
    sched = Scheduler(config(max_slots=2, token_budget=6, chunk_size=4))
    sim = SimDevice(sched)
    reqs = [make("a", range(10), 3), make("b", [1, 2, 3], 4), make("c", [4, 5], 2),
            make("d", [6] * 5, 2)]
    for r in reqs:
        sched.add(r)
    a, b, c, d = reqs
    out, _ = sim.step()
    # a: a first chunk of chunk_size; b: what the budget leaves; c, d: no slot.
    assert [(x.request.request_id, x.start, x.num_tokens, x.samples) for x in out.chunks] == [
        ("a", 0, 4, False), ("b", 0, 2, False)]
    assert list(sched.waiting) == [c, d] and not sched.free_slots
    sim.run()
    for r in reqs:
        assert_ideal(r)
    assert_drained(sched)
    # FCFS: requests are admitted in arrival order, and never more than max_slots at once.
    assert [rid for _, rid in admissions(sim)] == ["a", "b", "c", "d"]
    assert all(x.num_tokens <= 4 for step in sim.history for x in step.out.chunks)
    assert all(step.out.num_tokens <= 6 for step in sim.history)
    assert all(len(step.running_before) <= 2 for step in sim.history)
    # The long prompt is split into chunks; then one decode token per step, every step, until
    # max_new_tokens (the last sample is never fed back).
    for r in reqs:
        mine = chunks_of(sim, r)
        prefill = [(s, n) for _, s, n, dec in mine if not dec]
        assert sum(n for _, n in prefill) == len(r.prompt_ids)
        assert [s for s, _ in prefill] == [sum(n for _, n in prefill[:i])
                                           for i in range(len(prefill))]
        decodes = [(i, s, n) for i, s, n, dec in mine if dec]
        last_prefill = max(i for i, _, _, dec in mine if not dec)
        assert decodes == [(last_prefill + 1 + k, len(r.prompt_ids) + k, 1)
                           for k in range(r.max_new_tokens - 1)]
    assert [(s, n) for _, s, n, dec in chunks_of(sim, a) if not dec] == [(0, 4), (4, 4), (8, 2)]
    # Prompt chunks ride with decode rows in the same step.
    assert any(step.out.decodes and step.out.prefills for step in sim.history)


def test_token_budget_bounds_a_step():
    sched = Scheduler(config(max_slots=4, token_budget=5, chunk_size=4))
    sim = SimDevice(sched)
    reqs = [make(str(i), [i] * (3 + 2 * i), 4) for i in range(4)]
    for r in reqs:
        sched.add(r)
    sim.run()
    assert max(step.out.num_tokens for step in sim.history) == 5
    for r in reqs:
        assert_ideal(r)
    assert_drained(sched)


def test_eos_finishes_and_drops_the_lookahead_row():
    prompt = [3, 1, 4, 1, 5]
    full, _, _ = ideal(prompt, 12)
    k = next(i for i in range(2, 12) if full[i] not in full[:i])
    sched = Scheduler(config())
    sim = SimDevice(sched)
    r = make("r", prompt, 12, eos_ids=frozenset({full[k]}))
    other = make("o", [2, 7], 6)
    sched.add(r)
    sched.add(other)
    sim.run()
    assert r.output_ids == full[:k + 1] and r.finish_reason == "eos"
    assert [e.finished for e in sim.events if e.request is r] == [False] * k + [True]
    # The EOS token itself was fed back by the step dispatched before the host saw it.
    assert chunks_of(sim, r)[-1][1:] == (len(prompt) + k, 1, True)
    assert r.num_pending == 0
    assert_ideal(other)
    assert_drained(sched)


def test_max_new_tokens_is_exact():
    sched = Scheduler(config())
    sim = SimDevice(sched)
    r = make("r", [1, 2, 3], 5)
    sched.add(r)
    sim.run()
    assert len(r.output_ids) == 5 and r.finish_reason == "length"
    assert len([c for c in chunks_of(sim, r) if c[3]]) == 4  # no row past the length
    assert_ideal(r)
    assert_drained(sched)


def test_stop_string_truncates_text():
    prompt = [2, 2, 1]
    full, text, _ = ideal(prompt, 12)
    i = next(i for i in range(2, 10) if text.find(text[i:i + 2]) == i)
    stop = text[i:i + 2]  # spans tokens i and i + 1
    sched = Scheduler(config())
    sim = SimDevice(sched)
    r = make("r", prompt, 12, detokenizer=Detok(), stop=("#", stop))
    plain = make("p", prompt, 12, detokenizer=Detok())
    sched.add(r)
    sched.add(plain)
    sim.run()
    assert r.finish_reason == "stop" and r.output_ids == full[:i + 2] and r.text == text[:i]
    # Token i's letter (the stop string's first) is held back, then dropped with the stop: the
    # stream adds up to the final text and never showed more.
    streamed = [e.text for e in sim.events if e.request is r]
    assert "".join(streamed) == text[:i] and streamed[-2:] == ["", ""]
    assert plain.finish_reason == "length" and plain.text == text
    assert_ideal(r)
    assert_drained(sched)


class Pieces:
    """A fake detokenizer over a vocabulary of text pieces: token t is pieces[t]. A token in
    `split` completes no text yet (as half a UTF-8 character): its piece comes out with the
    next token's, or from flush()."""

    def __init__(self, pieces: list[str], split: frozenset[int] = frozenset()):
        self.pieces, self.split, self.pending = pieces, split, ""

    def push(self, token: int) -> str:
        self.pending += self.pieces[token]
        if token in self.split:
            return ""
        out, self.pending = self.pending, ""
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def final_text(tokens, pieces, split, stops, eos, max_new) -> tuple[str, str | None]:
    """(final text, finish reason) of `tokens` read one at a time: the whole text, cut where
    the first stop string begins (reason None: the tokens ran out first)."""
    detok, text = Pieces(pieces, split), ""
    for n, t in enumerate(tokens, 1):
        if t == eos:
            return text, "eos"
        text += detok.push(t)
        if n == max_new and not any(s in text for s in stops):
            text += detok.flush()
            if not any(s in text for s in stops):
                return text, "length"
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], "stop"
    return text, None


@st.composite
def streamed_requests(draw):
    """A vocabulary of text pieces (some split, as half characters), stop strings over the same
    alphabet, a token sequence (EOS = len(pieces)), and how many tokens each step brings."""
    alphabet = "ab c"
    pieces = draw(st.lists(st.text(alphabet, max_size=4), min_size=1, max_size=6))
    eos = len(pieces)
    tokens = draw(st.lists(st.integers(0, eos), min_size=1, max_size=40))
    return dict(
        pieces=pieces, eos=eos, tokens=tokens,
        split=frozenset(draw(st.lists(st.integers(0, eos - 1), max_size=2))),
        stops=tuple(draw(st.lists(st.text(alphabet, min_size=1, max_size=5), max_size=3))),
        max_new=draw(st.integers(1, len(tokens) + 2)),
        steps=draw(st.lists(st.integers(1, 6), min_size=len(tokens), max_size=len(tokens))),
        abort_after=draw(st.one_of(st.none(), st.integers(0, len(tokens)))))


@settings(max_examples=1500, deadline=None)
@given(streamed_requests())
def test_streamed_text_adds_up_to_the_final_text(case):
    """Random stop strings, tokenizations and tokens per step (speculation accepts several):
    the events' texts concatenate to the final text, no prefix of the stream holds text the
    final text lacks, and what is held back at each step is exactly the longest suffix that
    may still begin a stop string; an abort releases it."""
    tokens, stops = case["tokens"], case["stops"]
    sched = Scheduler(config())
    req = make("r", [1], case["max_new"], detokenizer=Pieces(case["pieces"], case["split"]),
               stop=stops, eos_ids=frozenset({case["eos"]}), status=RUNNING)
    sched.requests[req.request_id] = req  # driven by update() alone: no slot, no pages
    stream, prefixes, i, steps = "", [], 0, iter(case["steps"])
    while not req.finished:
        if i >= len(tokens) or (case["abort_after"] is not None and i >= case["abort_after"]):
            sched.abort(req.request_id)
            stream += release_rest(req)  # as Engine.abort does
            break
        size = next(steps)
        chunk, i, before = tokens[i:i + size], i + size, len(req.output_ids)
        req.num_pending += 1
        events = sched.update([(req, chunk if size > 1 else chunk[0])])
        assert len(events) == len(req.output_ids) - before  # one per token it accepted
        stream += "".join(e.text for e in events)
        prefixes.append(stream)
        if not req.finished:  # held back: the longest suffix that may still begin a stop
            held = req.text[len(stream):]
            assert req.text.startswith(stream) and len(held) == held_back(req.text, stops)
            assert held == "" or any(s.startswith(held) and s != held for s in stops)
    assert stream == req.text
    assert all(req.text.startswith(p) for p in prefixes)
    text, reason = final_text(tokens[:len(req.output_ids)], case["pieces"], case["split"],
                              stops, case["eos"], case["max_new"])
    assert (req.text, req.finish_reason) == (text, reason or "abort")
    assert not any(s in req.text for s in stops)


def test_abort_waiting_and_running():
    cfg = config(max_slots=1)
    sched = Scheduler(cfg)
    sim = SimDevice(sched)
    a, b = make("a", [1] * 5, 10), make("b", [2] * 5, 10)
    sched.add(a)
    sched.add(b)
    sim.run_until(lambda: len(a.output_ids) >= 2)
    assert a.status == RUNNING and b.status == WAITING
    assert sched.abort("b") is b
    assert b.finish_reason == "abort" and b not in sched.waiting
    check(sched)
    assert a.num_pending == 1  # a token of a is in flight
    sched.abort("a")
    assert a.finish_reason == "abort" and not a.pages and a.slot is None
    assert_drained(sched)
    n = len(a.output_ids)
    _, events = sim.step()  # delivers the in-flight token: dropped
    assert events == [] and len(a.output_ids) == n and a.num_pending == 0
    assert not sim.busy()
    assert sched.abort("a").finish_reason == "abort"  # aborting a finished request: no-op
    with pytest.raises(KeyError, match="nope"):
        sched.abort("nope")
    assert_drained(sched)


def test_abort_during_prefill_frees_pages():
    sched = Scheduler(config(chunk_size=2, token_budget=4))
    sim = SimDevice(sched)
    a = make("a", list(range(9)), 3)
    sched.add(a)
    sim.step()
    assert a.pages and a.num_computed == 2
    sched.abort("a")
    assert_drained(sched)
    sim.run()
    assert a.output_ids == []


def test_add_rejects_what_can_never_fit():
    sched = Scheduler(config(page_size=4, num_pages=3, pages_per_seq=8))  # 12 rows at most
    ok = make("ok", range(10), 3)  # 10 + 3 - 1 = 12 rows
    sched.add(ok)
    with pytest.raises(ValueError, match=r"10 tokens.*max_new_tokens \(4\).*13 cache rows.*12"):
        sched.add(make("big", range(10), 4))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(make("ok", [1], 1))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(make("empty", [], 1))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        sched.add(make("zero", [1], 0))
    assert list(sched.waiting) == [ok] and list(sched.requests) == ["ok"]
    narrow = Scheduler(config(page_size=4, num_pages=10, pages_per_seq=2))  # 8 rows at most
    with pytest.raises(ValueError, match="9 cache rows.*at most 8"):
        narrow.add(make("x", range(5), 5))
    assert not narrow.requests and not narrow.waiting
    sim = SimDevice(sched)
    sim.run()
    assert_ideal(ok)
    assert_drained(sched)


def test_detokenizer_error_fails_only_its_request():
    prompts = {"x": [1, 2, 3], "bad": [4, 4, 4, 4, 4], "y": [5, 6]}
    full, _, _ = ideal(prompts["bad"], 8)
    j = next(i for i in range(1, 8) if full[i] not in full[:i])
    sched = Scheduler(config())
    sim = SimDevice(sched)
    reqs = {rid: make(rid, p, 8, detokenizer=Detok(full[j] if rid == "bad" else None))
            for rid, p in prompts.items()}
    for r in reqs.values():
        sched.add(r)
    sim.run()
    bad = reqs.pop("bad")
    assert bad.finish_reason == "error" and bad.output_ids == full[:j + 1]
    assert bad.error == f"RuntimeError: cannot decode token {full[j]}"
    for r in reqs.values():
        assert_ideal(r)
    assert_drained(sched)


# ----- prefix cache ---------------------------------------------------------------------------
def test_prefix_cache_shares_full_pages():
    sched = Scheduler(config(page_size=4, chunk_size=16, token_budget=32))
    sim = SimDevice(sched)
    prefix = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]  # 3 pages
    a, b = make("a", prefix + [0, 0], 10), make("b", prefix + [3], 3)
    sched.add(a)
    sim.step()
    sim.step()  # the update of step 1 registers a's 3 full pages
    assert sched.prefix_hits == 0 and len(sched.cache) == 3
    sched.add(b)
    sim.step()
    shared = a.pages[:3]
    assert b.pages[:3] == shared and b.pages[3] != a.pages[3]
    assert (sched.prefix_queries, sched.prefix_hits, sched.reused_tokens) == (2, 1, 12)
    assert b.prompt_reused == 12 and b.prompt_computed == 1 and a.prompt_reused == 0
    assert [sched.pool.refcount[p] for p in shared] == [2, 2, 2]
    sim.run_until(lambda: b.finished)
    assert a.status == RUNNING
    assert [sched.pool.refcount[p] for p in shared] == [1, 1, 1]
    assert not set(shared) & set(sched.pool.free)
    sim.run()
    assert [sched.pool.refcount[p] for p in shared] == [0, 0, 0]
    assert set(shared) <= set(sched.cache.nodes)  # unheld, still cached, counted available
    assert_ideal(a)
    assert_ideal(b)
    assert_drained(sched)


def test_fully_cached_prompt_computes_its_last_page():
    sched = Scheduler(config(page_size=4))
    sim = SimDevice(sched)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]  # 2 full pages
    a = make("a", prompt, 2)
    sched.add(a)
    sim.run()
    cached = sched.cache.match(prompt)
    assert len(cached) == 2
    b = make("b", prompt, 2)
    sched.add(b)
    out, _ = sim.step()
    [chunk] = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (4, 4, True)
    assert b.pages[0] == cached[0] and b.pages[1] != cached[1]
    assert b.prompt_reused == 4 and sched.prefix_hits == 1
    sim.run()
    assert b.output_ids == a.output_ids
    assert_ideal(b)
    assert_drained(sched)


def test_lru_eviction_takes_the_least_recently_used_leaf():
    sched = Scheduler(config(page_size=2, num_pages=4, pages_per_seq=4, max_slots=1))
    sim = SimDevice(sched)

    def serve(rid, prompt):
        r = make(rid, prompt, 1)
        sched.add(r)
        sim.run()
        assert_ideal(r)
        return r

    for rid, tok in (("x", 1), ("y", 2), ("z", 3)):
        serve(rid, [tok, tok])
    page = {tok: sched.cache.match([tok, tok])[0] for tok in (1, 2, 3)}
    assert len(sched.cache) == 3 and sched.pool.num_evictions == 0
    serve("x2", [1, 1, 5])  # uses x's block again and the one free page
    assert len(sched.pool.free) == 1 and len(sched.cache) == 3
    serve("w", [4] * 6)  # 3 pages: the free one, then y's and z's (least recently used)
    assert sched.pool.num_evictions == 2
    assert sched.cache.match([1, 1]) == [page[1]]
    assert sched.cache.match([2, 2]) == [] and sched.cache.match([3, 3]) == []
    assert_drained(sched)


def test_prefix_cache_evicts_leaves_only():
    cache = PrefixCache(page_size=1)
    pool = PagePool(range(4), cache)
    pages = [pool.allocate() for _ in range(3)]
    assert cache.insert([7, 8], pages[:2]) == 2  # chain 7 -> 8
    assert cache.insert([9], pages[2:]) == 1
    for p in pages:
        pool.release(p)
    pool.retain(pages[1])  # the child of the oldest chain is held: its parent is pinned
    assert cache.evict(lambda p: pool.refcount[p] == 0) == pages[2]
    assert cache.evict(lambda p: pool.refcount[p] == 0) is None
    pool.release(pages[1])
    assert cache.evict(lambda p: pool.refcount[p] == 0) == pages[1]  # leaf first
    assert cache.evict(lambda p: pool.refcount[p] == 0) == pages[0]
    assert len(cache) == 0


WORKLOAD = [([1, 2, 3, 4, 1, 2, 3, 4] + tail, n) for tail, n in
            (([5], 6), ([5, 6], 4), ([], 5), ([7, 7, 7], 3), ([5], 7), ([1, 2, 3, 4], 2))]


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_prefix_caching_on_and_off_give_the_ideal_outputs(page_size):
    results = {}
    for caching in (True, False):
        sched = Scheduler(config(page_size=page_size, num_pages=48 // page_size, max_slots=3,
                                 token_budget=8, chunk_size=4, enable_prefix_caching=caching))
        reqs = [make(str(i), p, n) for i, (p, n) in enumerate(WORKLOAD)]
        serve_all(sched, reqs)
        results[caching] = ([r.output_ids for r in reqs], sched.prefix_hits,
                            sched.computed_tokens)
    assert results[True][0] == results[False][0]
    assert results[True][1] > 0 and results[False][1] == 0
    assert results[True][2] < results[False][2]


def test_concurrent_duplicate_blocks_do_not_break_admission():
    """Two requests compute the same first block side by side (nothing was cached when they
    were admitted). When the first finishes, its copy stays cached and unheld while the second
    runs on with its own: the pool must be able to hand out every page it counts as available,
    so the tree must not hang the second one's next block under the first one's page (admission
    would count that page, fail to evict it, and preempt the request it had just admitted)."""
    sched = Scheduler(config(page_size=2, num_pages=5, pages_per_seq=4, max_slots=3,
                             chunk_size=4, token_budget=8))
    sim = SimDevice(sched)
    a, b = make("a", [1, 1, 2], 1), make("b", [1, 1, 3, 3], 4)
    sched.add(a)
    sched.add(b)
    sim.step()
    assert a.pages[0] != b.pages[0]  # admitted together: nothing cached yet
    sim.step()
    c = make("c", [4, 4, 4, 4], 1)  # needs 2 fresh pages
    sched.add(c)
    sim.run()
    for r in (a, b, c):
        assert_ideal(r)
    assert_drained(sched)


# ----- preemption and policy ------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True])
def test_preemption_takes_the_newest_and_recomputes(caching):
    sched = Scheduler(config(page_size=2, num_pages=6, pages_per_seq=4, max_slots=2,
                             enable_prefix_caching=caching))
    sim = SimDevice(sched)
    # a and b need 4 pages each at the end, 8 > 6; c waits for a slot.
    a, b, c = make("a", [1, 2, 3], 6), make("b", [3, 2, 1], 6), make("c", [2, 2], 2)
    for r in (a, b, c):
        sched.add(r)
    sim.run()
    i = next(i for i, step in enumerate(sim.history) if step.out.preempted)
    assert sim.history[i].out.preempted == [b] and not sim.history[i].admitted
    assert [r.request_id for r in sim.history[i].running_before] == ["a", "b"]
    assert b.num_preemptions == 1 and a.num_preemptions == 0 and sched.num_preemptions == 1
    # b goes back to the front of the queue: it resumes before c is admitted.
    assert [rid for _, rid in admissions(sim)] == ["a", "b", "b", "c"]
    # It recomputes its prompt and the outputs it had (minus cached full pages).
    j = next(j for j, rid in admissions(sim) if j > i)
    [first] = [x for x in sim.history[j].out.chunks if x.request is b]
    assert first.tokens == b.known_tokens()[first.start:first.start + first.num_tokens]
    assert first.start == sched.reused_tokens and (first.start > 0) == caching
    assert b.prompt_computed + b.prompt_reused == 2 * len(b.prompt_ids)
    for r in (a, b, c):
        assert_ideal(r)
    assert_drained(sched)


@pytest.mark.parametrize("caching", [False, True])
def test_long_prompts_in_a_small_pool_do_not_thrash(caching):
    """Four ~1,400-token prompts in a pool of one full-length sequence (128 pages of 16; each
    request needs 89-90): admitted only as the pool can carry them, they run one after another,
    all finish, none is preempted and no token row is computed twice. (A scheduler that admits
    a request whenever its first chunk's pages are free makes each one compute a chunk or two
    and be preempted by the older one's growth: 29 preemptions and 3.3x the token rows without
    prefix caching.)"""
    sched = Scheduler(config(max_slots=4, token_budget=512, chunk_size=256, page_size=16,
                             num_pages=128, pages_per_seq=128, enable_prefix_caching=caching))
    prompts = [[(7 * i + 3 * j + j * j) % 997 for j in range(1400 + 7 * i)] for i in range(4)]
    reqs = [make(str(i), p, 16) for i, p in enumerate(prompts)]
    sim = serve_all(sched, reqs)  # every output is the ideal one: nothing starved
    preemptions = {r.request_id: r.num_preemptions for r in reqs}
    assert sum(preemptions.values()) == sched.num_preemptions == 0, preemptions
    assert sched.computed_tokens == sum(len(p) + 16 - 1 for p in prompts)
    # ceil(1,400 / 256) = 6 prefill steps and 15 decode steps per request, plus the steps whose
    # samples reach the host a step late.
    assert len(sim.history) <= 4 * (6 + 15) + 8, len(sim.history)


@pytest.mark.parametrize("watermark", [0.0, 0.1])
def test_admission_reserves_the_running_requests_pages(watermark):
    """A request starts only where its whole prompt fits beside what the running requests
    still lack for the tokens they know and the watermark's share of the pool. In 20 pages, a
    (10 pages of prompt) and b (9) fit together, but not their outputs: a grows to 11 pages and
    b to 10. Without a watermark b starts beside a and is preempted by a's growth; a watermark
    of 2 pages keeps b waiting until a has finished."""
    sched = Scheduler(config(max_slots=2, token_budget=16, chunk_size=8, page_size=4,
                             num_pages=20, pages_per_seq=16, watermark=watermark))
    sim = SimDevice(sched)
    a, b = make("a", list(range(40)), 4), make("b", [1, 2, 3] * 12, 4)
    sched.add(a)
    sim.step()  # a computes 8 tokens: it holds 2 pages and lacks 8 for the rest of its prompt
    assert admission_reserve(sched.config, sched.running) == [int(watermark * 20) + 8]
    sched.add(b)
    sim.run_until(lambda: a.finished or b.status != WAITING)
    assert a.finished == (watermark > 0)
    sim.run()
    assert (a.num_preemptions, b.num_preemptions) == (0, int(watermark == 0))
    assert_ideal(a), assert_ideal(b)
    assert_drained(sched)
    with pytest.raises(ValueError, match="watermark=1"):
        config(watermark=1.0)


# ----- data shards ----------------------------------------------------------------------------
def _shard_of(sched: Scheduler, page: int) -> int:
    return next(d for d, pool in enumerate(sched.pools) if page in pool.pages)


def test_data_shards_split_the_slots_and_the_pages():
    """Two data shards: slots 0-1 and pages 0-3 are shard 0's, slots 2-3 and pages 5-8 shard
    1's (page 4 is shard 0's trash page, 9 shard 1's). A request holds one shard's slot and
    pages only; with nothing cached, admission balances the shards' free pages."""
    cfg = config(max_slots=4, num_pages=8, page_size=2, pages_per_seq=4, data_shards=2)
    assert [cfg.shard_pages(d) for d in (0, 1)] == [range(0, 4), range(5, 9)]
    sched = Scheduler(cfg)
    sim = SimDevice(sched)
    reqs = [make(str(i), [i, i + 1, i + 2], 3) for i in range(4)]
    for r in reqs:
        sched.add(r)
    sim.step()
    assert [(r.slot, r.shard) for r in reqs] == [(0, 0), (2, 1), (1, 0), (3, 1)]
    for r in reqs:
        assert {_shard_of(sched, p) for p in r.pages} == {r.shard}
    sim.run()
    for r in reqs:
        assert_ideal(r)
    assert_drained(sched)


def test_data_shards_admit_where_the_prefix_is_cached():
    """A prompt that extends a finished one goes to the shard whose prefix cache holds it, and
    reuses its full pages there."""
    sched = Scheduler(config(max_slots=4, num_pages=8, page_size=2, pages_per_seq=4,
                             data_shards=2))
    first = make("a", [1, 2, 3, 4, 5, 6], 1)
    sim = serve_all(sched, [make("x", [7, 7], 1), first])  # x takes shard 0, a shard 1
    [home] = [d for d, pool in enumerate(sched.pools) if len(pool.cache) == 3]
    assert home == 1
    again = make("b", [1, 2, 3, 4, 5, 6, 9], 2)
    sched.add(again)
    sim.step()
    assert again.shard == home and again.prompt_reused == 6
    assert again.pages[:3] == sched.pools[home].cache.match([1, 2, 3, 4, 5, 6])
    sim.run()
    assert_ideal(again)
    assert_drained(sched)


def test_data_shards_preempt_within_the_short_group():
    """Each shard's 4 pages cannot hold its two requests to the end (4 pages each): a shard
    short of a page preempts its own newest request (c in shard 0, d in shard 1), never one of
    the other shard's (d is the newest overall)."""
    sched = Scheduler(config(max_slots=4, num_pages=8, page_size=2, pages_per_seq=4,
                             data_shards=2))
    reqs = [make(n, [i, i], 6) for i, n in enumerate("abcd")]
    sim = SimDevice(sched)
    for r in reqs:
        sched.add(r)
    sim.step()
    assert [r.shard for r in reqs] == [0, 1, 0, 1]
    sim.run()
    # With one pool for both shards, d (the newest) would be preempted for a's page too.
    assert [r.num_preemptions for r in reqs] == [0, 0, 1, 1]
    for r in reqs:
        assert_ideal(r)
    assert_drained(sched)


def test_static_policy_admits_a_batch_when_the_last_is_done():
    admitted_at = {}
    for policy in ("static", "continuous"):
        sched = Scheduler(config(max_slots=2, policy=policy))
        reqs = [make("a", [1, 2], 2), make("b", [2, 1], 6), make("c", [3], 2),
                make("d", [4], 2)]
        sim = serve_all(sched, reqs)
        admitted_at[policy] = {rid: i for i, rid in admissions(sim)}
        if policy == "static":  # admissions only into an empty batch
            assert all(not sim.history[i].running_before for i, _ in admissions(sim))
    # Continuous admits c as soon as a leaves, while b still runs; static waits for b.
    assert admitted_at["continuous"]["c"] < admitted_at["static"]["c"]
    assert admitted_at["static"]["c"] == admitted_at["static"]["d"]


# ----- property test --------------------------------------------------------------------------
@st.composite
def hybrid_pools(draw, page_size: int, shards: int, pages_per_seq: int) -> dict:
    """Half the scenarios have a local pool (a sliding window shorter than their sequences)."""
    if draw(st.booleans()):
        return {}
    window, chunk = draw(st.integers(1, 3 * page_size)), draw(st.integers(1, 10))
    least = min(local_pages_bound(window, page_size, chunk), pages_per_seq)
    return dict(window=window, chunk_size=chunk,
                num_local_pages=shards * (least + draw(st.integers(0, 4))))


@st.composite
def scenarios(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    shards = draw(st.sampled_from([1, 1, 2, 3]))  # the mesh's data axis
    max_slots = shards * draw(st.integers(1, 4 // shards or 1))
    pages_per_seq = draw(st.integers(1, 8))
    cfg = SchedulerConfig(**{
        **dict(max_slots=max_slots, token_budget=draw(st.integers(max_slots, max_slots + 10)),
               chunk_size=draw(st.integers(1, 10)), page_size=page_size,
               num_pages=shards * draw(st.integers(1, 12 // shards)),
               pages_per_seq=pages_per_seq, enable_prefix_caching=draw(st.booleans()),
               policy=draw(st.sampled_from(["continuous", "continuous", "static"])),
               data_shards=shards),
        **draw(hybrid_pools(page_size, shards, pages_per_seq))})
    limit = min(cfg.pages_per_seq, cfg.pages_per_shard) * page_size
    alphabet = st.integers(0, 3)
    prefixes = draw(st.lists(st.lists(alphabet, min_size=page_size, max_size=3 * page_size),
                             min_size=1, max_size=3))
    reqs = []
    for i in range(draw(st.integers(1, 7))):
        prompt = (draw(st.sampled_from(prefixes)) + draw(st.lists(alphabet, max_size=5)))
        prompt = (prompt or [draw(alphabet)])[:limit]
        max_new = draw(st.integers(1, min(8, limit - len(prompt) + 1)))
        eos = frozenset(draw(st.lists(st.integers(0, VOCAB - 1), max_size=1)))
        stop = tuple(draw(st.lists(st.text("abcdefghijklm", min_size=1, max_size=2),
                                   max_size=1)))
        arrival, n = draw(st.integers(0, 6)), draw(st.sampled_from([1, 1, 1, 2, 3]))
        kw = dict(eos_ids=eos, stop=stop)
        if n == 1 or len(prompt) < 2:
            reqs.append((arrival, make(
                str(i), prompt, max_new, **kw,
                detokenizer=Detok() if stop or draw(st.booleans()) else None,
                cacheable=draw(st.booleans()))))
            continue
        # n samples of one prompt, as Engine.add_request builds them
        parent = make(f"{i}/prefill", prompt, 1, prefill_only=True, children_left=n)
        reqs.append((arrival, parent))
        reqs += [(arrival, make(f"{i}/{j}", prompt, max_new, **kw, fork_of=parent,
                                detokenizer=Detok() if stop else None)) for j in range(n)]
    users = [j for j, (_, r) in enumerate(reqs) if not r.prefill_only]
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(users)), max_size=2))
    return cfg, reqs, aborts, draw(st.booleans())


@settings(max_examples=1000, deadline=None)
@given(scenarios())
def test_random_workloads(scenario):
    cfg, reqs, aborts, fanout = scenario
    sched = Scheduler(cfg, fanout=fanout)
    sim = SimDevice(sched)
    for step in range(3000):
        for arrival, r in reqs:
            if arrival == step:
                sched.add(r)
        for when, i in aborts:
            if when == step and reqs[i][0] <= step:
                sched.abort(reqs[i][1].request_id)
        if step > max(a for a, _ in reqs) and not sim.busy():
            break
        sim.step()
        check(sched)
    else:
        raise AssertionError("not done after 3000 steps")
    assert_drained(sched)
    assert sum(r.num_preemptions for _, r in reqs) == sched.num_preemptions  # per request
    for _, r in reqs:
        if r.prefill_only:  # a fork's parent ends when every sample has what it needs
            assert r.finished and r.finish_reason == "forked" and not r.pages, r
            continue
        assert r.finished and r.finish_reason in ("eos", "length", "stop", "abort"), r
        if r.finish_reason == "abort":
            full, _, _ = ideal(r.prompt_ids, r.max_new_tokens, r.eos_ids, r.stop)
            assert r.output_ids == full[:len(r.output_ids)]
        else:
            assert_ideal(r)
    if not cfg.enable_prefix_caching:
        assert sched.prefix_hits == 0
        if not any(r.prefill_only for _, r in reqs):  # forks reuse their parent's rows
            assert sched.reused_tokens == 0


# ----- hybrid pools (a sliding window's local layers) -----------------------------------------
def test_usable_blocks_keeps_the_hit_whose_window_is_cached():
    # page 4, window 6: the first token after n blocks sees positions [4n - 5, 4n - 1].
    assert usable_blocks([1, 2, 3], window=6, page_size=4) == 3
    assert usable_blocks([None, 2, 3], window=6, page_size=4) == 3  # block 0 is behind
    assert usable_blocks([1, None, 3], window=6, page_size=4) == 1  # blocks 1-2 needed for 3
    assert usable_blocks([1, 2, None], window=6, page_size=4) == 2
    assert usable_blocks([None, None, None], window=6, page_size=4) == 0
    assert usable_blocks([None, None, 3, 4], window=1, page_size=4) == 4  # window 1: none


def test_hybrid_pool_holds_only_the_window():
    cfg = config(max_slots=2, chunk_size=8, window=6, num_local_pages=8, num_pages=64)
    sched = Scheduler(cfg)
    req = make("long", [i % 4 for i in range(41)], 20)
    sim = SimDevice(sched)
    sched.add(req)
    held = []
    while sim.busy():
        sim.step()
        check(sched)  # bounded: ceil((6 - 1 + 8) / 4) + 1 = 5 pages
        held.append(sum(p is not None for p in req.local_pages))
    assert_ideal(req)
    # Prefill chunks of 8 hold at most 5; decode ceil(6 / 4) + 1 = 3, of the 15 pages it spans.
    assert max(held) <= local_pages_bound(6, 4, 8)
    assert max(held[5:]) <= local_pages_bound(6, 4, 1) == 3
    assert_drained(sched)


def test_hybrid_prefix_hit_stops_where_window_pages_were_evicted():
    """A prefix whose local pages were evicted is used only up to its last block with a cached
    window; the request recomputes the rest and its output is still the ideal one."""
    cfg = config(max_slots=1, token_budget=8, chunk_size=8, window=6, num_local_pages=8,
                 num_pages=64)
    sched = Scheduler(cfg)
    sim = SimDevice(sched)  # one device pool for the three requests

    def serve(req):
        sched.add(req)
        sim.run()
        assert_ideal(req)
        assert_drained(sched)

    shared = [i % 3 for i in range(24)]
    serve(make("a", shared, 1))
    _, local = sched.cache.match_local(shared)
    assert all(p is not None for p in local)  # every block registered with its local page
    serve(make("b", [3] * 24, 1))  # another prompt evicts the least recently used local pages
    _, local = sched.cache.match_local(shared)
    assert local == [None] * 4 + local[4:] and None not in local[4:]
    # 5 blocks match, but the first token after them sees positions 15..19: block 3 has lost
    # its local page, and so has every block before; nothing of the hit is usable.
    short = make("short", shared[:20] + [1, 2], 4)
    serve(short)
    assert short.prompt_reused == 0 and sched.prefix_hits == 0
    # All 6 blocks match and the window of position 24 (19..23) is cached: the whole hit is
    # used, although blocks 0-3 have only their global pages.
    full = make("full", shared + [1, 2], 4)
    serve(full)
    assert full.prompt_reused == 24
