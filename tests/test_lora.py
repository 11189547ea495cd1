"""LoRA adapters (docs/architecture.md, decision 18): PEFT checkpoints against peft's own
outputs, rows of several adapters and the base model in one step, paging through a small pool
without recompiling, the prefix cache keyed by adapter, and bad adapters; and the scanned layer
stack's pool (stacked like its weights) against the unrolled one, read in place, compiled for
TPU.

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

from jaxinfer import sharding
from jaxinfer.checkpoint.hf import read_safetensors, write_safetensors
from jaxinfer.checkpoint.lora import read_peft
from jaxinfer.checkpoint.weights import load_checkpoint
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.adapters import UnknownAdapter
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.pages import PrefixCache
from jaxinfer.model import CHUNK, Llama, StepBatch, lora
from tests.helpers import assert_close, count_compiles, rel_err

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
BASE_DIR = os.path.join(FIXTURES, "hf_qwen3_toy")
LORA_DIR = os.path.join(FIXTURES, "lora_qwen3_toy")
NAMES = ("a", "b", "c")
CACHE = CacheConfig(page_size=8, max_seq_len=64)


@pytest.fixture(scope="module")
def base():
    ckpt = load_checkpoint(BASE_DIR)
    return Llama(ckpt.config, ckpt.params), np.load(os.path.join(LORA_DIR, "reference.npz"))


@pytest.fixture(scope="module")
def scanned():
    """The Qwen3 toy with its layers scanned (`ModelConfig.scan_layers`)."""
    ckpt = load_checkpoint(BASE_DIR)
    return Llama(dataclasses.replace(ckpt.config, scan_layers=True), ckpt.params)


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
    n = min(tie, len(out))
    assert n >= min(8, len(out)) and out[:n] == want[:n], (name, prompt)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_peft(base, name):
    """A prefill through the pool with the adapter in slot 1 (slot 0 holds another) gives
    peft's logits; the base model's rows (-1) stay the base model's."""
    model, ref = base
    served = _with_adapters(model, 3, {
        slot: read_peft(os.path.join(LORA_DIR, other), model.config, name=other, max_rank=8)
        for slot, other in ((1, name), (0, "b" if name != "b" else "a"))})
    for prompt in ("a", "b"):
        ids = ref[f"prompt_{prompt}"]
        ours = _prefill(served, ids, 1)
        assert_close(ours, ref[f"{name}_{prompt}_logits"], scale=10)
        np.testing.assert_allclose(_prefill(served, ids, -1), _prefill(model, ids, None),
                                   rtol=0, atol=1e-5)


