"""`Generator.generate()`: prompts (text or ids) + sampling params -> completions, over slots.

Static shapes throughout: `max_slots` rows decode together; a request takes a free slot, is
prefilled chunk by chunk (buckets), then decodes until EOS, a stop string or its token budget;
a freed slot is refilled from the waiting requests. The host sees one transfer of sampled ids per
step. (Scheduling with a token budget, preemption and prefix sharing come with the serving engine.)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxinfer import steps
from jaxinfer.attention import resolve_impl
from jaxinfer.config import CacheConfig, EngineConfig, ModelConfig, SamplingConfig
from jaxinfer.kv_cache import create_cache, pages_bucket
from jaxinfer.metrics import RequestMetrics
from jaxinfer.model import Llama
from jaxinfer.sampling import SamplingParams
from jaxinfer.scheduler import stop_cut
from jaxinfer.tokenizer import IncrementalDecoder, Tokenizer

GREEDY = SamplingConfig()  # the default of `generate` (frozen, so one shared instance)


@dataclasses.dataclass
class Completion:
    """One finished request. finish_reason: "eos" | "stop" | "length" | "error"."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)


@dataclasses.dataclass
class _Request:
    index: int
    prompt_ids: list[int]
    sampling: SamplingConfig
    decoder: IncrementalDecoder | None
    out: Completion
    prefilled: int = 0


def encode_prompt(tokenizer: Tokenizer | None, vocab_size: int, prompt: str | Sequence[int], *,
                  chat: bool = False, system: str | None = None) -> list[int]:
    """Text (optionally chat-templated with `system`) or token ids -> validated token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: give at least one character or token id")
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        if chat:
            messages = ([{"role": "system", "content": system}] if system else [])
            messages.append({"role": "user", "content": prompt})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("empty prompt: it encodes to zero tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} out of range: valid ids are [0, {vocab_size})")
    return ids


def batch_of(prompts: Sequence[str | Sequence[int]] | str,
             sampling: SamplingConfig | Sequence[SamplingConfig]
             ) -> tuple[list, list[SamplingConfig]]:
    """(prompts, one SamplingConfig per prompt): one string is one prompt; one config is
    shared by all; a list of configs must match the prompts."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    configs = ([sampling] * len(prompts) if isinstance(sampling, SamplingConfig)
               else list(sampling))
    if len(configs) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(configs)} sampling configs")
    return prompts, configs


