"""The offline API: `LLM(model, tokenizer).generate(prompts)` on the engine, and `load_llm`,
which builds one from a run config (checkpoint, mesh, draft model, LoRA adapters)."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from jax.sharding import Mesh

from jaxinfer.checkpoint.eagle import load_draft_head
from jaxinfer.checkpoint.loading import load_model, load_tokenizer
from jaxinfer.checkpoint.tokenizer import Tokenizer
from jaxinfer.checkpoint.weights import Checkpoint
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.outputs import Completion, RequestOutput
from jaxinfer.engine.prompts import GREEDY, batch_of, sampling_config
from jaxinfer.engine.request import sample_ids
from jaxinfer.model import Llama
from jaxinfer.model.eagle import EagleHead
from jaxinfer.sharding import make_mesh


class LLM:
    """Offline batch generation on the engine: `LLM(model, tokenizer).generate(prompts)`."""

    def __init__(self, model: Llama, tokenizer: Tokenizer | None, *,
                 cache: CacheConfig | None = None, engine: EngineConfig | None = None,
                 mesh: Mesh | None = None, draft_model: Llama | None = None,
                 lora_modules: Mapping[str, str] | None = None,
                 draft_head: EagleHead | None = None):
        """lora_modules: LoRA adapter name -> PEFT adapter directory, registered at once
        (`Engine.add_lora`; the engine needs `EngineConfig.max_loras` > 0). draft_head: the
        EAGLE head of `EngineConfig.speculative_method="eagle"`."""
        self.engine = Engine(model, tokenizer, cache=cache, engine=engine, mesh=mesh,
                             draft_model=draft_model, draft_head=draft_head)
        for name, path in (lora_modules or {}).items():
            self.engine.add_lora(name, path)

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 sampling: SamplingConfig | Sequence[SamplingConfig] = GREEDY, *,
                 chat: bool = False, system: str | None = None, use_tqdm: bool = True,
                 raise_on_error: bool = True,
                 on_output: Callable[[int, RequestOutput], None] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[Completion]:
        """Runs every prompt to completion; results in prompt order. A prompt whose sampling
        has n > 1 contributes n Completions in a row (sample i seeded seed + i; its prompt is
        prefilled once, see `Engine.add_request`).

        raise_on_error: bad input raises ValueError (naming the prompt) before anything runs;
        with False a bad request gets finish_reason "error" and the others run.
        on_output: streaming callback (result index, RequestOutput) for every token; a
          result's outputs' texts add up to its Completion's text (text that may still begin
          a stop string is held back until it cannot).
        lora: the LoRA adapter every prompt runs with, or one per prompt (None: the base
          model); it sets `SamplingConfig.lora` of each prompt's sampling.
        """
        prompts, configs = batch_of(prompts, sampling)
        configs = _with_lora(configs, lora)
        groups: list[tuple[str | None, int, str | None]] = []  # (request id, n, error)
        for i, (p, sc) in enumerate(zip(prompts, configs)):
            try:
                sc = sampling_config(sc)
                groups.append((self.engine.add_request(p, sc, chat=chat, system=system),
                               sc.n, None))
            except ValueError as e:
                if raise_on_error:
                    self._abort_all(groups)
                    raise ValueError(f"prompt {i}: {e}") from None
                groups.append((None, getattr(sc, "n", 1), str(e)))
        index, first = {}, 0  # sample id -> result index
        for rid, n, _ in groups:
            if rid is not None:
                index.update((sid, first + j) for j, sid in enumerate(sample_ids(rid, n)))
            first += n
        progress = _Progress(len(index)) if use_tqdm else None
        for event in self.engine.stream():
            if on_output is not None:
                on_output(index[event.request_id], event)
            if progress is not None:
                progress.update(event)
        if progress is not None:
            progress.close()
        results = []
        for rid, n, error in groups:
            if rid is None:
                results += [Completion(prompt_ids=[], token_ids=[], text="",
                                       finish_reason="error", error=error)] * n
            else:
                results += self.engine.results(rid)
                self.engine.forget(rid)
        return results

    def _abort_all(self, groups) -> None:
        """Aborts the requests this call added (and runs them out) before it raises."""
        for rid, _, _ in groups:
            if rid is not None:
                self.engine.abort(rid)
        self.engine.run()
        for rid, _, _ in groups:
            if rid is not None:
                self.engine.forget(rid)


def _with_lora(configs: list, lora: str | Sequence[str | None] | None) -> list:
    """`configs` (one per prompt) with `SamplingConfig.lora` set from `generate`'s `lora`."""
    if lora is None:
        return configs
    names = [lora] * len(configs) if isinstance(lora, str) else list(lora)
    if len(names) != len(configs):
        raise ValueError(f"lora names {len(names)} adapters for {len(configs)} prompts; give "
                         "one name (every prompt) or one per prompt")
    out = []
    for sc, name in zip(configs, names):
        try:
            out.append(dataclasses.replace(sampling_config(sc), lora=name))
        except ValueError:
            out.append(sc)  # a bad sampling fails its own request (`generate`)
    return out


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


def load_llm(run: RunConfig, ckpt: Checkpoint | None = None) -> LLM:
    """The engine for `run`: its checkpoint (default: the embedded SmolLM2), on the mesh
    `run.mesh` names (None: one device), with the draft model `run.draft_model_path` or the
    draft head `run.draft_head_path` names and the LoRA adapters of `run.lora_modules`
    registered."""
    mesh = make_mesh(run.mesh) if run.mesh else None
    model, ckpt = load_model(run, ckpt)
    draft = head = None
    if run.draft_model_path:
        draft, _ = load_model(dataclasses.replace(run, model_path=run.draft_model_path))
    if run.draft_head_path:
        head = load_draft_head(run.draft_head_path, model.config)
    modules, engine = run.lora_paths(), run.engine
    if modules and not engine.max_loras:  # one pool slot per adapter given
        engine = dataclasses.replace(engine, max_loras=len(modules))
    return LLM(model, load_tokenizer(ckpt), cache=run.cache, engine=engine, mesh=mesh,
               draft_model=draft, draft_head=head, lora_modules=modules)