def _with_adapters(model: Llama, slots: int, adapters: dict) -> Llama:
    """`model` with a pool of `slots` slots of rank 8 holding adapters (`read_peft`) by slot,
    written as the engine writes them (`lora.slot_values`, `lora.write_slot`)."""
    c = model.config
    graph, state = nnx.split(model.with_lora_pool(slots, 8))
    params = nnx.to_pure_dict(state)
    pool = jax.tree.map(jnp.asarray, lora.pool_of(params))
    for slot, adapter in adapters.items():
        values = {i: lora.pack_layer(c, adapter.layers.get(i, {}), np.float32, rank=8)
                  for i in range(c.num_layers)}
        pool = lora.write_slot(pool, jnp.int32(slot), lora.slot_values(c, values),
                               stacked=c.scan_layers)
    nnx.replace_by_pure_dict(state, lora.with_pool(params, pool))
    return nnx.merge(graph, state)


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
    llm = LLM(model, None, cache=CACHE, engine=EngineConfig(
        max_slots=4, prefill_buckets=(16,), max_loras=2, max_lora_rank=8),
        lora_modules={name: os.path.join(LORA_DIR, name) for name in NAMES})
    e = llm.engine
    runs = [(name, prompt) for name in (*NAMES, None) for prompt in ("a", "b")]
    prompts = [ref[f"prompt_{p}"].tolist() for _, p in runs]
    outs = llm.generate(prompts, _greedy(), lora=[n for n, _ in runs], use_tqdm=False)
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


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
def test_adapters_page_through_the_pool_without_recompiling(base, scanned, layout):
    """After warm-up, requests for three adapters through a pool of two slots (adapters paged
    in, evicted, paged in again; one unloaded and loaded again) and the base model compile
    nothing, and each adapter's tokens are the ones it gives alone (peft's), in both layouts
    of the layer stack (scanned: one write fills a slot of every layer of the stacked pool)."""
    model, ref = base
    e = _engine(model if layout == "unrolled" else scanned)
    ids = ref["prompt_a"].tolist()
    e.warmup(max_len=len(ids) + 8)  # the requests' length: 3 page buckets, not 4 (48 tokens)
    with count_compiles() as compiles:
        rids = [(name, e.add_request(ids, _greedy(8, name)))
                for name in ("a", "b", "c", None, "a", "c", "b")]
        e.run()
        e.remove_lora("c")
        e.add_lora("c", os.path.join(LORA_DIR, "c"))
        rids.append(("c", e.add_request(ids, _greedy(8, "c"))))
        e.run()
    assert len(compiles) == 0, f"{len(compiles)} compiles after warm-up"
    for name, rid in rids:
        if name is not None:
            _check_greedy(e.result(rid).token_ids, ref, name, "a")
    assert e.stats()["lora_loads"] >= 5


def test_prefix_cache_is_keyed_by_adapter():
    cache = PrefixCache(page_size=2)
    tokens = [1, 2, 3, 4, 5]
    cache.insert(tokens, [7, 8], namespace="a#0")
    assert cache.match(tokens, "a#0") == [7, 8]
    assert cache.match(tokens) == [] and cache.match(tokens, "b#1") == []
    cache.insert(tokens, [9, 10])
    assert cache.match(tokens) == [9, 10] and cache.match(tokens, "a#0") == [7, 8]


def _bad_copy(tmp_path, name="a", tensors=None, settings=None) -> str:
    """A copy of fixture adapter `name` with its tensors / settings changed."""
    path = str(tmp_path / f"bad_{name}")
    shutil.copytree(os.path.join(LORA_DIR, name), path)
    if tensors is not None:
        weights = os.path.join(path, "adapter_model.safetensors")
        # copies: the reader maps the file, which is then written over
        values = {k: np.array(v) for k, v in read_safetensors(weights).items()}
        os.remove(weights)
        write_safetensors(weights, tensors(values))
    if settings is not None:
        config = os.path.join(path, "adapter_config.json")
        with open(config) as f:
            values = json.load(f)
        with open(config, "w") as f:
            json.dump({**values, **settings}, f)
    return path


