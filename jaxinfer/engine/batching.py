"""From a schedule to device inputs: the `mixed_step` calls one engine step makes.

A step's decode rows and its prompt chunks become one `mixed_step` call per chunk; the decode
rows ride with the first call (a step without chunks is one call of decode rows). Each call has a
static chunk bucket (the smallest prefill bucket holding the chunk; 0 without one) and page
bucket (covering every row it computes), so the set of compiled variants is small and known in
advance (`jaxinfer.engine.warmup`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.engine.kv_cache import pages_bucket
from jaxinfer.engine.request import Chunk, Request, SchedulerOutput
from jaxinfer.engine.steps import MixedBatch


@dataclasses.dataclass(frozen=True)
class Call:
    """One `mixed_step` call: its prompt chunk (None: decode rows only), chunk bucket, page
    bucket."""

    chunk: Chunk | None
    size: int
    pages: int


@dataclasses.dataclass(frozen=True)
class SampleSlot:
    """Where a request's sampled token is: `mixed_step` call `call`, output row `row`."""

    request: Request
    call: int
    row: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchBuilder:
    """Builds the `mixed_step` inputs of a schedule.

    host_decode_rows: a one-token prompt chunk that samples, of a request without penalties
      (e.g. a forked sample's last prompt token), runs as a decode row with its token from the
      host instead of as a call of its own: its slot's penalty state is never read. Off under
      speculation, whose decode rows go to `verify_step`.
    local_trash: a hybrid pool's local trash page of each data shard (the page-table entry of a
      block whose local page was released); empty: no local pool.
    """

    max_slots: int
    page_size: int
    pages_per_seq: int
    prefill_buckets: tuple[int, ...]
    min_bucket_pages: int = 1
    host_decode_rows: bool = True
    local_trash: tuple[int, ...] = ()

    @property
    def table_width(self) -> int:
        """Columns of the page-table input: P, or 2P with a local table (`kv_cache`)."""
        return self.pages_per_seq * (2 if self.local_trash else 1)

    def decode_rows(self, schedule: SchedulerOutput) -> list[Chunk]:
        """The chunks run as decode rows (see `host_decode_rows`)."""
        if not self.host_decode_rows:
            return schedule.decodes
        return [c for c in schedule.chunks if c.is_decode or (
            c.num_tokens == 1 and c.samples and c.request.cacheable)]

    def calls(self, schedule: SchedulerOutput) -> list[Call]:
        """One call per chunk not run as a decode row; the decode rows ride with the first."""
        rows = self.decode_rows(schedule)
        longest = max((c.start + 1 for c in rows), default=0)
        prefills = [c for c in schedule.chunks if not any(c is r for r in rows)]
        if not prefills:
            return [Call(None, 0, self.pages(longest))]
        calls = []
        for i, chunk in enumerate(prefills):
            size = next(s for s in self.prefill_buckets if s >= chunk.num_tokens)
            end = max(longest if i == 0 else 0, chunk.start + chunk.num_tokens)
            calls.append(Call(chunk, size, self.chunk_pages(end)))
        return calls

    def pages(self, num_tokens: int) -> int:
        """The page bucket of a decode or verification step whose longest row ends at
        `num_tokens`: at least `min_bucket_pages` (a step's KV reads are small beside its
        weights' there, and each bucket is one more compiled variant)."""
        return pages_bucket(num_tokens, self.page_size, self.pages_per_seq,
                            self.min_bucket_pages)

    def chunk_pages(self, num_tokens: int) -> int:
        """The page bucket of a step with a prompt chunk that ends at `num_tokens`: no floor
        (each of the chunk's rows attends over the bucket, so padding costs it compute)."""
        return pages_bucket(num_tokens, self.page_size, self.pages_per_seq)

    def page_table(self, running: list[Request]) -> np.ndarray:
        """i32[B, P]: each running request's pages in its slot's row; with a local pool
        i32[B, 2P], its local pages after them (a released one: its shard's local trash)."""
        table = np.zeros((self.max_slots, self.table_width), np.int32)
        p = self.pages_per_seq
        for req in running:
            table[req.slot, :len(req.pages)] = req.pages
            if self.local_trash:
                trash = self.local_trash[req.shard]
                table[req.slot, p:p + len(req.local_pages)] = [
                    trash if page is None else page for page in req.local_pages]
        return table

    def lora(self, running: list[Request]) -> np.ndarray:
        """i32[B]: each running request's LoRA adapter pool slot in its slot's entry (-1: the
        base model, and idle slots)."""
        slots = np.full((self.max_slots,), -1, np.int32)
        for req in running:
            slots[req.slot] = req.lora_slot if req.lora is not None else -1
        return slots

    def build(self, schedule: SchedulerOutput, running: list[Request]
              ) -> tuple[list[tuple[MixedBatch, int, Chunk | None]], list[SampleSlot]]:
        """The step's calls as (MixedBatch, page bucket, the chunk whose prompt logprobs the
        call computes or None: `scores_prompt`), and where each sampled token lands."""
        b = self.max_slots
        table = self.page_table(running)
        decode = np.zeros((b,), bool)
        decode_pos = np.zeros((b,), np.int32)
        host = np.zeros((b,), bool)
        host_tokens = np.zeros((b,), np.int32)
        samples = []
        for c in self.decode_rows(schedule):
            decode[c.slot], decode_pos[c.slot] = True, c.start
            if not c.is_decode:
                host[c.slot], host_tokens[c.slot] = True, c.tokens[0]
            samples.append(SampleSlot(c.request, 0, c.slot))
        batches = []
        for i, call in enumerate(self.calls(schedule)):
            fanout = np.zeros((b,), bool)
            chunk = call.chunk
            tokens = np.zeros((call.size,), np.int32)
            if chunk is not None:
                tokens[:chunk.num_tokens] = chunk.tokens
                if chunk.samples:
                    samples.append(SampleSlot(chunk.request, i, b))
                # Forked samples that take their first token from this chunk's last logits.
                for child, parent in schedule.fanouts:
                    if parent is chunk.request:
                        fanout[child.slot] = True
                        decode_pos[child.slot] = child.num_computed  # = the prompt's length
                        samples.append(SampleSlot(child, i, child.slot))
            first = i == 0
            scored = chunk if chunk is not None and scores_prompt(chunk) else None
            batches.append((MixedBatch(
                page_table=table, decode=decode if first else np.zeros_like(decode),
                decode_pos=decode_pos.copy(), decode_host=host if first else np.zeros_like(host),
                decode_tokens=host_tokens, fanout=fanout, chunk_tokens=tokens,
                chunk_slot=np.int32(chunk.slot if chunk else 0),
                chunk_start=np.int32(chunk.start if chunk else 0),
                chunk_len=np.int32(chunk.num_tokens if chunk else 0),
                chunk_samples=np.bool_(chunk is not None and chunk.samples),
                chunk_fresh=np.bool_(chunk is not None and chunk.start == 0),
                chunk_prompt_len=np.int32(len(chunk.request.prompt_ids) if chunk else 0),
                chunk_next=np.int32(next_prompt_token(scored) if scored else 0),
                lora=self.lora(running)),
                call.pages, scored))
        return batches, samples


def scores_prompt(chunk: Chunk) -> bool:
    """The chunk's request asks for prompt logprobs and its rows score prompt tokens (its
    call runs the prompt-logprob variant of `mixed_step`)."""
    req = chunk.request
    return req.prompt_logprobs is not None and chunk.start < len(req.prompt_ids) - 1


def next_prompt_token(chunk: Chunk) -> int:
    """The prompt token after the chunk (its last row's prompt-logprob target), or 0 past the
    prompt."""
    end, prompt = chunk.start + chunk.num_tokens, chunk.request.prompt_ids
    return prompt[end] if end < len(prompt) else 0
