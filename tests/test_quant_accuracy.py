"""Quantized weights on the real default model (SmolLM2-135M, whose f32 weights are the GGUF's
own Q4_1 blocks dequantized) against the f32 model.

Measured with `scripts/quant_eval.py` over the whole fixture text (docs/benchmarks.md has the
table); here a 512-position slice. All quantized models are in the GGUF layout: int8 in
asymmetric groups of 32 (`jaxinfer.checkpoint.requant`), the embedding/LM head too. Every model
here has its layers scanned (`smollm2_scanned`, `gemma3_scanned`): their long prompt chunks
compile once per layer kind, not once per layer.

- int4 read from the GGUF: its Q4_1 blocks and its Q8_0 embedding kept exactly, so the model
  computes with the f32 model's own weights: KL 0, top-1 100 % (a requantization or in-step
  dequantization error would show here first).
- int8 quantized from the f32 weights (round to nearest in groups of 32): KL 0.0003, top-1
  99.0 %; the int8 target (KL <= 0.01, top-1 >= 98 %) is met by weights alone.
- int8 weights read from the GGUF (what `--weight_dtype=int8` loads from this model) + int8
  KV cache (rows stored Hadamard-rotated, `jaxinfer.model.kv_quant`): KL 0.0013-0.0014, top-1
  98.4-99.0 % on this slice, 0.0007 / 98.65 % over the whole text: the issue's target
  (KL <= 0.01, top-1 >= 98 %), asserted as such. Most remaining disagreements are near-ties
  of the f32 model (top-1 and top-2 within 0.05 nats), so top-1 moves by a few positions under
  any rounding change; the KL is the steadier measure and is asserted with a 2x margin."""

import json
import os

import numpy as np
import pytest

from jaxinfer.checkpoint.loading import load_model, load_tokenizer
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.proof.accuracy import compare
from tests.helpers import count_compiles

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
# Measured on this slice: int4 from the file 0 / 100 %; int8 RTN 0.00030 / 99.0 %; int8 from the
# file + int8 KV 0.00131 / 99.0 % here, 0.00137 / 98.44 % in quant_eval (the two processes'
# f32 numerics differ slightly, reference perplexity 12.519367 vs 12.519385, enough to flip
# near-ties; docs/benchmarks.md); asserted with margin, the last at the top-1 target.
INT4_KL, INT4_TOP1 = 1e-4, 0.998
INT8_KL, INT8_TOP1 = 0.001, 0.98
KV8_KL, KV8_TOP1 = 0.003, 0.98


# Gemma 3 270M's Q4_K_M holds o at Q4_K, q/k/v and gate/up at Q5_0 (rows of 640 are no
# multiple of Q4_K's 256), v at Q8_0 and down at Q6_K in half the layers. int4 of it keeps the
# wider ones int8 (`requant.int8_matrices`): measured on this slice KL 0.0002, top-1 99.2 %
# (the int8 load's figures: the same weights); with every matrix rounded to 4 bits it was
# KL 1.24, top-1 63 % over 512 positions. Asserted at the int4 target.
GEMMA_INT4_KL, GEMMA_INT4_TOP1 = 0.1, 0.9


def test_int4_of_a_4bit_mix_gguf_keeps_its_wider_matrices_int8(gemma3_scanned):
    """int4 read from Gemma 3's Q4_K_M: each stored matrix one kind in every layer (o int4,
    its blocks exact; qkv, gate_up and down int8, as the file keeps them wider), and the
    next-token distributions of a 128-position slice within the int4 target of f32's."""
    model, tokenizer = gemma3_scanned
    int4, _ = load_model(RunConfig(dtype="float32", scan_layers="true", weight_dtype="int4",
                                   model_path="gemma3-270m"))
    assert int4.config.int8_matrices == ("qkv", "gate_up", "down")
    for layer in int4.layers.values():  # one stack per layer kind: each matrix of every layer
        assert layer.o.kind == "int4" and layer.o.group == 32
        assert {getattr(layer, m).kind for m in ("qkv", "gate_up", "down")} == {"int8"}
    with open(os.path.join(FIXTURES, "public_domain_text.txt"), encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())[:129]
    r = compare(model, {"int4": int4}, ids, chunk=128)["int4"]
    print(r)
    assert r.positions == 128
    assert r.mean_kl <= GEMMA_INT4_KL and r.top1 >= GEMMA_INT4_TOP1


@pytest.fixture(scope="module")
def quantized(smollm2_checkpoint):
    """{"int8": quantized from the GGUF's f32 load, "int4": read from the GGUF file}; both in
    the GGUF layout (int8 in groups of 32, `requant.int8_group_size`)."""
    ckpt = smollm2_checkpoint
    int8, _ = load_model(RunConfig(dtype="float32", scan_layers="true", weight_dtype="int8"),
                         ckpt)
    int4, _ = load_model(RunConfig(dtype="float32", scan_layers="true", weight_dtype="int4",
                                   model_path=ckpt.path))
    return {"int8": int8, "int4": int4}