def _renamed(old: str, new: str):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("change, message", [
    (dict(remove="adapter_model.safetensors"),
     "adapter_model.safetensors does not exist"),
    (dict(tensors=_renamed("self_attn.q_proj", "mlp.experts.0.gate_proj")),
     "'base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight' is not"),
    (dict(tensors=_renamed("layers.1.", "layers.9.")), "is for layer 9, but the base model"),
    (dict(tensors=lambda t: {k: v for k, v in t.items() if k != Q_A}),
     "layers.0.self_attn.q_proj.lora_A.weight is missing"),
    (dict(tensors=lambda t: {**t, Q_A: t[Q_A][:, :32]}), "do not fit the base model's q_proj"),
    (dict(name="b", tensors=None), "has rank 8, over the pool's max_lora_rank=4"),
    (dict(tensors=lambda t: {**t, Q_A: np.where(np.arange(t[Q_A].size).reshape(
        t[Q_A].shape) == 3, np.nan, t[Q_A]).astype(t[Q_A].dtype)}),
     "q_proj.lora_A.weight holds non-finite values"),
    (dict(settings={"use_dora": True}), "sets use_dora=True"),
    (dict(settings={"peft_type": "IA3"}), "only LORA adapters"),
])
def test_bad_adapters_fail_alone_with_a_clear_error(base, tmp_path, change, message):
    """A bad adapter is refused with an error naming it and the bad tensor or setting; the
    engine keeps serving (a running request finishes as it would have)."""
    model, ref = base
    e = Engine(model, None, cache=CACHE, engine=EngineConfig(
        max_slots=2, prefill_buckets=(16,), max_loras=2, max_lora_rank=4))
    e.add_lora("a", os.path.join(LORA_DIR, "a"))
    rid = e.add_request(ref["prompt_a"].tolist(), _greedy(8, "a"))
    e.step()
    path = _bad_copy(tmp_path, change.get("name", "a"), change.get("tensors"),
                     change.get("settings"))
    if "remove" in change:
        os.remove(os.path.join(path, change["remove"]))
    with pytest.raises(ValueError, match="LoRA adapter 'bad'") as err:
        e.add_lora("bad", path)
    assert message in str(err.value)
    assert e.loras() == ["a"]
    e.run()
    _check_greedy(e.result(rid).token_ids, ref, "a", "a")


def test_unknown_adapter_fails_its_request_alone(base):
    model, ref = base
    llm = LLM(model, None, cache=CACHE, engine=EngineConfig(
        max_slots=2, prefill_buckets=(16,), max_loras=1, max_lora_rank=8),
        lora_modules={"a": os.path.join(LORA_DIR, "a")})
    with pytest.raises(UnknownAdapter, match="unknown LoRA adapter 'zz'; loaded: \\['a'\\]"):
        llm.engine.add_request([1, 2, 3], _greedy(4, "zz"))
    ids = ref["prompt_a"].tolist()
    outs = llm.generate([ids, ids], _greedy(8), lora=["zz", "a"], raise_on_error=False,
                        use_tqdm=False)
    assert outs[0].finish_reason == "error" and "'zz'" in outs[0].error
    _check_greedy(outs[1].token_ids, ref, "a", "a")
    with pytest.raises(ValueError, match="no LoRA adapter pool"):
        Engine(model, None, cache=CACHE).add_request([1, 2], _greedy(2, "a"))


def test_unloading_is_refused_while_requests_run(base):
    model, ref = base
    e = _engine(model)
    rid = e.add_request(ref["prompt_a"].tolist(), _greedy(8, "b"))
    e.step()
    with pytest.raises(ValueError, match="'b' has unfinished requests"):
        e.remove_lora("b")
    e.run()
    _check_greedy(e.result(rid).token_ids, ref, "b", "a")
    e.remove_lora("b")
    assert e.loras() == ["a", "c"] and e.stats()["lora_resident"] == 0
    with pytest.raises(UnknownAdapter):
        e.add_request([1, 2], _greedy(2, "b"))
    e.add_lora("b", os.path.join(LORA_DIR, "c"))  # the name again, another adapter
    rid = e.add_request(ref["prompt_a"].tolist(), _greedy(32, "b"))
    e.run()
    _check_greedy(e.result(rid).token_ids, ref, "c", "a")  # no K/V of the old "b" reused


@pytest.mark.parametrize("mesh, layout", [("data:2,model:4", "unrolled"),
                                          ("model:2", "unrolled"),
                                          ("data:2,model:4", "scanned")])
