"""The embedded default model (SmolLM2-135M-Instruct GGUF) against Hugging Face transformers.

Fixtures come from `scripts/make_hf_fixtures.py` (transformers loading the same GGUF, f32):
8 prompts (4 plain, 4 chat-templated), 48 greedy tokens each, last-position logits, and all-position
logits for two prompts. Also: the model written out as an HF directory loads back bit-identical.
The model's layers are scanned (`smollm2_scanned`: its steps compile once per layer, not 30
times); tests/test_scan_layers.py checks that the layouts agree.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoint.loading import load_model, load_tokenizer
from jaxinfer.checkpoint.weights import load_checkpoint, save_hf
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.model import CHUNK, StepBatch
from tests.helpers import TOLERANCE, rel_err

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
CACHE = CacheConfig(page_size=16, max_seq_len=256)
# Hundreds of real-model steps: compiled with XLA's optimisations (tests/conftest.py).
pytestmark = pytest.mark.optimized


@pytest.fixture(scope="module")
def fixture_cases():
    with open(os.path.join(FIXTURES, "hf_smollm2_greedy.json")) as f:
        cases = json.load(f)["cases"]
    return cases, np.load(os.path.join(FIXTURES, "hf_smollm2_logits.npz"))


@jax.jit
def _padded_logits(model, ids, n):
    t = ids.shape[0]
    cache = create_cache(model.config, CACHE, 1)
    positions = jnp.arange(t)[None]
    batch = StepBatch.per_slot(ids[None], positions, positions < n, cache.page_table, n[None],
                               num_pages_read=CACHE.pages_per_seq, kind=CHUNK)
    logits, _, _ = model(batch, cache.k_pages, cache.v_pages)
    return logits


def _all_logits(model, ids):
    """f32[T, V] logits of one sequence, one prefill through the paged cache (padded to 128,
    so every prompt shares one compiled function)."""
    padded = np.zeros((128,), np.int32)
    padded[:len(ids)] = ids
    return _padded_logits(model, padded, np.int32(len(ids)))[:len(ids)]


def _assert_logits_close(ours, ref):
    # Relative error (the tolerance table's f32 entry) over the whole vector; elementwise, 30
    # layers of f32 accumulated in a different order than torch's give |diff| up to ~7e-5 on
    # logits of magnitude ~30, so the elementwise bound scales with the logits' range.
    tol = TOLERANCE["float32"][0]
    print(f"rel err {rel_err(ours, ref):.1e}, max abs {np.abs(ours - ref).max():.1e}, "
          f"max |logit| {np.abs(ref).max():.1f}")
    assert rel_err(ours, ref) < tol
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol * 10 * np.abs(ref).max())


def test_last_position_logits_match_hf(smollm2_scanned, fixture_cases):
    model, _ = smollm2_scanned
    cases, logits = fixture_cases
    for case in cases:
        ours = np.asarray(_all_logits(model, jnp.asarray(case["prompt_ids"])))[-1]
        _assert_logits_close(ours, logits[case["name"]])


def test_all_position_logits_match_hf(smollm2_scanned, fixture_cases):
    model, _ = smollm2_scanned
    cases, logits = fixture_cases
    keys = [k for k in logits.files if k.endswith("_all")]
    assert keys
    for key in keys:
        case = next(c for c in cases if c["name"] == key[:-4])
        ours = np.asarray(_all_logits(model, jnp.asarray(case["prompt_ids"])))
        _assert_logits_close(ours, logits[key])


def test_chat_prompts_render_like_hf(smollm2_scanned, fixture_cases):
    """The chat cases' ids come from HF's template; ours must produce the same ids from text."""
    model, ckpt = smollm2_scanned
    cases, _ = fixture_cases
    tok = load_tokenizer(ckpt)
    for case in cases:
        if case["chat"]:
            text = tok.apply_chat_template([{"role": "user", "content": case["user_content"]}])
            assert tok.encode(text, add_special_tokens=False) == case["prompt_ids"]
        else:
            assert tok.encode(case["prompt_text"]) == case["prompt_ids"]


def test_hf_directory_round_trip_gives_identical_logits(smollm2_scanned, tmp_path):
    """The dequantized default model written as an HF directory loads back to identical logits."""
    model, ckpt = smollm2_scanned
    save_hf(ckpt, str(tmp_path), max_shard_bytes=300_000_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    hf_model, hf_ckpt = load_model(RunConfig(dtype="float32", scan_layers="true"),
                                   load_checkpoint(str(tmp_path)))
    assert hf_ckpt.format == "hf" and hf_ckpt.config == ckpt.config
    ids = jnp.asarray([504, 3575, 282, 4649, 314])
    np.testing.assert_array_equal(np.asarray(_all_logits(hf_model, ids)),
                                  np.asarray(_all_logits(model, ids)))


# The data x model case compiles the 30-layer model for a mesh of 8 (about 2 minutes on 2
# cores): slow. tests/test_sharding.py checks data x model == one device on toy models in CI.
@pytest.mark.parametrize("mesh_spec", [None, pytest.param("data:2,model:4",
                                                          marks=pytest.mark.slow)])
def test_serving_engine_matches_hf_under_prefix_sharing_and_preemption(smollm2_scanned,
                                                                      fixture_cases, mesh_spec):
    """The real model on the serving engine: 32-token prompt chunks beside decodes, the chat
    cases' shared system-prompt page taken from the prefix cache, and a pool too small for all
    8 requests (preemption + recompute) — still HF's greedy tokens, token for token. Also on
    data:2 x model:4 (8 CPU devices): each data shard serves 4 slots from its 16 pages (with
    its own prefix cache), SmolLM2's MLP and vocabulary split 4 ways (its 3 kv and 9 query
    heads are not divisible by 4: attention weights and pages replicated over "model")."""
    from jaxinfer import sharding

    model, ckpt = smollm2_scanned
    cases, _ = fixture_cases
    llm = LLM(model, load_tokenizer(ckpt),
              cache=CacheConfig(page_size=16, max_seq_len=176, num_pages=32),
              engine=EngineConfig(max_slots=8, prefill_buckets=(32,), prefill_chunk_size=32,
                                  max_num_batched_tokens=40),
              mesh=sharding.make_mesh(mesh_spec) if mesh_spec else None)
    results = llm.generate([c["prompt_ids"] for c in cases],
                           SamplingConfig(max_new_tokens=48, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    print(stats)
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0
    assert len(cases) >= 6 and {c["chat"] for c in cases} == {True, False}
    for case, res in zip(cases, results):
        assert len(case["greedy_ids"]) >= 32
        assert res.token_ids == case["greedy_ids"], case["name"]
        assert res.finish_reason == "length"
    assert sum(pool.num_available() for pool in llm.engine.scheduler.pools) == 32


# Each drafter compiles many verification variants of the 30-layer model (1-2 minutes on 2
# cores): slow. CI runs every drafter on toy models (tests/test_speculative.py) and the draft
# model on the real one under a constraint (tests/test_constraints.py).
@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow)
                                    for m in ("ngram", "self", "draft")])
def test_speculative_decoding_gives_hf_greedy_tokens(smollm2_scanned, fixture_cases, tmp_path,
                                                     method):
    """Speculation on the real model, 8 requests in the engine: n-gram prompt lookup, the
    self-speculative drafter (the first 4 of 30 layers), and a separate draft model smollm2 from
    an HF directory (SmolLM2's first 4 layers written out as their own checkpoint: the same
    graph as the self-speculative one, so the two share compiled steps) — HF's greedy tokens,
    token for token."""
    import dataclasses

    from jaxinfer.checkpoint.weights import Checkpoint
    from jaxinfer.engine.llm import LLM

    model, ckpt = smollm2_scanned
    cases, _ = fixture_cases
    draft = None
    if method == "draft":
        keep = 4
        params = {k: v for k, v in ckpt.params.items()
                  if not k.startswith("layers.") or int(k.split(".")[1]) < keep}
        small = Checkpoint(config=dataclasses.replace(ckpt.config, num_layers=keep),
                           params=params, path="", format="gguf", metadata=ckpt.metadata)
        save_hf(small, str(tmp_path))
        draft, _ = load_model(RunConfig(dtype="float32", scan_layers="true"),
                              load_checkpoint(str(tmp_path)))
    # The serving test's pool and buckets: its mixed_step programs serve the prompt chunks here.
    llm = LLM(model, load_tokenizer(ckpt),
              cache=CacheConfig(page_size=16, max_seq_len=176, num_pages=32),
              engine=EngineConfig(max_slots=8, prefill_buckets=(32,), prefill_chunk_size=32,
                                  max_num_batched_tokens=64, speculative_method=method,
                                  num_speculative_tokens=3, self_spec_layers=4),
              draft_model=draft)
    results = llm.generate([c["prompt_ids"] for c in cases],
                           SamplingConfig(max_new_tokens=48, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    print(method, {k: v for k, v in stats.items() if k.startswith(("spec", "accept", "mean"))})
    for case, res in zip(cases, results):
        assert res.token_ids == case["greedy_ids"], case["name"]
    assert stats["spec_accepted_tokens"] > 0