@pytest.mark.optimized  # hundreds of steps (tests/conftest.py)
def test_quantized_weights_meet_accuracy_targets(smollm2_scanned, quantized):
    model, ckpt = smollm2_scanned
    assert quantized["int8"].config.int8_group_size == 32
    with open(os.path.join(FIXTURES, "public_domain_text.txt"), encoding="utf-8") as f:
        ids = load_tokenizer(ckpt).encode(f.read())[:513]
    int8_gguf, _ = load_model(RunConfig(dtype="float32", scan_layers="true", weight_dtype="int8",
                                        model_path=ckpt.path))
    models = {**quantized, "int8+kv8": int8_gguf}
    results = compare(model, models, ids, chunk=256, kv_dtypes={"int8+kv8": "int8"})
    for name, r in results.items():
        print(name, r)
    assert results["int4"].positions == 512
    assert results["int4"].mean_kl <= INT4_KL and results["int4"].top1 >= INT4_TOP1
    assert results["int8"].mean_kl <= INT8_KL and results["int8"].top1 >= INT8_TOP1
    kv8 = results["int8+kv8"]
    assert kv8.mean_kl <= KV8_KL and kv8.top1 >= KV8_TOP1
    assert kv8.perplexity < 1.01 * kv8.reference_perplexity


# ~75 s on 2 cores (warm-up compiles every step variant of the 30-layer model): slow. CI covers
# the same engine properties on int8 pages with a toy model (tests/test_kv_int8.py) and the real
# model's int8 KV accuracy above.
@pytest.mark.slow
def test_engine_with_int8_kv_shares_preempts_and_compiles_nothing_after_warmup(smollm2_scanned):
    """The real model (f32 weights) serving from an int8 KV pool: the 4 chat-templated fixture
    prompts (sharing their system prompt's pages), 16 greedy tokens each, on a 10-page pool
    with prefix caching (hits and preemptions; both leave tokens unchanged on int8 pages,
    tests/test_kv_int8.py); after warm-up the run compiles nothing; the tokens equal f32's
    (= Hugging Face's): measured 64 of 64."""
    model, ckpt = smollm2_scanned
    with open(os.path.join(FIXTURES, "hf_smollm2_greedy.json")) as f:
        cases = json.load(f)["cases"][4:8]
    prompts = [c["prompt_ids"] for c in cases]
    sc = SamplingConfig(max_new_tokens=16, ignore_eos=True)
    llm = LLM(model, load_tokenizer(ckpt),
              cache=CacheConfig(page_size=16, max_seq_len=64, num_pages=10, dtype="int8"),
              engine=EngineConfig(max_slots=4, prefill_buckets=(32,), prefill_chunk_size=32,
                                  max_num_batched_tokens=36))
    llm.engine.warmup(workload=[(p, sc) for p in prompts])
    with count_compiles() as compiles:
        out = [r.token_ids for r in llm.generate(prompts, sc, use_tqdm=False)]
    assert len(compiles) == 0, f"{len(compiles)} compiles after warm-up"
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0, stats
    same = np.mean([a == b for o, c in zip(out, cases) for a, b in zip(o, c["greedy_ids"])])
    print(f"int8 KV: {same:.1%} of greedy tokens equal f32's")
    assert same >= 0.9 and all(o[:8] == c["greedy_ids"][:8] for o, c in zip(out, cases))


# The 8 fixture prompts through the serving engine twice per dtype (minutes per dtype on 2
# cores: the step variants of the 30-layer model compile and run): slow.
@pytest.mark.slow
@pytest.mark.parametrize("kind,min_agreement", [("int8", 0.8), ("int4", 0.99)])
def test_engine_greedy_tokens_mostly_equal_f32(smollm2_scanned, quantized, kind, min_agreement):
    """Greedy tokens of the 8 fixture prompts (48 each) against f32's (= Hugging Face's):
    measured 88.3 % (int8 in groups of 32 from the f32 weights) and 100 % (int4 read from the
    GGUF: the f32 model's own weights) of positions equal, every prompt's first 12 tokens
    equal. The same requests under prefix sharing and preemption give the same tokens as on an
    engine that can neither share nor preempt."""
    _, ckpt = smollm2_scanned
    with open(os.path.join(FIXTURES, "hf_smollm2_greedy.json")) as f:
        cases = json.load(f)["cases"]
    outputs = []
    for pages, caching in ((32, True), (96, False)):
        llm = LLM(quantized[kind], load_tokenizer(ckpt),
                  cache=CacheConfig(page_size=16, max_seq_len=176, num_pages=pages),
                  engine=EngineConfig(max_slots=8, prefill_buckets=(32,), prefill_chunk_size=32,
                                      max_num_batched_tokens=40,
                                      enable_prefix_caching=caching))
        results = llm.generate([c["prompt_ids"] for c in cases],
                               SamplingConfig(max_new_tokens=48, ignore_eos=True), use_tqdm=False)
        outputs.append([r.token_ids for r in results])
        if caching:
            stats = llm.engine.stats()
            assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0
    assert outputs[0] == outputs[1]
    same = np.mean([a == b for out, c in zip(outputs[0], cases)
                    for a, b in zip(out, c["greedy_ids"])])
    print(f"{kind}: {same:.1%} of greedy tokens equal f32's")
    assert same >= min_agreement
    assert all(out[:12] == c["greedy_ids"][:12] for out, c in zip(outputs[0], cases))