def test_adapters_on_a_mesh_match_peft_without_recompiling(base, scanned, mesh, layout):
    """The pool sharded like the weights (B like its projection's output, A like its input;
    on model:4 the toy's 2 kv heads are stored twice each, the pool's fused qkv B with them;
    scanned, stacked on the unsplit layers axis): peft's greedy tokens, and nothing compiles
    after warm-up."""
    model, ref = base
    model = model if layout == "unrolled" else scanned
    e = Engine(model, None, cache=CACHE, mesh=sharding.make_mesh(mesh), engine=EngineConfig(
        max_slots=4, prefill_buckets=(16,), max_loras=2, max_lora_rank=8))
    for name in NAMES:
        e.add_lora(name, os.path.join(LORA_DIR, name))
    longest = max(len(ref[f"prompt_{p}"]) for p in ("a", "b")) + 12
    e.warmup(max_len=longest)  # the requests' length: 3 page buckets, not 4 (48 tokens)
    with count_compiles() as compiles:
        rids = [(name, prompt, e.add_request(ref[f"prompt_{prompt}"].tolist(),
                                             _greedy(12, name)))
                for name in NAMES for prompt in ("a", "b")]
        e.run()
    assert len(compiles) == 0, f"{len(compiles)} compiles after warm-up"
    for name, prompt, rid in rids:
        _check_greedy(e.result(rid).token_ids, ref, name, prompt)
    whole = 2 if layout == "scanned" else 1  # the layers and slot axes are never split
    specs = [tuple(a.sharding.spec) for a in jax.tree.leaves(lora.pool_of(e.runner.params))]
    assert specs and all(axis is None for spec in specs for axis in spec[:whole])
    assert any("model" in spec for spec in specs)


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_speculative_decoding_with_adapters_is_lossless(base, method):
    """Drafts (n-gram, or the base model's first layer: a drafter never uses the adapter) are
    verified with each row's adapter: greedy tokens are peft's."""
    model, ref = base
    e = _engine(model, speculative_method=method, num_speculative_tokens=3,
                self_spec_layers=1)
    rids = [(name, e.add_request(ref["prompt_b"].tolist(), _greedy(24, name)))
            for name in (*NAMES, None)]
    e.run()
    for name, rid in rids[:3]:
        _check_greedy(e.result(rid).token_ids, ref, name, "b")


def test_forked_samples_share_the_adapter(base):
    """n samples of a prompt with an adapter: one prefill (the parent runs the adapter too),
    every sample peft's greedy tokens."""
    model, ref = base
    e = _engine(model)
    rid = e.add_request(ref["prompt_b"].tolist(), dataclasses.replace(_greedy(16, "c"), n=3))
    e.run()
    for completion in e.results(rid):
        _check_greedy(completion.token_ids, ref, "c", "b")


def test_quantized_base_weights_keep_float_adapters(base):
    """int8 base weights, float adapters: the adapter's prompt logprobs are peft's within what
    quantizing the base costs alone (measured on the base model)."""
    model, ref = base
    ckpt = load_checkpoint(BASE_DIR)
    quantized = Llama(dataclasses.replace(ckpt.config, weight_dtype="int8"), ckpt.params)
    e = _engine(quantized, max_top_logprobs=0)
    assert all(v.dtype == np.float32 for v in jax.tree.leaves(
        lora.pool_of(e.runner.params)))
    ids = ref["prompt_b"].tolist()

    def prompt_logprobs(name, engine=e):
        rid = engine.add_request(ids, SamplingConfig(max_new_tokens=1, prompt_logprobs=0,
                                                     lora=name))
        engine.run()
        return np.array(engine.result(rid).prompt_logprobs[1:])

    def peft(logits):  # peft's logprob of each next prompt token
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return logp[np.arange(len(ids) - 1), ids[1:]]

    plain = Engine(model, None, cache=CACHE, engine=EngineConfig(max_slots=2,
                                                                 prefill_buckets=(16,)))
    cost = np.abs(prompt_logprobs(None) - prompt_logprobs(None, plain)).max()
    for name in NAMES:
        err = np.abs(prompt_logprobs(name) - peft(ref[f"{name}_b_logits"])).max()
        assert err < 3 * cost + 1e-3, (name, err, cost)


