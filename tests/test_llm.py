"""`LLM.generate()` (the offline API on the engine) end to end on toy models (and streaming at
a stop string on the real default model).

greedy output == a naive loop over the numpy reference (slot reuse, chunked prefill); finish
reasons (length, eos, stop) with the real tokenizer on a crafted model; validation errors and
per-request errors; seeded sampling is batch invariant; warm-up leaves nothing to compile;
streaming adds up to the final text.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama, init_params
from tests import reference_llama
from tests.helpers import assert_close, count_compiles, toy_config, toy_model

CACHE = CacheConfig(page_size=4, max_seq_len=64)
ENGINE = EngineConfig(max_slots=2, prefill_buckets=(4, 8), max_top_logprobs=3)
RNG = np.random.default_rng(7)
# Lengths 3, 11 (chunks 8 + 4), 6, 17 (8 + 8 + 4): two longer than the largest bucket (8).
PROMPTS = [[int(t) for t in RNG.integers(0, 64, n)] for n in (3, 11, 6, 17)]


def greedy(max_new_tokens: int = 12, **kw) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def toy():
    return toy_model()


class _LLM(LLM):
    """LLM without the progress bar."""

    def generate(self, *args, **kw):
        return super().generate(*args, use_tqdm=False, **kw)


@pytest.fixture(scope="module")
def gen(toy):
    return _LLM(toy[0], None, cache=CACHE, engine=ENGINE)


def naive_greedy(config, params, prompt: list[int], num_tokens: int):
    """Recomputes the whole sequence with the reference each step; (tokens, logits per step)."""
    ids, logits = list(prompt), []
    for _ in range(num_tokens):
        row = reference_llama.forward(config, params, ids)[-1]
        top2 = np.sort(row)[-2:]
        assert top2[1] - top2[0] > 1e-3, "near tie: the comparison would be ill-posed"
        logits.append(row)
        ids.append(int(np.argmax(row)))
    return ids[len(prompt):], logits


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


# ----- greedy == naive loop ---------------------------------------------------------------------
def test_greedy_matches_naive_loop(toy, gen):
    model, params = toy
    sc = greedy(12, logprobs=True, top_logprobs=2)
    results = gen.generate(PROMPTS, sc)  # 4 prompts over 2 slots: slots are reused
    for prompt, res in zip(PROMPTS, results, strict=True):
        want, logits = naive_greedy(model.config, params, prompt, 12)
        assert res.prompt_ids == prompt
        assert res.token_ids == want
        assert res.finish_reason == "length" and res.error is None and res.text == ""
        ref_lp = np.array([log_softmax(row) for row in logits])
        assert len(res.logprobs) == len(res.token_ids)
        assert_close(res.logprobs, ref_lp[np.arange(12), want], scale=10)
        assert len(res.top_logprobs) == 12
        for pairs, ref in zip(res.top_logprobs, ref_lp, strict=True):
            assert len(pairs) == 2
            ids, lps = zip(*pairs, strict=True)
            assert list(lps) == sorted(lps, reverse=True)
            assert list(ids) == list(np.argsort(-ref)[:2])
            assert_close(lps, ref[list(ids)], scale=10)
        assert len(res.metrics.token_times) == 12


def test_length_is_exact_and_logprobs_off_by_default(gen):
    budgets = [1, 2, 5, 12]
    results = gen.generate(PROMPTS, [greedy(n) for n in budgets])
    full = gen.generate(PROMPTS, greedy(12))
    for n, res, ref in zip(budgets, results, full, strict=True):
        assert res.finish_reason == "length" and len(res.token_ids) == n
        assert res.token_ids == ref.token_ids[:n]
        assert res.logprobs is None and res.top_logprobs is None


# ----- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, sc, message", [
    ("", greedy(), "empty prompt"),
    ([], greedy(), "empty prompt"),
    ([1] * 60, greedy(5), r"prompt \(60 tokens\) \+ max_new_tokens \(5\) = 65 exceeds the "
                          r"context of 64 tokens"),
    ([1, -1], greedy(), r"token id -1 out of range: valid ids are \[0, 64\)"),
    ([64], greedy(), r"token id 64 out of range: valid ids are \[0, 64\)"),
    ([1], greedy(top_logprobs=4), "top_logprobs=4 exceeds the engine's max_top_logprobs=3"),
])
def test_bad_requests_raise(gen, prompt, sc, message):
    with pytest.raises(ValueError, match=f"prompt 1: {message}"):
        gen.generate([[1, 2], prompt], [greedy(), sc])


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-0.1), "temperature=-0.1 must be >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k=-2 must be >= 0"),
])
def test_bad_sampling_raises(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kw)


def test_text_prompt_needs_a_tokenizer(gen):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        gen.generate("hello")


def test_bad_request_does_not_spoil_the_others(gen):
    good = [PROMPTS[0], PROMPTS[3], PROMPTS[2]]
    good_sc = [greedy(8), greedy(10, temperature=0.9, seed=3), greedy(6, top_k=4, temperature=1)]
    bad = [([5, 64], greedy()), ([1] * 60, greedy(5)), ([], greedy()),
           ([3], greedy(top_logprobs=9))]
    prompts = [good[0], bad[0][0], good[1], bad[1][0], bad[2][0], good[2], bad[3][0]]
    scs = [good_sc[0], bad[0][1], good_sc[1], bad[1][1], bad[2][1], good_sc[2], bad[3][1]]
    results = gen.generate(prompts, scs, raise_on_error=False)
    alone = gen.generate(good, good_sc)
    for i in (1, 3, 4, 6):
        assert results[i].finish_reason == "error" and results[i].token_ids == []
        assert results[i].error
    assert "token id 64 out of range" in results[1].error
    assert "exceeds the context" in results[3].error
    assert "empty prompt" in results[4].error
    assert "top_logprobs=9" in results[6].error
    for res, ref in zip([results[0], results[2], results[5]], alone, strict=True):
        assert res.error is None and res.finish_reason == "length"
        assert res.token_ids == ref.token_ids


def test_sampling_count_mismatch(gen):
    with pytest.raises(ValueError, match="2 prompts but 3 sampling configs"):
        gen.generate(PROMPTS[:2], [greedy()] * 3)


# ----- seeded sampling --------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_batch_invariant(gen):
    p = PROMPTS[1]
    sc = greedy(12, temperature=1.0, seed=5, logprobs=True)
    alone = gen.generate([p], sc)[0]  # slot 0
    assert gen.generate([p], sc)[0].token_ids == alone.token_ids
    # Slot 0 keeps a long request; the short one in slot 1 ends, and p then takes slot 1.
    mixed = gen.generate([PROMPTS[3], PROMPTS[0], p],
                         [greedy(12, temperature=0.8, seed=1), greedy(2), sc])
    assert mixed[2].token_ids == alone.token_ids
    # Not bitwise: a step packs decode rows and prompt chunks into one matmul whose row count
    # varies, and XLA's CPU dot may then sum in another order (~1e-7 relative).
    assert_close(mixed[2].logprobs, alone.logprobs)
    other_seed = gen.generate([p], greedy(12, temperature=1.0, seed=6))[0]
    assert other_seed.token_ids != alone.token_ids


def test_top_k_one_is_greedy(gen):
    want = [r.token_ids for r in gen.generate(PROMPTS, greedy(10))]
    got = gen.generate(PROMPTS, greedy(10, temperature=0.7, top_k=1, seed=11))
    assert [r.token_ids for r in got] == want


# ----- no recompilation after warm-up -----------------------------------------------------------
def test_warmup_then_mixed_workload_compiles_nothing():
    # A config and slot count no other test uses, so warm-up really has to compile.
    config = toy_config(num_layers=1, vocab_size=80)
    model = Llama(config, init_params(config, seed=3, scale=0.3))
    g = _LLM(model, None, cache=CACHE,
             engine=EngineConfig(max_slots=3, prefill_buckets=(4, 8), max_top_logprobs=2))
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(0, 80, n)] for n in (2, 5, 9, 14, 3)]
    base = greedy(10)
    with count_compiles() as warm:
        g.engine.warmup(max_len=max(len(p) for p in prompts) + base.max_new_tokens)
    assert len(warm) > 0
    workload = [
        greedy(10),
        greedy(10, temperature=0.8, top_p=0.9, seed=1, logprobs=True),
        greedy(7, temperature=1.0, top_k=5, seed=2, top_logprobs=2),
        greedy(10, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
               logprobs=True, top_logprobs=1),
        greedy(1, temperature=1.2, min_p=0.1, seed=3),
    ]
    with count_compiles() as after:
        first = g.generate(prompts, workload)
        g.generate(prompts[::-1], workload)
        g.generate(prompts[1:3], [greedy(4, temperature=0.5, seed=9), greedy(10)])
    assert len(after) == 0, f"{len(after)} compiles after warm-up"
    assert [len(r.token_ids) for r in first] == [10, 10, 7, 10, 1]


# ----- finish reasons and streaming with the real tokenizer -------------------------------------
HELLO, THE, QUICK, FOX, PARTIAL, OTHER = 19556, 378, 2365, 16438, 175, 100  # SmolLM2 ids
# 175 is the byte-level token of the lone byte 0xE4: the start of a 3-byte UTF-8 character.


@pytest.fixture(scope="module")
def tokenizer():
    from jaxinfer.checkpoint.tokenizer import Tokenizer
    from jaxinfer.checkpoint.weights import default_model_path

    tok = Tokenizer.from_gguf_file(default_model_path())
    assert tok.encode("Hello") == [HELLO] and tok.decode([THE, QUICK, FOX]) == " The quick fox"
    assert tok.decode([PARTIAL]) == "\ufffd"
    return tok


def chain_model(eos: int) -> Llama:
    """A 1-layer model with the real vocabulary whose greedy successor of a token is fixed:
    Hello -> " The" -> " quick" -> " fox" -> EOS, and OTHER -> PARTIAL -> " quick".

    Attention and MLP outputs are zeroed, so the logits depend on the current token only: its
    embedding is a scaled one-hot e_i and lm_head row i puts a large logit on its successor.
    """
    config = toy_config(vocab_size=49152, embed_dim=16, num_layers=1, num_q_heads=2,
                        num_kv_heads=1, head_dim=8, ffn_dim=16)
    params = init_params(config, seed=0, scale=0.02)
    params["layers.0.o"][:] = 0
    params["layers.0.down"][:] = 0
    params["final_norm"][:] = 1
    edges = [(HELLO, THE), (THE, QUICK), (QUICK, FOX), (FOX, eos), (OTHER, PARTIAL),
             (PARTIAL, QUICK)]
    for i, (tok, successor) in enumerate(edges):
        params["embed"][tok] = 0
        params["embed"][tok, i] = 4.0
        params["lm_head"][i, successor] = 10.0
    return Llama(config, params)


@pytest.fixture(scope="module")
def text_gen(tokenizer):
    model = chain_model(tokenizer.eos_ids[0])
    return _LLM(model, tokenizer, cache=CacheConfig(page_size=4, max_seq_len=32),
                engine=EngineConfig(max_slots=2, prefill_buckets=(4,)))


def test_eos_stops(text_gen, tokenizer):
    eos = tokenizer.eos_ids[0]
    res = text_gen.generate("Hello", SamplingConfig(max_new_tokens=10))[0]
    assert res.prompt_ids == [HELLO]
    assert res.finish_reason == "eos" and res.token_ids == [THE, QUICK, FOX, eos]
    assert res.text == " The quick fox" and tokenizer.decode([eos]) not in res.text
    ignored = text_gen.generate("Hello", SamplingConfig(max_new_tokens=6, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids[:4] == res.token_ids
    assert len(ignored.token_ids) == 6


@pytest.mark.parametrize("stop, tokens, text", [
    (("quick",), [THE, QUICK], " The "),
    (("e qu", "fox"), [THE, QUICK], " Th"),  # completed by a later token than it starts in
    (("fox", "The quick"), [THE, QUICK], " "),
    (("zebra",), [THE, QUICK, FOX, None], " The quick fox"),  # never hit: EOS ends it
])
def test_stop_strings(text_gen, tokenizer, stop, tokens, text):
    tokens = [t if t is not None else tokenizer.eos_ids[0] for t in tokens]
    res = text_gen.generate("Hello", SamplingConfig(max_new_tokens=10, stop=stop))[0]
    assert res.token_ids == tokens and res.text == text
    assert res.finish_reason == ("eos" if tokens[-1] in tokenizer.eos_ids else "stop")


def test_streaming_adds_up_to_the_final_text(text_gen, tokenizer):
    """Each prompt index streams its tokens in order; the texts concatenate to the final text,
    and no prefix of a stream shows text the final text lacks: " The" may begin the stop
    string "e qu", so its "e" waits until " quick" completes the stop and is dropped with it
    (and " qu" of "ick"'s request waits until "ick" completes it)."""
    streamed: dict[int, list[tuple[int, str]]] = {i: [] for i in range(5)}
    results = text_gen.generate(
        ["Hello", [OTHER], [OTHER], "Hello", "Hello"],
        [SamplingConfig(max_new_tokens=10), SamplingConfig(max_new_tokens=1),
         SamplingConfig(max_new_tokens=3), SamplingConfig(max_new_tokens=10, stop=("ick",)),
         SamplingConfig(max_new_tokens=10, stop=("fox", "e qu"))],
        on_output=lambda i, out: streamed[i].append((out.token_id, out.text)))
    assert [r.finish_reason for r in results] == ["eos", "length", "length", "stop", "stop"]
    assert results[3].text == " The qu" and results[4].text == " Th"
    assert [text for _, text in streamed[4]] == [" Th", ""]
    assert results[1].token_ids == [PARTIAL]
    assert results[1].text == "\ufffd"  # the incomplete character, flushed at the end
    for i, res in enumerate(results):
        assert [tok for tok, _ in streamed[i]] == res.token_ids
        texts = [text for _, text in streamed[i]]
        assert "".join(texts) == res.text
        assert all(res.text.startswith("".join(texts[:k])) for k in range(len(texts)))
    assert results[0].text == " The quick fox"


def test_an_abort_releases_what_the_stream_held_back(text_gen):
    """" The" streams " Th" and holds "e" back (it may begin the stop string "e qu"); aborting
    the request then releases it: the abort's output (no token) carries "e"."""
    eng = text_gen.engine
    rid = eng.add_request("Hello", SamplingConfig(max_new_tokens=10, stop=("e qu",)))
    outs = []
    while not outs:
        outs = eng.step()
    assert [(o.token_id, o.text, o.finished) for o in outs] == [(THE, " Th", False)]
    [last] = eng.abort(rid)
    assert (last.request_id, last.token_id, last.text) == (rid, None, "e")
    assert last.finished and last.finish_reason == "abort"
    assert eng.abort(rid) == []  # already ended
    eng.run()  # the step in flight drops its token
    res = eng.result(rid)
    assert (res.finish_reason, res.token_ids, res.text) == ("abort", [THE], " The")
    eng.forget(rid)


# ----- streaming at a stop string on the real default model -------------------------------------
STORY = "Write a short story about a clockmaker who builds a mechanical bird."
REPEAT = ("Repeat this sentence: The clockmaker built a mechanical bird, and he wound it up "
          "with care.")


def _collect(streamed: dict[int, list[str]], i: int, out) -> None:
    streamed[i].append(out.text)


@pytest.fixture(scope="module")
def story_streams(smollm2_scanned) -> dict:
    """Greedy runs of STORY (stop "nd he", completed by " he" after "...detail and") and REPEAT
    (stop "d, and he w", across five tokens the n-gram drafter copies from the prompt), streamed,
    on the default model without and with n-gram speculation: {method: (Completions, streamed
    texts per prompt, engine stats)}."""
    from jaxinfer.checkpoint.loading import load_tokenizer

    model, ckpt = smollm2_scanned
    tokenizer = load_tokenizer(ckpt)
    sampling = [SamplingConfig(max_new_tokens=60, stop=("nd he",)),
                SamplingConfig(max_new_tokens=60, stop=("d, and he w",))]
    runs = {}
    for method in ("none", "ngram"):
        llm = _LLM(model, tokenizer, cache=CacheConfig(page_size=16, max_seq_len=128),
                   engine=EngineConfig(max_slots=2, prefill_buckets=(64,),
                                       speculative_method=method, num_speculative_tokens=3))
        streamed: dict[int, list[str]] = {0: [], 1: []}
        results = llm.generate([STORY, REPEAT], sampling, chat=True,
                               on_output=functools.partial(_collect, streamed))
        runs[method] = results, streamed, llm.engine.stats()
    return runs


@pytest.mark.optimized  # hundreds of real-model steps (tests/conftest.py)
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_streams_hold_back_a_stop_strings_start_on_the_default_model(story_streams, method):
    """`jaxinfer-generate --chat --stop="nd he"` on STORY streamed "...detail and" while its
    text ends "...detail a": the " and" that may begin "nd he" is now held back, and dropped
    once " he" completes the stop string. With n-gram speculation several tokens arrive per
    step (REPEAT's drafts are accepted) and the streams still add up."""
    results, streamed, stats = story_streams[method]
    assert [r.finish_reason for r in results] == ["stop", "stop"]
    assert results[0].text.endswith("attention to detail a")
    assert results[1].text.endswith("The clockmaker built a mechanical bir")
    for i, r in enumerate(results):
        assert "".join(streamed[i]) == r.text
        assert all(r.text.startswith("".join(streamed[i][:k])) for k in range(len(streamed[i])))
    assert [r.token_ids for r in results] == [r.token_ids for r in story_streams["none"][0]]
    if method == "ngram":
        assert results[1].metrics.spec_accepted > 0, stats
