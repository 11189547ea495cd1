"""jaxinfer.tts on the engine: `EngineSampler` (n seeded samples per prompt in one engine call,
each equal to its standalone request), budget forcing (`tts.effort`: the thinking budget is
never exceeded; forced answers when it is hit, a clean stop at the marker otherwise), the effort
system line through the real chat template, and `jaxinfer-tts` end to end on a tiny model.

The engine runs a toy model with a character tokenizer (id i <-> one character), so texts,
stop strings and the chat-rendered continuation are exact without a real vocabulary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxinfer.cli.tts import ladder, pass_at_k_rows, run_strategy, self_consistency_rows
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama, init_params
from jaxinfer.tts import EffortConfig, EngineSampler, Sample, generate_with_budget, system_prompt
from jaxinfer.tts.tasks import Problem
from tests.helpers import tiny_smollm_dir, toy_config

VOCAB = 96
# Few step variants (chunk buckets x page buckets) keep compiling short.
CACHE = CacheConfig(page_size=8, max_seq_len=160)
ENGINE = EngineConfig(max_slots=8, prefill_buckets=(32, 128), max_num_batched_tokens=256,
                      prefill_chunk_size=128)


class CharTokenizer:
    """id i <-> chr(32 + i) for printable ASCII; the last id is '\\n'. No BOS, no EOS; a chat
    template that writes "<role>:content|" per message and "a:" as the generation prompt."""

    bos_id, add_bos, eos_ids, vocab_size = None, False, (), VOCAB

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [VOCAB - 1 if c == "\n" else ord(c) - 32 for c in text]

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return "".join("\n" if i == VOCAB - 1 else chr(32 + i) for i in ids)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role'][0]}:{m['content']}|" for m in messages)
        return text + ("a:" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def model() -> Llama:
    config = toy_config(vocab_size=VOCAB, max_position=256)
    params = init_params(config, seed=5, scale=0.3)
    params["lm_head"] *= 4.0  # peaked but not degenerate: samples differ, sampling is stable
    return Llama(config, params)


def make_llm(model) -> LLM:
    return LLM(model, CharTokenizer(), cache=CACHE, engine=ENGINE)


PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2], [27, 18, 28, 18, 28, 45, 9, 4, 5]]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=11, ignore_eos=True)


def test_samples_are_seeded_requests_in_one_call(model):
    llm = make_llm(model)
    sampler = EngineSampler(llm, SAMPLING, chat=False)
    samples = sampler.sample(PROMPTS, 3)
    assert [len(row) for row in samples] == [3, 3]
    assert sampler.cost.calls == 1 and sampler.cost.requests == 6
    assert [[s.extra["seed"] for s in row] for row in samples] == [[11, 12, 13]] * 2
    assert len({s.text for s in samples[0]}) > 1  # different seeds, different samples
    alone = make_llm(model)
    for prompt, row in zip(PROMPTS, samples):
        for s in row:
            sc = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=s.extra["seed"],
                                ignore_eos=True)
            [out] = alone.generate([prompt], sc, use_tqdm=False)
            assert s.text == out.text and s.num_tokens == 8 == s.extra["answer_tokens"]
            assert s.prompt_tokens == len(prompt)
    assert sampler.cost.decode_tokens == 6 * 8
    assert sampler.cost.prefill_computed + sampler.cost.prefill_reused == 3 * sum(map(len,
                                                                                    PROMPTS))


def test_repeated_calls_continue_the_seed_sequence(model):
    sampler = EngineSampler(make_llm(model), SAMPLING, chat=False)
    first = sampler.sample(PROMPTS[:1], 2)[0]
    second = sampler.sample(PROMPTS[:1], 2)[0]
    assert [s.extra["seed"] for s in first + second] == [11, 12, 13, 14]
    sampler.reset()
    again = sampler.sample(PROMPTS[:1], 2)[0]
    assert [s.text for s in again] == [s.text for s in first]


def test_samples_of_a_prompt_are_forked_from_one_prefill(model):
    prompt = list(range(1, 31))  # 30 tokens: 3 full pages of 8 and a partial one
    n = 6
    plain = EngineSampler(make_llm(model), SAMPLING, chat=False)
    primed = EngineSampler(make_llm(model), SAMPLING, chat=False, prime_prefix=True)
    a, b = plain.sample([prompt], n)[0], primed.sample([prompt], n)[0]
    assert [s.text for s in a] == [s.text for s in b]  # sharing pages changes no sample
    assert plain.cost.calls == 1 and primed.cost.calls == 2
    # one request with n = 6: the prompt once (charged to sample 0); every sample draws its
    # first token from the prompt's last logits, so computes no row
    assert [s.extra["prompt_computed"] for s in a] == [30] + [0] * (n - 1)
    assert [s.extra["prompt_reused"] for s in a] == [0] + [30] * (n - 1)
    assert plain.cost.prefill_computed == 30
    # primed: the primer computes all 30; the fork's parent then finds 3 full pages cached
    assert primed.cost.prefill_computed == 30 + 6


def test_budget_is_never_exceeded_and_forcing_appends_the_marker(model):
    llm = make_llm(model)
    effort = EffortConfig(level="low", budgets={"low": 5}, answer_budget=3)
    sampler = EngineSampler(llm, SAMPLING, effort=effort)
    samples = sampler.sample(["What is 2 + 3?", "Name a color."], 4)
    for s in (s for row in samples for s in row):
        assert s.extra["thinking_tokens"] <= 5 and s.extra["answer_tokens"] <= 3
        # a toy model never writes "Final answer:" by itself: every sample hits the budget
        assert s.extra["forced"] and s.extra["phase1_finish"] == "length"
        assert s.extra["thinking_tokens"] == 5 and "\nFinal answer:" in s.text
        assert s.num_tokens == s.extra["thinking_tokens"] + s.extra["answer_tokens"]
    assert sampler.cost.calls == 2  # thinking for all, then answers for all


def test_continuation_is_prompt_thinking_and_force_ids_and_reuses_pages(model):
    llm, tok = make_llm(model), CharTokenizer()
    effort = EffortConfig(level="medium", budgets={"medium": 9}, answer_budget=4)
    calls = []

    def generate(prompts, configs, chat):
        calls.append([c.max_new_tokens for c in configs])
        return llm.generate(prompts, configs, chat=chat, use_tqdm=False)

    system = system_prompt("medium")
    [b] = generate_with_budget(generate, tok, VOCAB, ["Add 2 and 3."], [SAMPLING], effort,
                               system=system)
    chat_ids = tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Add 2 and 3."}]))
    assert calls == [[9], [4]]
    assert b.prompt_ids == chat_ids and len(b.thinking_ids) == 9 and b.forced
    assert b.answer.prompt_ids == chat_ids + b.thinking_ids + tok.encode("\nFinal answer:")
    # phase 2 found phase 1's full pages (prompt + thinking) in the prefix cache
    assert b.answer.metrics.prompt_reused >= (len(chat_ids) + 9) // 8 * 8 - 8


def test_stopping_at_the_marker_is_not_forced(model):
    llm, tok = make_llm(model), CharTokenizer()
    greedy = SamplingConfig(max_new_tokens=12, ignore_eos=True)
    system = system_prompt("low", marker="?")
    [probe] = llm.generate(["Hi."], greedy, chat=True, system=system, use_tqdm=False)
    # the marker: a character the greedy model writes at position >= 2 and not before
    pos = next(i for i in range(2, 12) if probe.text[i] not in probe.text[:i])
    marker = probe.text[pos]
    effort = EffortConfig(level="low", budgets={"low": 12}, answer_budget=2, marker=marker,
                          force_text="\n" + marker)
    [b] = generate_with_budget(lambda p, c, chat: llm.generate(p, c, chat=chat, use_tqdm=False),
                               tok, VOCAB, ["Hi."], [greedy], effort, system=system)
    assert not b.forced and b.phase1_finish == "stop"
    assert b.thinking_ids == probe.token_ids[:pos] and b.joint == marker
    assert b.text.startswith(probe.text[:pos + 1])


def test_effort_config_validates():
    assert EffortConfig(level="high").budget == 1024
    assert EffortConfig(level="low", budgets={"low": 7}).budgets["medium"] == 256
    with pytest.raises(ValueError, match="level"):
        EffortConfig(level="max")
    with pytest.raises(ValueError, match="positive"):
        EffortConfig(budgets={"low": 0})
    with pytest.raises(ValueError, match="must end with"):
        EffortConfig(force_text="\nAnswer:")
    with pytest.raises(ValueError, match="chat"):
        EngineSampler(None, SAMPLING, chat=False, effort=EffortConfig())


def test_effort_system_line_through_the_real_chat_template():
    from jaxinfer.checkpoint.tokenizer import Tokenizer
    from jaxinfer.checkpoint.weights import default_model_path
    from jaxinfer.engine.prompts import encode_prompt

    tok = Tokenizer.from_gguf_file(default_model_path())
    system = system_prompt("high", "You are terse.")
    ids = encode_prompt(tok, tok.vocab_size, "What is 2 + 3?", chat=True, system=system)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nReasoning: high\nYou are terse.\nThink step by "
                           "step, then give your answer after 'Final answer:'.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    thinking = tok.encode("2 plus 3 is 5.", add_special_tokens=False)
    continued = tok.decode(ids + thinking + tok.encode("\nFinal answer:", add_special_tokens=False))
    assert continued.endswith("<|im_start|>assistant\n2 plus 3 is 5.\nFinal answer:")


# -- the CLI ----------------------------------------------------------------------------------


def _problems():
    return [Problem("a", "What is 1 + 1?", "2"), Problem("b", "What is 2 + 2?", "4")]


def _fake(texts):
    return [[Sample(t) for t in row] for row in texts]


def test_summaries():
    assert ladder(8) == [1, 2, 4, 8] and ladder(6) == [1, 2, 4, 6] and ladder(1) == [1]
    samples = _fake([["Final answer: 3", "Final answer: 2", "The answer is 2.", "7"],
                     ["Final answer: 4"] * 4])
    rows = self_consistency_rows(_problems(), samples)
    assert [r["n"] for r in rows] == [1, 2, 4]
    # n=2 ties 3 and 2 (the first seen wins); at n=4 the two 2s outvote the rest
    assert [r["majority_acc"] for r in rows] == [0.5, 0.5, 1.0]
    assert rows[2]["single_acc"] == 6 / 8 and rows[0]["coverage"] == 0.5
    assert pass_at_k_rows(_problems(), samples)[0] == {"k": 1, "pass_at_k": (0.5 + 1.0) / 2}


class _ListSampler:
    def __init__(self, texts):
        self.texts, self.calls = texts, []

    def sample(self, prompts, n):
        self.calls.append((list(prompts), n))
        return [[Sample(self.texts[p].pop(0)) for _ in range(n)] for p in prompts]


def test_best_of_n_rounds_batch_the_unsolved_problems():
    probs = _problems()
    texts = {probs[0].prompt: ["1", "2", "9", "9"], probs[1].prompt: ["5", "5", "5", "5"]}
    sampler = _ListSampler(texts)
    samples, rows, _ = run_strategy("best_of_n", sampler, probs, 4, stop_on_first_pass=True,
                                    batch=2)
    assert sampler.calls == [([probs[0].prompt, probs[1].prompt], 2), ([probs[1].prompt], 2)]
    assert [len(r) for r in samples] == [2, 4]
    assert rows == [{"problems": 2, "pass_rate": 0.5, "mean_drawn": 3.0, "total_drawn": 6}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_smollm_dir(str(tmp_path_factory.mktemp("tiny-smollm")))


@pytest.mark.slow  # ~20 s: the CLI in a subprocess, compiling its own steps
def test_cli_end_to_end(model_dir, tmp_path):
    out = tmp_path / "samples.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli.tts", "--compilation_cache_dir=",
         f"--model_path={model_dir}", "--strategy=self_consistency", "--n=2",
         "--task=arithmetic", "--num_problems=2", "--max_new_tokens=4", "--max_seq_len=256",
         "--reasoning_effort=low", "--thinking_budget=3", "--answer_budget=2", f"--output={out}"],
        capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4
    assert [(rec["problem_id"], rec["sample_index"], rec["seed"]) for rec in records] == [
        ("arithmetic-L1-s0-0", 0, 0), ("arithmetic-L1-s0-0", 1, 1),
        ("arithmetic-L1-s0-1", 0, 0), ("arithmetic-L1-s0-1", 1, 1)]
    assert all(rec["thinking_tokens"] <= 3 and rec["answer_tokens"] <= 2 for rec in records)
    assert "majority_acc" in r.stdout and "prefill rows computed" in r.stdout
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["strategy"] == "self_consistency" and summary["cost"]["requests"] == 8