def test_multihost_followers_get_the_adapters_process_0_pages_in(base, monkeypatch):
    """Process 0's runner (`multihost.Broadcaster`) sends each adapter it pages in to the
    followers (`multihost.follow`), whose pools then equal its own (the broadcast replaced by
    a list here)."""
    from jaxinfer.serve import multihost

    model, ref = base
    lead, follower = _engine(model), _engine(model)
    sent = []
    monkeypatch.setattr(multihost, "_broadcast", lambda message=None: sent.extend(message))
    lead.runner = multihost.Broadcaster(lead.runner)
    rid = lead.add_request(ref["prompt_a"].tolist(), _greedy(4, "b"))
    lead.run()
    _check_greedy(lead.result(rid).token_ids, ref, "b", "a")
    assert [name for name, _ in sent].count("write_lora") == 1
    monkeypatch.setattr(multihost, "_broadcast",
                        lambda message=None: [c for c in sent if c[0] == "write_lora"]
                        + [("stop", ())])
    assert multihost.follow(follower.runner) == 1
    ours, theirs = (lora.pool_of(e.runner.params) for e in (lead, follower))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_ALL = _ATTN + ("gate_proj", "up_proj", "down_proj")
FAMILY_TOYS = [
    ("llama", {}, _ALL), ("qwen2", dict(qkv_bias=True), _ALL),
    ("mistral", dict(sliding_window=4), _ALL), ("qwen3", dict(qk_norm=True), _ALL),
    ("gemma3", dict(qk_norm=True, post_norms=True, norm_plus_one=True, scale_embeddings=True,
                    activation="gelu_tanh", query_pre_attn_scalar=8.0, sliding_window=4,
                    sliding_window_pattern=3, tie_embeddings=True), _ALL),
    ("qwen3_moe", dict(qk_norm=True, num_experts=8, experts_per_token=2, expert_ffn_dim=16,
                       moe_layer_step=1), _ATTN),
    ("mixtral", dict(num_experts=8, experts_per_token=2), _ATTN),
    ("gpt_oss", dict(qkv_bias=True, o_bias=True, attention_sinks=True, sliding_window=4,
                     sliding_window_pattern=2, activation="swiglu_clamped", swiglu_limit=5.0,
                     num_experts=8, experts_per_token=4, router="topk_softmax",
                     router_bias=True, expert_bias=True), _ATTN),
]


@pytest.mark.parametrize("arch, extra, targets", FAMILY_TOYS, ids=[f[0] for f in FAMILY_TOYS])
def test_every_family_equals_the_merged_weights(tmp_path, arch, extra, targets):
    """For every registered family, a prefill with an adapter through the pool equals the base
    model with the adapter merged into its weights (W + scale * A B, peft's merge_and_unload);
    a mixture layer's MLP takes no dense adapter."""
    from jaxinfer.model import init_params
    from tests.helpers import toy_config, write_peft_adapter

    config = toy_config(arch=arch, num_layers=3, **extra)
    params = init_params(config, seed=3, scale=0.3)
    path = write_peft_adapter(str(tmp_path / arch), config, targets=targets, rank=4, alpha=6.0,
                              seed=4, scale=0.3)
    adapter = read_peft(path, config, name=arch, max_rank=8)
    merged = dict(params)
    for layer, factors in adapter.layers.items():
        for target, (a, b) in factors.items():
            key = f"layers.{layer}.{target}"
            merged[key] = params[key] + np.tensordot(a, b, axes=([-1], [0]))
    served = _with_adapters(Llama(config, params), 2, {1: adapter})
    ids = [3, 17, 5, 40, 9, 22, 11, 2, 30, 7]
    want = _prefill(Llama(config, merged), ids, None)
    assert rel_err(_prefill(served, ids, 1), want) < 1e-5
    assert rel_err(_prefill(served, ids, -1), want) > 1e-2  # the adapter changes the logits
    if config.num_experts:
        mlp = write_peft_adapter(str(tmp_path / "mlp"), config, targets=("up_proj",))
        with pytest.raises(ValueError, match="is a mixture-of-experts layer"):
            read_peft(mlp, config, name="mlp", max_rank=8)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_an_abstract_model_gets_an_abstract_pool(scan_layers):
    """The ahead-of-time check's model (`Llama.abstract`) with a pool allocates nothing; a
    scanned model's pool is stacked on the layers axis like its weights."""
    from tests.helpers import toy_config

    model = Llama.abstract(toy_config(num_layers=3, scan_layers=scan_layers)).with_lora_pool(4, 8)
    leaves = jax.tree.leaves(lora.pool_of(nnx.to_pure_dict(nnx.split(model)[1])))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert {x.shape[:2] if scan_layers else x.shape[:1] for x in leaves} == (
        {(3, 4)} if scan_layers else {(4,)})


