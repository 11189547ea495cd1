"""Structured output (docs/architecture.md, decision 14): a request's constraint (`SamplingConfig`'s
`json_schema`, `regex`, `choice` or `grammar`) compiled by llguidance into a matcher that runs on
the host, and the packed token masks the jitted steps apply before sampling. Host-only: imports
no jax.

Masks are i32[..., W] with W = ceil(V / 32): bit j of word w allows token 32 w + j (llguidance's
packing; `jaxinfer.engine.sampling.apply_token_mask` unpacks it on device). An unconstrained row
is all ones (-1), so a step's mask input has one static shape whatever mix of requests it serves.
llguidance allows EOS only where the constraint is complete.

State: each constrained request, every forked sample included, holds its own `Constraint`,
advanced by each token the host accepts for it (`jaxinfer.engine.request.accept_token`); the
mask of its next token is filled from that state. The mask of step n + 1 therefore needs step
n's token on the host: the engine collects a step before scheduling the next while a
constrained request has a token in flight (`jaxinfer.engine.engine`, module docstring).
Speculative drafts are checked against the grammar before verification (`Constraint.check_drafts`).

Why llguidance: maintained, framework-free (a Rust core with numpy masks, no torch), tens of
microseconds per mask (its lexer/parser split), broad JSON Schema coverage, and the engine
SGLang-JAX, vLLM and llama.cpp use.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Sequence

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxinfer.checkpoint.tokenizer import Tokenizer
from jaxinfer.config import SamplingConfig

_KIND = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list",
         "grammar": "Lark grammar"}
_CACHED_GRAMMARS = 64  # compiled constraints kept for reuse (n samples, repeated schemas)


def mask_words(vocab_size: int) -> int:
    """W: int32 words of one packed mask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def all_allowed(shape: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """i32[*shape, W] masks that allow every token (unconstrained rows)."""
    return np.full(shape + (mask_words(vocab_size),), -1, np.int32)


def grammar_of(name: str, value: str | Sequence[str]) -> str:
    """The llguidance grammar of constraint field `name` set to `value`."""
    if name == "json_schema":
        # Compact JSON unless the schema's "x-guidance" asks otherwise: with flexible whitespace
        # sampled output can run away in whitespace (SmolLM2 at temperature 1: 1 sample in 32
        # spent its whole max_new_tokens on newlines and spaces), and compact JSON is shorter.
        return llguidance.LLMatcher.grammar_from_json_schema(
            value, defaults={"whitespace_flexible": False})
    if name == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if name == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(value)))
    return llguidance.LLMatcher.grammar_from_lark(value)


def _clip(value) -> str:
    text = value if isinstance(value, str) else json.dumps(list(value))
    return repr(text if len(text) <= 80 else text[:80] + "...")


class Constraint:
    """One request's grammar state: an llguidance matcher over the tokens accepted so far."""

    __slots__ = ("matcher", "name")

    def __init__(self, matcher: llguidance.LLMatcher, name: str):
        self.matcher = matcher
        self.name = name

    def advance(self, token: int) -> str | None:
        """Consumes an accepted token; returns why the constraint forbids it, or None."""
        if self.matcher.consume_token(token):
            return None
        return f"token {token} violates the {_KIND[self.name]}: {self.matcher.get_error()}"

    def fill(self, out: np.ndarray, row: int) -> None:
        """Writes the mask of the next token into out[row] (out: i32[N, W], C-contiguous)."""
        llnp.fill_next_token_bitmask(self.matcher, out, row)

    def check_drafts(self, drafts: Sequence[int], out: np.ndarray) -> int:
        """Speculation: how many leading `drafts` the constraint allows (k), with out[j] (out:
        i32[>= k + 1, W]) the mask after drafts[:j] for j = 0..k. The state is left as found.

        The drafts advance a copy of the matcher, never this one: llguidance's `rollback(n)`
        undoes the last n tokens it recorded, and an EOS it consumes is recorded or not
        depending on the grammar's state (a lexeme the EOS ends is not), so consuming drafts
        and rolling back their count can undo an accepted token too. A copy costs about a
        microsecond."""
        self.fill(out, 0)
        if not len(drafts):
            return 0
        matcher = self.matcher.deep_copy()
        k = 0
        for token in drafts:
            if not matcher.consume_token(int(token)):
                break
            k += 1
            llnp.fill_next_token_bitmask(matcher, out, k)
        return k


