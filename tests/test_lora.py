"""LoRA adapters (DESIGN.md decision 18): PEFT checkpoints against peft's own outputs, rows of
several adapters and the base model in one step, paging through a small pool without
recompiling, the prefix cache keyed by adapter, and bad adapters.

The fixtures (tests/fixtures/lora_qwen3_toy, `scripts/hf_lora_fixtures.py`): three random peft
adapters on the Qwen3 toy (a: rank 4 on q, v; b: rank 8 on all seven projections with rsLoRA;
c: rank 2 on o, gate, down of layer 1), with peft's logits and 32 greedy tokens per prompt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.checkpoint.hf import read_safetensors, write_safetensors
from jaxinfer.checkpoint.lora import read_peft
from jaxinfer.checkpoint.weights import load_checkpoint
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.adapters import UnknownAdapter
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.model import CHUNK, Llama, StepBatch, lora
from tests.helpers import assert_close

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
BASE_DIR = os.path.join(FIXTURES, "hf_qwen3_toy")
LORA_DIR = os.path.join(FIXTURES, "lora_qwen3_toy")
NAMES = ("a", "b", "c")
CACHE = CacheConfig(page_size=8, max_seq_len=64)


@pytest.fixture(scope="module")
def base():
    ckpt = load_checkpoint(BASE_DIR)
    return Llama(ckpt.config, ckpt.params), np.load(os.path.join(LORA_DIR, "reference.npz"))


def _engine(model, max_loras=2, **kw) -> Engine:
    e = Engine(model, None, cache=CACHE, engine=EngineConfig(
        max_slots=4, prefill_buckets=(16,), max_loras=max_loras, max_lora_rank=8, **kw))
    for name in NAMES:
        e.add_lora(name, os.path.join(LORA_DIR, name))
    return e


def _greedy(n=32, lora_name=None) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=n, ignore_eos=True, lora=lora_name)


def _check_greedy(out, ref, name: str, prompt: str) -> None:
    want, margins = ref[f"{name}_{prompt}_greedy"].tolist(), ref[f"{name}_{prompt}_margins"]
    tie = next((i for i, m in enumerate(margins) if m < 1e-3), len(want))
    assert out[:tie] == want[:tie], (name, prompt)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_peft(base, name):
    """A prefill through the pool with the adapter in slot 1 (slot 0 holds another) gives
    peft's logits; the base model's rows (-1) stay the base model's."""
    model, ref = base
    served = model.with_lora_pool(3, 8)
    graph, state = nnx.split(served)
    params = nnx.to_pure_dict(state)
    pool = jax.tree.map(jnp.asarray, lora.pool_of(params))
    for slot, other in ((1, name), (0, "b" if name != "b" else "a")):
        adapter = read_peft(os.path.join(LORA_DIR, other), model.config, name=other,
                            max_rank=8)
        values = {i: lora.pack_layer(model.config, adapter.layers.get(i, {}), np.float32,
                                     rank=8) for i in range(model.config.num_layers)}
        pool = lora.write_slot(pool, jnp.int32(slot), values)
    nnx.replace_by_pure_dict(state, lora.with_pool(params, pool))
    served = nnx.merge(graph, state)
    for prompt in ("a", "b"):
        ids = ref[f"prompt_{prompt}"]
        ours = _prefill(served, ids, 1)
        assert_close(ours, ref[f"{name}_{prompt}_logits"], scale=10)
        np.testing.assert_allclose(_prefill(served, ids, -1), _prefill(model, ids, None),
                                   rtol=0, atol=1e-5)


@jax.jit
def _forward(model, ids, slot):
    t = ids.shape[0]
    cache = create_cache(model.config, CACHE, 1)
    positions = jnp.arange(t)[None]
    batch = StepBatch.per_slot(ids[None], positions, positions < t, cache.page_table,
                               jnp.asarray([t]), num_pages_read=CACHE.pages_per_seq, kind=CHUNK)
    if slot is not None:
        batch = dataclasses.replace(batch, lora=jnp.full((t,), slot, jnp.int32))
    return model(batch, cache.k_pages, cache.v_pages)[0]


def _prefill(model, ids, slot) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(ids, jnp.int32),
                               None if slot is None else jnp.int32(slot)))


def test_mixed_adapters_in_one_batch_match_peft_greedy(base):
    """Rows of three adapters and the base model decode together through a pool of two slots
    (so adapters page in and out as requests finish) and each gives peft's 32 greedy tokens;
    nothing compiles after the first requests of each shape."""
    model, ref = base
    e = _engine(model)
    llm = LLM.__new__(LLM)
    llm.engine = e
    runs = [(name, prompt) for name in (*NAMES, None) for prompt in ("a", "b")]
    prompts = [ref[f"prompt_{p}"].tolist() for _, p in runs]
    outs = llm.generate(prompts, [_greedy(lora_name=n) for n, _ in runs], use_tqdm=False)
    alone = Engine(model, None, cache=CACHE, engine=EngineConfig(max_slots=4,
                                                                 prefill_buckets=(16,)))
    for (name, prompt), out in zip(runs, outs):
        if name is None:
            rid = alone.add_request(ref[f"prompt_{prompt}"].tolist(), _greedy())
            alone.run()
            assert out.token_ids == alone.result(rid).token_ids
        else:
            _check_greedy(out.token_ids, ref, name, prompt)
    stats = e.stats()
    assert stats["lora_loads"] >= 3 and stats["lora_evictions"] >= 1
    assert stats["lora_requests"] == {"a": 2, "b": 2, "c": 2}