# ----- the scanned layer stack (`ModelConfig.scan_layers`) ------------------------------------
# Toys whose layers scan: Llama (one kind, a scan over 3 layers) and Gemma 3's local/global
# period (2 local, 1 global) repeated twice, then a leftover local layer run unrolled.
SCAN_TOYS = {"llama": dict(num_layers=3),
             "hybrid": dict(FAMILY_TOYS[4][1], arch="gemma3", num_layers=7)}
# Three adapters of different ranks and targets (pool rank 8).
SCAN_ADAPTERS = {"x": (2, ("q_proj", "v_proj")), "y": (8, _ALL),
                 "z": (4, ("o_proj", "gate_proj", "down_proj"))}


@jax.jit
def _forward_rows(model, ids, slots):
    """f32[B * T, V]: the logits of every row of B sequences ids i32[B, T] prefilled in one
    step, sequence b's rows with adapter slot slots[b] (-1: the base model)."""
    b, t = ids.shape
    cache = create_cache(model.config, CACHE, b)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    batch = StepBatch.per_slot(ids, positions, positions < t, cache.page_table,
                               jnp.full((b,), t), num_pages_read=CACHE.pages_per_seq, kind=CHUNK)
    batch = dataclasses.replace(batch, lora=jnp.repeat(slots, t))
    return model(batch, cache.k_pages, cache.v_pages)[0]


@pytest.mark.parametrize("family", SCAN_TOYS)
def test_scanned_layers_serve_adapters_as_the_unrolled_ones(tmp_path, family):
    """A scanned model's adapter pool, stacked on the layers axis like its weights: rows of
    three adapters (ranks 2, 8, 4 on different projections) and of the base model in one batch
    give, row by row, the unrolled model's logits (f32 rounding), and through the engine (the
    adapters registered, paged into the pool, decoded together) the same greedy tokens."""
    from jaxinfer.model import init_params
    from tests.helpers import toy_config, write_peft_adapter

    config = toy_config(**SCAN_TOYS[family])
    params = init_params(config, seed=3, scale=0.3)
    paths = {name: write_peft_adapter(str(tmp_path / name), config, targets=targets, rank=rank,
                                      alpha=2.0 * rank, seed=seed)
             for seed, (name, (rank, targets)) in enumerate(SCAN_ADAPTERS.items())}
    adapters = {slot: read_peft(path, config, name=name, max_rank=8)
                for slot, (name, path) in enumerate(paths.items())}
    ids = jnp.asarray(np.random.default_rng(5).integers(0, config.vocab_size, (4, 10)),
                      jnp.int32)
    prompt = ids[0].tolist()
    logits, tokens = [], []
    for scan_layers in (False, True):
        model = Llama(dataclasses.replace(config, scan_layers=scan_layers), params)
        logits.append(np.asarray(_forward_rows(_with_adapters(model, 3, adapters), ids,
                                               jnp.asarray([0, -1, 1, 2], jnp.int32))))
        e = Engine(model, None, cache=CACHE, engine=EngineConfig(
            max_slots=4, prefill_buckets=(16,), max_loras=3, max_lora_rank=8))
        for name, path in paths.items():
            e.add_lora(name, path)
        rids = [e.add_request(prompt, _greedy(10, name)) for name in (*paths, None)]
        e.run()
        tokens.append([e.result(rid).token_ids for rid in rids])
    assert rel_err(logits[1], logits[0]) < 1e-5  # f32 rounding, as the base layers'
    assert_close(logits[1], logits[0], scale=10)  # (tests/test_scan_layers.py)
    assert tokens[1] == tokens[0]
    assert len({tuple(t) for t in tokens[0]}) > 1  # the adapters change the tokens