class ConstraintCompiler:
    """Compiles constraints for one tokenizer and model vocabulary (the tokenizer tables are
    built once, on first use, ~0.5 s) and fills a batch's masks in parallel threads.

    vocab_size: the model's V (masks cover every id the model can emit; ids the tokenizer does
    not have are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._templates: collections.OrderedDict = collections.OrderedDict()
        self.fill_seconds = 0.0  # host time spent filling masks (`masks`), and its calls
        self.fill_calls = 0

    @property
    def lltok(self) -> llguidance.LLTokenizer:
        if self._lltok is None:
            self._lltok = llguidance.LLTokenizer(self.tokenizer.backend_json(),
                                                 n_vocab=self.vocab_size,
                                                 eos_token=list(self.tokenizer.eos_ids))
        return self._lltok

    def compile(self, sampling: SamplingConfig) -> Callable[[], Constraint] | None:
        """A factory of fresh `Constraint`s for the request's constraint (one per sample), or
        None if it has none. Raises ValueError naming the field if the constraint is invalid or
        admits no token of this vocabulary."""
        name = sampling.constraint
        if name is None:
            return None
        value = getattr(sampling, name)
        key = (name, value)
        template = self._templates.get(key)
        if template is None:
            template = self._build(name, value)
            self._templates[key] = template
            if len(self._templates) > _CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        self._templates.move_to_end(key)
        return lambda: Constraint(template.deep_copy(), name)

    def _build(self, name: str, value) -> llguidance.LLMatcher:
        what = f"{name}={_clip(value)}"
        try:
            grammar = grammar_of(name, value)
        except ValueError as e:
            raise ValueError(f"{what} is not a valid {_KIND[name]}: {e}") from None
        try:
            lltok = self.lltok
        except ValueError as e:  # llguidance cannot read this tokenizer with this vocabulary
            raise ValueError(f"{what}: constraints need a tokenizer llguidance can read for "
                             f"this model's {self.vocab_size}-token vocabulary ({e})") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error:
            raise ValueError(f"{what} is not a valid {_KIND[name]}: {error.strip()}")
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        mask = np.zeros((1, mask_words(self.vocab_size)), np.int32)
        if not matcher.is_error():
            llnp.fill_next_token_bitmask(matcher, mask, 0)  # computing a mask may error too
        if matcher.is_error():
            raise ValueError(f"{what} admits no output in this vocabulary: "
                             f"{matcher.get_error().splitlines()[0]}")
        if not mask.any():
            raise ValueError(f"{what} admits no token of this vocabulary")
        return matcher

    def masks(self, requests: Sequence, max_slots: int) -> np.ndarray | None:
        """i32[B, W]: the next-token mask of each constrained request in `requests` (scheduler
        requests sampling this step; each constraint's state must hold all its earlier tokens)
        in its slot's row, all ones elsewhere; None if none is constrained."""
        rows = [(r.constraint, r.slot) for r in requests if r.constraint is not None]
        if not rows:
            return None
        start = time.perf_counter()
        out = all_allowed((max_slots,), self.vocab_size)
        self.fill(rows, out)
        self.fill_seconds += time.perf_counter() - start
        self.fill_calls += 1
        return out

    def fill(self, rows: Sequence[tuple[Constraint, int]], out: np.ndarray) -> None:
        """Writes each (constraint, row)'s next-token mask into out[row] (out: i32[N, W],
        C-contiguous), the rows in parallel on llguidance's thread pool."""
        if not rows:
            return
        if len(rows) == 1:
            rows[0][0].fill(out, rows[0][1])
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llnp.fill_next_token_bitmask_par(self._executor, [(c.matcher, i) for c, i in rows], out)
