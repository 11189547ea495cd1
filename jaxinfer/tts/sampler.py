"""`EngineSampler`: the `Sampler` protocol (`tts.strategies`) on the serving engine.

n samples of a prompt are n ordinary requests that differ only in their seed: sample i of a
prompt has seed `sampling.seed + i`, so it is reproducible on its own (the engine's sampling
draws from `fold_in(fold_in(key(0), seed), position)`: the same seed gives the same tokens in
any slot and any batch). All prompts x n requests go to the engine in ONE `LLM.generate` call,
so samples of different problems batch together (continuous batching fills every slot).

Sharing the prompt: without effort budgets a prompt's n samples go to the engine as ONE request
with `SamplingConfig(n=n)`, which prefills the prompt once and forks it (each sample holds the
prompt's full pages, gets a copy of the partial last page and draws its first token from the
prompt's last logits: prompt rows computed = L instead of n * L; + 1 per sample that found no
free slot when the prompt was done). With effort budgets (two phases,
per-sample continuations) the samples are separate requests and share full pages through the
prefix cache. `prime_prefix=True` first prefills every prompt once (a one-token request) so
separate requests find its full pages cached. `cost` counts what was actually computed.

Structured answers: `schemas` maps a prompt to the JSON schema its samples must follow
(`tasks.answer_schema`); those samples are requests with `SamplingConfig.json_schema` set, so
the engine masks every token the schema forbids (each forked sample has its own grammar state).

Repeated calls continue a prompt's seed sequence (the second call's first sample is seed + n),
so strategies that draw in batches (`best_of_n(stop_on_first_pass=True)`) get fresh samples;
`reset()` starts every prompt over at `sampling.seed`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxinfer.config import SamplingConfig
from jaxinfer.tts.effort import EffortConfig, generate_with_budget, system_prompt
from jaxinfer.tts.strategies import Sample

if TYPE_CHECKING:  # the engine imports jax; jaxinfer.tts must import without it
    from jaxinfer.engine.outputs import Completion

Prompt = str | Sequence[int]


@dataclasses.dataclass
class Cost:
    """Cumulative compute of a sampler's engine calls (every phase and primer request
    included)."""

    calls: int = 0  # `LLM.generate` calls
    requests: int = 0  # requests made (one per sample)
    prefill_computed: int = 0  # prompt token rows computed ...
    prefill_reused: int = 0  # ... and taken from the prefix cache
    decode_tokens: int = 0  # tokens generated
    wall_s: float = 0.0  # seconds inside `LLM.generate`

    def add(self, completions: Sequence[Completion], wall_s: float) -> None:
        self.calls += 1
        self.requests += len(completions)
        self.prefill_computed += sum(c.metrics.prompt_computed for c in completions)
        self.prefill_reused += sum(c.metrics.prompt_reused for c in completions)
        self.decode_tokens += sum(len(c.token_ids) for c in completions)
        self.wall_s += wall_s

    def since(self, before: Cost) -> Cost:
        """The cost accrued after the snapshot `before` (a `copy()` taken earlier)."""
        return Cost(**{f.name: getattr(self, f.name) - getattr(before, f.name)
                       for f in dataclasses.fields(self)})

    def copy(self) -> Cost:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class EngineSampler:
    """Draws n seeded completions of each prompt on a `jaxinfer.engine.engine.LLM`.

    Args:
      llm: the engine (`jaxinfer.checkpoint.loading.load_llm`, or `LLM(model, tokenizer, ...)`).
      sampling: shared parameters; sample i of a prompt gets seed `sampling.seed + i`.
      chat: render text prompts with the chat template (token-id prompts are used as given).
      system: system message for chat prompts.
      effort: reasoning effort as a thinking budget (`tts.effort`): a "Reasoning: <level>"
        system line and client-side budget forcing. Needs chat and a tokenizer.
      prime_prefix: prefill each prompt once before the samples so they share its full pages.
      use_tqdm: the engine's progress bar on stderr.
      schemas: prompt -> JSON schema (a dict) its samples are constrained to; other prompts
        sample freely. Not with effort (its forced "Final answer:" is free text).
    """

    def __init__(self, llm, sampling: SamplingConfig, *, chat: bool = True,
                 system: str | None = None, effort: EffortConfig | None = None,
                 prime_prefix: bool = False, use_tqdm: bool = False,
                 schemas: Mapping[Prompt, dict] | None = None):
        if effort is not None and not chat:
            raise ValueError("effort needs chat=True (the effort level is a system message)")
        if effort is not None and schemas:
            raise ValueError("schemas and effort exclude each other: budget forcing appends a "
                             "free-text 'Final answer:' that a JSON schema forbids")
        self.llm = llm
        self.sampling = sampling
        self.chat = chat
        self.effort = effort
        self.system = (system_prompt(effort.level, system, effort.marker) if effort is not None
                       else system)
        self.prime_prefix = prime_prefix
        self.use_tqdm = use_tqdm
        self.cost = Cost()
        self._drawn: dict[Any, int] = {}
        self._schemas = {self._key(p): json.dumps(schema) for p, schema in
                         (schemas or {}).items()}

    def reset(self) -> None:
        """Start every prompt's seed sequence over (the next sample 0 has `sampling.seed`)."""
        self._drawn.clear()

    def _key(self, prompt: Prompt) -> Any:
        return prompt if isinstance(prompt, str) else tuple(int(t) for t in prompt)

    def _generate(self, prompts: Sequence[Prompt], configs: Sequence[SamplingConfig],
                  chat: bool) -> list[Completion]:
        """One `LLM.generate` call, its cost recorded."""
        start = time.perf_counter()
        outs = self.llm.generate(list(prompts), list(configs), chat=chat,
                                 system=self.system if chat else None, use_tqdm=self.use_tqdm)
        self.cost.add(outs, time.perf_counter() - start)
        return outs

    def sample(self, prompts: Sequence[Prompt], n: int) -> list[list[Sample]]:
        """samples[i][j]: completion j of prompts[i], seed `sampling.seed + offset + j` where
        offset is how many samples of prompts[i] earlier calls drew ([len(prompts)][n])."""
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        prompts = list(prompts)
        seeds = []
        for p in prompts:
            offset = self._drawn.get(self._key(p), 0)
            self._drawn[self._key(p)] = offset + n
            seeds.append([self.sampling.seed + offset + j for j in range(n)])
        if seeds and max(max(s) for s in seeds) >= 2**31:
            raise ValueError(f"seeds past 2**31 - 1 (seed={self.sampling.seed}, n={n})")
        if self.prime_prefix:
            primer = dataclasses.replace(self.sampling, max_new_tokens=1, temperature=0.0)
            unique = list({self._key(p): p for p in prompts}.values())
            self._generate(unique, [primer] * len(unique), self.chat)
        flat = [p for p in prompts for _ in range(n)]
        configs = [dataclasses.replace(self.sampling, seed=s) for row in seeds for s in row]
        if self.effort is None:  # one forked request per prompt: n Completions in a row
            schema = [self._schemas.get(self._key(p), self.sampling.json_schema)
                      for p in prompts]
            forks = [dataclasses.replace(self.sampling, seed=row[0], n=n, json_schema=s)
                     for row, s in zip(seeds, schema)]
            samples = [self._plain(c, cfg.seed) for c, cfg in
                       zip(self._generate(prompts, forks, self.chat), configs)]
        else:
            budgeted = generate_with_budget(self._generate, self.llm.engine.tokenizer,
                                            self.llm.engine.config.vocab_size, flat, configs,
                                            self.effort, system=self.system)
            samples = [b.to_sample(cfg.seed) for b, cfg in zip(budgeted, configs)]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    @staticmethod
    def _plain(c: Completion, seed: int) -> Sample:
        m = c.metrics
        return Sample(
            text=c.text, num_tokens=len(c.token_ids), prompt_tokens=len(c.prompt_ids),
            finish_reason=c.finish_reason,
            extra={"seed": seed, "thinking_tokens": 0, "answer_tokens": len(c.token_ids),
                   "forced": False, "prompt_computed": m.prompt_computed,
                   "prompt_reused": m.prompt_reused, "wall_s": m.e2e or 0.0})