def test_a_scanned_step_reads_the_pool_in_place():
    """The scanned step compiled for CPU with rows of an adapter: neither the stacked pool nor
    one layer's row of it (every slot of that layer) is copied, sliced out or relaid out; each
    projection reads the used slot's factors at [layer, slot]. (XLA:CPU does copy a layer's
    weights out of their stacks: `jaxinfer.model.layers`.)"""
    import re

    from jaxinfer.engine import steps
    from jaxinfer.model import init_params
    from tests.helpers import toy_config

    config = toy_config(**SCAN_TOYS["hybrid"], scan_layers=True)
    model = Llama(config, init_params(config, seed=0)).with_lora_pool(3, 4)
    graph, params = steps.split_model(model)
    cache = create_cache(model.config, CACHE, 4)
    batch = dataclasses.replace(steps.MixedBatch.idle(4, 2 * cache.pages_per_seq),
                                lora=np.asarray([0, -1, 2, 0], np.int32))
    hlo = steps.mixed_forward.trace(graph, params, cache, jnp.zeros((4,), jnp.int32),
                                    jax.tree.map(np.asarray, batch),
                                    num_pages_read=2).lower().compile().as_text()
    pool = [x.shape for x in jax.tree.leaves(lora.pool_of(params))]
    assert pool and all(s[:2] in ((2, 3), (5, 3)) for s in pool)  # [L_kind, S, ...]
    for shape in {s for p in pool for s in (p, p[1:])}:
        dims = ",".join(map(str, shape))
        made = re.findall(rf"%\S+ = f32\[{dims}\]\S* (?:fusion|copy|dynamic-slice|transpose|"
                          rf"reshape|gather)\(.*", hlo)
        assert not made, made


def test_tpu_compiles_the_scanned_layers_with_adapters():
    """Deviceless for v5e:2x2 with an adapter pool: "auto" scans the layers on TPU whatever
    the pool, and the decode step compiles within the planner's memory (which counts the
    pool), its donated KV pool aliased and no weight or adapter pool (nor a layer's row of
    one) gathered or copied. (The roofline check is n/a: the loop over a step's adapters has
    no static trip count.)"""
    from jaxinfer.proof import aot

    run = aot.run_config(None, **{
        "mesh": "data:1,model:4", "engine.max_loras": 4, "engine.max_lora_rank": 8,
        "cache.page_size": 32, "cache.max_seq_len": 128, "engine.max_slots": 4,
        "engine.prefill_buckets": [32], "engine.max_num_batched_tokens": 64})
    report = aot.check(aot.AotConfig(model="llama-3.2-1b", target="v5e:2x2", run=run,
                                     num_layers=2, max_len=16, decode_only=True,
                                     compile_only=("mixed_forward",)), log=lambda _: None)
    assert aot.model_config(report.aot).scan_layers
    checks = {name: (ok, detail) for name, ok, detail in report.checks}
    for name in ("fits HBM", "matches planner", "no weight gathered/copied",
                 "KV pool donated and aliased"):
        assert checks[name][0] is True, (name, checks[name])
    assert not [m for e in report.executables for m in e.moves], report.executables
    assert {e.name for e in report.executables} == {"mixed_forward"}