class Generator:
    """Owns the model (graph + params), the KV cache pool and the per-slot device state."""

    def __init__(self, model: Llama, tokenizer: Tokenizer | None, *, cache: CacheConfig,
                 engine: EngineConfig):
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        cache = cache.resolved(model.config)
        self.cache_config = cache
        self.engine = engine
        self.graph, self.params = steps.split_model(model)
        self.attention_impl = resolve_impl(engine.attention_impl)
        self.cache = create_cache(self.config, cache, engine.max_slots)
        self.state = steps.create_slot_state(engine.max_slots, self.config.vocab_size)
        self._slot_params: list[SamplingConfig | None] = [None] * engine.max_slots
        self._sampling = SamplingParams.from_configs(self._slot_params)

    # ----- validation -------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = False,
                      system: str | None = None) -> list[int]:
        """Text (optionally chat-templated) or token ids -> validated token ids."""
        return encode_prompt(self.tokenizer, self.config.vocab_size, prompt, chat=chat,
                             system=system)

    def check_budget(self, num_prompt: int, sampling: SamplingConfig) -> None:
        total = num_prompt + sampling.max_new_tokens
        max_len = self.cache_config.max_seq_len
        if total > max_len:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
                f"{total} exceeds the context of {max_len} tokens (cache max_seq_len="
                f"{self.cache_config.max_seq_len}, model max_position={self.config.max_position})")
        if sampling.top_logprobs > self.engine.max_top_logprobs:
            raise ValueError(f"top_logprobs={sampling.top_logprobs} exceeds the engine's "
                             f"max_top_logprobs={self.engine.max_top_logprobs}")

    # ----- the loop ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 sampling: SamplingConfig | Sequence[SamplingConfig] = GREEDY, *,
                 chat: bool = False, system: str | None = None, raise_on_error: bool = True,
                 on_token: Callable[[int, int, str], None] | None = None) -> list[Completion]:
        """Generates a completion for every prompt.

        Args:
          prompts: texts or token-id lists (one string is one prompt).
          sampling: one SamplingConfig for all, or one per prompt.
          chat: render text prompts with the checkpoint's chat template (and `system`).
          raise_on_error: bad input raises ValueError before anything runs; with False a bad
            request gets finish_reason "error" and the others run.
          on_token: streaming callback (prompt index, token id, new text).
        """
        prompts, configs = batch_of(prompts, sampling)
        arrival = time.perf_counter()
        requests, results = [], []
        for i, (p, sc) in enumerate(zip(prompts, configs, strict=True)):
            out = Completion(prompt_ids=[], token_ids=[], text="", finish_reason="error",
                             metrics=RequestMetrics(arrival=arrival))
            results.append(out)
            try:
                ids = self.encode_prompt(p, chat=chat, system=system)
                out.prompt_ids = ids
                self.check_budget(len(ids), sc)
            except ValueError as e:
                if raise_on_error:
                    raise ValueError(f"prompt {i}: {e}") from None
                out.error = str(e)
                continue
            dec = IncrementalDecoder(self.tokenizer) if self.tokenizer else None
            out.logprobs = [] if sc.logprobs else None
            out.top_logprobs = [] if sc.top_logprobs else None
            requests.append(_Request(i, ids, sc, dec, out))
        self._run(requests, on_token)
        return results

    def _run(self, waiting: list[_Request], on_token) -> None:
        slots: list[_Request | None] = [None] * self.engine.max_slots
        waiting = list(waiting)
        while waiting or any(slots):
            for b in range(len(slots)):
                if slots[b] is None and waiting:
                    slots[b] = waiting.pop(0)
                    self._prefill(b, slots[b], on_token)
                    if slots[b].out.finish_reason != "running":
                        self._release(b)
                        slots[b] = None
            if not any(slots):
                continue
            self._decode(slots, on_token)

    def _set_params(self, slot: int, sc: SamplingConfig | None) -> None:
        self._slot_params[slot] = sc
        self._sampling = SamplingParams.from_configs(self._slot_params)

    def _release(self, slot: int) -> None:
        self._set_params(slot, None)
        self.state = self.state.replace(active=self.state.active.at[slot].set(False))

    def _chunks(self, num_tokens: int) -> list[tuple[int, int, int, int]]:
        """(start, bucket size, real tokens, pages read) of each prefill chunk of a prompt."""
        buckets, out, start = self.engine.prefill_buckets, [], 0
        while start < num_tokens:
            remaining = num_tokens - start
            size = next((b for b in buckets if b >= remaining), buckets[-1])
            pages = pages_bucket(start + size, self.cache_config.page_size,
                                 self.cache_config.pages_per_seq)
            out.append((start, size, min(size, remaining), pages))
            start += min(size, remaining)
        return out

    def _prefill(self, slot: int, req: _Request, on_token) -> None:
        self._set_params(slot, req.sampling)
        req.out.finish_reason = "running"
        ids = req.prompt_ids
        for start, size, n, pages in self._chunks(len(ids)):
            chunk = np.zeros((size,), np.int32)
            chunk[:n] = ids[start:start + n]
            self.cache, self.state, out = steps.prefill_step(
                self.graph, self.params, self.cache, self.state, self._sampling, chunk,
                np.int32(slot), np.int32(start), np.int32(n), np.bool_(start + n == len(ids)),
                num_pages_read=pages, num_top_logprobs=self.engine.max_top_logprobs)
        self._accept(req, jax.device_get(out), 0, on_token)

    def warmup(self, prompts: Sequence[str | Sequence[int]], sampling: SamplingConfig, *,
               chat: bool = False, system: str | None = None) -> int:
        """Compiles every step variant `generate(prompts, sampling)` will use, by running each
        once on dummy data (slot 0, nothing active). Returns the number of variants run."""
        prefill, decode = set(), set()
        page_size, pages = self.cache_config.page_size, self.cache_config.pages_per_seq
        for p in prompts:
            try:
                n = len(self.encode_prompt(p, chat=chat, system=system))
                self.check_budget(n, sampling)
            except ValueError:
                continue
            prefill.update((size, pg) for _, size, _, pg in self._chunks(n))
            # Decode step k (k = 1 .. max_new - 1) leaves n + k tokens in the cache.
            decode.update(pages_bucket(t, page_size, pages)
                          for t in range(n + 1, n + sampling.max_new_tokens))
        for size, pg in sorted(prefill):
            self.cache, self.state, _ = steps.prefill_step(
                self.graph, self.params, self.cache, self.state, self._sampling,
                np.zeros((size,), np.int32), np.int32(0), np.int32(0), np.int32(1),
                np.bool_(False), num_pages_read=pg,
                num_top_logprobs=self.engine.max_top_logprobs)
        for pg in sorted(decode):
            self.cache, self.state, out = steps.decode_step(
                self.graph, self.params, self.cache, self.state, self._sampling,
                num_pages_read=pg, num_top_logprobs=self.engine.max_top_logprobs,
                attention_impl=self.attention_impl)
        self._release(0)  # the eager scatter that frees a slot compiles too
        jax.block_until_ready((self.cache, self.state))
        return len(prefill) + len(decode)

    def _decode(self, slots: list[_Request | None], on_token) -> None:
        # The step writes each row's newest token: a row then holds prompt + generated tokens.
        longest = max(len(r.prompt_ids) + len(r.out.token_ids) for r in slots if r)
        self.cache, self.state, out = steps.decode_step(
            self.graph, self.params, self.cache, self.state, self._sampling,
            num_pages_read=pages_bucket(longest, self.cache_config.page_size,
                                        self.cache_config.pages_per_seq),
            num_top_logprobs=self.engine.max_top_logprobs, attention_impl=self.attention_impl)
        host = jax.device_get(out)
        for b, req in enumerate(slots):
            if req is not None:
                self._accept(req, host, b, on_token)
                if req.out.finish_reason != "running":
                    self._release(b)
                    slots[b] = None

    def _accept(self, req: _Request, host, row: int, on_token) -> None:
        """Records the token sampled for `req` in `row` of the host copy; decides if it ends."""
        now = time.perf_counter()
        tok = int(host.tokens[row])
        out, sc = req.out, req.sampling
        out.token_ids.append(tok)
        out.metrics.token_times.append(now)
        if sc.logprobs:  # lists are created with the request (see generate)
            out.logprobs.append(float(host.logprobs[row]))
        if sc.top_logprobs:
            out.top_logprobs.append([(int(i), float(lp)) for i, lp in zip(
                host.top_ids[row][:sc.top_logprobs], host.top_logprobs[row], strict=False)])
        is_eos = (not sc.ignore_eos and self.tokenizer is not None
                  and tok in self.tokenizer.eos_ids)
        new_text, old_len = "", len(out.text)
        if req.decoder is not None and not is_eos:
            new_text = req.decoder.push(tok)
            out.text += new_text
        if is_eos:
            out.finish_reason = "eos"
        elif sc.stop and (cut := stop_cut(out.text, sc.stop, len(new_text))) is not None:
            out.text = out.text[:cut]
            out.finish_reason = "stop"
            # Stream only what survives the cut (text streamed by earlier tokens stays streamed).
            new_text = out.text[old_len:]
        elif len(out.token_ids) >= sc.max_new_tokens:
            out.finish_reason = "length"
        if out.finish_reason == "length" and req.decoder is not None:
            held_back = req.decoder.flush()  # streamed too, so the stream adds up to out.text
            out.text += held_back
            new_text += held_back
        if on_token is not None:
            on_token(req.index, tok, new_text)

