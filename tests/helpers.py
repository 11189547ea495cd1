"""Shared test helpers: a toy model and the f32/bf16 tolerance table (STYLE rule 14)."""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from jax._src import dispatch

from jaxinfer.config import DraftTree, ModelConfig, RopeConfig
from jaxinfer.model import Llama, init_params
from pallas_kernels.paged_attention.reference import group_scales

# dtype -> (atol, rtol). bf16 against an f32 reference: ~2e-2.
TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}


def toy_config(**overrides) -> ModelConfig:
    """A small random model's config; `overrides` replace its fields. Its layers are scanned
    (`ModelConfig.scan_layers`, the layout TPU and GPU serve) unless a test asks for them
    unrolled: a scanned step compiles one layer's program for all of them, and both layouts give
    the same outputs (tests/test_scan_layers.py). Tests whose subject is the unrolled layout's
    own structure (per-layer arrays, pools or names) set scan_layers=False."""
    base = dict(vocab_size=64, embed_dim=32, num_layers=2, num_q_heads=4, num_kv_heads=2,
                head_dim=8, ffn_dim=48, max_position=256, rope=RopeConfig(theta=10000.0),
                scan_layers=True)
    base.update(overrides)
    return ModelConfig(**base)


def toy_model(config: ModelConfig | None = None, seed: int = 0):
    config = config or toy_config()
    params = init_params(config, seed=seed, scale=0.3)
    return Llama(config, params), params


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(actual, expected, dtype: str = "float32", scale: float = 1.0) -> None:
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               atol=atol * scale, rtol=rtol * scale,
                               err_msg=f"rel err {rel_err(actual, expected):.2e}")


def int8_pages(args: tuple, pools=(1, 2)) -> tuple[tuple, dict]:
    """A kernel case with its float K/V pools (args[1], args[2]; NaN in every slot no sequence
    owns) quantized to int8 pages: (args with int8 pools, {"k_scales", "v_scales"}). A NaN
    slot's values become garbage (127) and its scale NaN, so a kernel that reads a dead slot
    into a result shows NaN."""
    args, scales = list(args), []
    for i in pools:
        x = np.asarray(args[i], np.float32)
        dead = np.isnan(x).any(-1)
        x = np.where(np.isnan(x), 0.0, x)
        scale = np.abs(x).max(-1) / 127.0
        q = np.round(x / np.where(scale > 0, scale, 1.0)[..., None])
        args[i] = jax.numpy.asarray(np.where(dead[..., None], 127, q), jax.numpy.int8)
        scale = np.where(dead, np.nan, scale).astype(np.float32)  # [K, pages, page_size]
        scales.append(group_scales(scale))  # the pool's layout
    return tuple(args), {"k_scales": scales[0], "v_scales": scales[1]}


def stacked(x, *, layer: int = 1, num_layers: int = 3):
    """x (one layer's pool or scales) as row `layer` of a stack of `num_layers` (the scanned
    layout's stacked pool, [L, ...]), every other row poisoned: NaN (int8 values: 127, which
    their NaN scales then poison), so a kernel that reads another layer's row shows NaN."""
    if x is None:
        return None
    x = jax.numpy.asarray(x)
    fill = 127 if x.dtype == jax.numpy.int8 else np.nan
    rows = [x if i == layer else jax.numpy.full_like(x, fill) for i in range(num_layers)]
    return jax.numpy.stack(rows)


def tree_case(spec: str, lengths: list[int]) -> tuple[dict, int]:
    """({"tree_mask", "tree_base"}, T) for a draft tree `spec` verified at the end of each row
    (its root at lengths - T), the rows' masks the tree's ancestor bits."""
    tree = DraftTree.parse(spec)
    bits = np.broadcast_to(tree.ancestor_bits(), (len(lengths), tree.num_nodes + 1, tree.words))
    t = tree.num_nodes + 1
    return {"tree_mask": jax.numpy.asarray(bits.copy()),
            "tree_base": jax.numpy.asarray(np.asarray(lengths) - t, jax.numpy.int32)}, t


# ----- compile counting -------------------------------------------------------------------------
_compile_log: list[list[str]] = []  # the listener appends to the innermost open recording
_listener_registered = False


def _on_event(event: str, duration: float, fun_name: str = "", **_) -> None:
    if event == dispatch.BACKEND_COMPILE_EVENT and _compile_log:
        _compile_log[-1].append(fun_name)


@contextlib.contextmanager
def count_compiles():
    """Records the XLA executables made inside the block, on any thread: the list of their
    functions' names, one per executable. jax reports each as a backend compile, also one read
    back from the persistent compilation cache (`tests/conftest.py`). (jax cannot unregister
    the listener, so it is registered once and only records while a block is open.)"""
    global _listener_registered
    if not _listener_registered:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _listener_registered = True
    _compile_log.append([])
    try:
        yield _compile_log[-1]
    finally:
        _compile_log.pop()


def tiny_smollm_dir(path: str) -> str:
    """A one-layer random model with SmolLM2's vocabulary and tokenizer, as an HF directory:
    real tokenizer, fast compiles (CLI tests)."""
    from jaxinfer.checkpoint.tokenizer import Tokenizer
    from jaxinfer.checkpoint.weights import Checkpoint, default_model_path, save_hf

    config = toy_config(vocab_size=49152, embed_dim=16, num_layers=1, ffn_dim=32,
                        max_position=512, tie_embeddings=True)
    save_hf(Checkpoint(config, init_params(config, seed=0), path, "hf", {}), path)
    Tokenizer.from_gguf_file(default_model_path()).save_hf(path)
    return path


def prefill_rows(model, tokens, page_table, k_pages, v_pages, *, num_pages_read: int,
                 start: int = 0):
    """B sequences' tokens [B, T] at positions start.. (one CHUNK group row each, page-table
    row b) through the model's forward: (logits f32[B, T, V], k_pages, v_pages). One compiled
    program per multiple of 16 tokens: T is padded up to it with rows that are not valid (they
    write the trash page and their logits are dropped), so the tests' many prompt lengths
    share a few programs instead of each compiling the forward's every operation."""
    tokens = np.asarray(tokens, np.int32)
    b, t = tokens.shape
    padded = np.pad(tokens, ((0, 0), (0, -t % 16)))
    logits, k_pages, v_pages = _prefill_rows(model, padded, np.asarray(page_table, np.int32),
                                             k_pages, v_pages, np.int32(t),
                                             num_pages_read=num_pages_read, start=start)
    return logits[:, :t], k_pages, v_pages


@functools.partial(jax.jit, static_argnames=("num_pages_read", "start"))
def _prefill_rows(model, tokens, page_table, k_pages, v_pages, length, *, num_pages_read: int,
                  start: int):
    import jax.numpy as jnp

    from jaxinfer.model import CHUNK, StepBatch

    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))
    batch = StepBatch.per_slot(tokens, positions, positions < start + length, page_table,
                               jnp.full((b,), start + length, jnp.int32),
                               num_pages_read=num_pages_read, kind=CHUNK)
    logits, k_pages, v_pages = model(batch, k_pages, v_pages)
    return logits.reshape(b, t, -1), k_pages, v_pages


# ----- servers ----------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(engine, **config):
    """`jaxinfer.serve` on `engine` (already built), in this process: uvicorn on a thread on
    127.0.0.1 at a free port. Yields (base url, the `Server`); stops the server (and its engine
    thread) on exit. `config`: `ServerConfig` fields (served_model_name defaults to "test")."""
    import threading
    import time

    import uvicorn

    from jaxinfer.serve.app import build_app
    from jaxinfer.serve.server import Server, ServerConfig

    server = Server(lambda: engine, ServerConfig(**{"served_model_name": "test", **config}))
    loop = server.engine_loop
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (uv.started and loop.ready.is_set()):
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        uv.should_exit = True
        thread.join(30)


def release_behind_window(table, first_positions, window: int, page: int):
    """`table` (i32[B, P]) with each row's pages wholly behind its window (before the page of
    key first_positions[b] - window + 1) pointing at a page no row holds, all NaN in the cases
    built here: what a hybrid pool's released local pages read like (its trash page)."""
    table = np.array(table)
    spare = int(np.setdiff1d(np.arange(table.max() + 2), table)[0])
    for b, first in enumerate(np.asarray(first_positions)):
        behind = max(0, int(first) - window + 1) // page
        table[b, :behind] = spare
    return jax.numpy.asarray(table, np.int32)


def require_cuda_compiler() -> None:
    """Compile-only sm_90a devices (the test extra's `jax[cuda13-local]` and ptxas, installed on
    Linux): a test that needs them fails on Linux without them (a broken install must not pass
    as a skip) and is skipped elsewhere, where the extra does not install them."""
    import sys

    import pytest
    from jax.experimental import topologies

    from pallas_kernels.platform import GPU_TARGETS

    try:
        topologies.get_topology_desc("h100", "cuda", target_config=GPU_TARGETS["h100"],
                                     topology="1x1x1")
    except (NotImplementedError, RuntimeError) as e:
        if sys.platform == "linux":
            pytest.fail(f"no compile-only CUDA plugin; pip install -e '.[test]' installs it: {e}")
        pytest.skip(f"the compile-only CUDA plugin is Linux-only ({sys.platform})")


def write_peft_adapter(path: str, config, *, targets=("q_proj", "v_proj"), rank: int = 4,
                       alpha: float = 8.0, seed: int = 0, scale: float = 0.3) -> str:
    """A random LoRA adapter for a model of `config` as `peft` saves one (adapter_config.json
    + adapter_model.safetensors in `path`), both factors random (peft's B = 0 would be a no-op)."""
    import json
    import os

    from jaxinfer.checkpoint.hf import write_safetensors
    from jaxinfer.model.lora import canonical_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            target = module.removesuffix("_proj")
            a_shape, b_shape = canonical_shapes(config, target, rank)
            parent = "self_attn" if target in ("q", "k", "v", "o") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{name}.lora_A.weight"] = (scale * rng.standard_normal(
                (rank, int(np.prod(a_shape[:-1]))))).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (scale * rng.standard_normal(
                (int(np.prod(b_shape[1:])), rank))).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                   "target_modules": list(targets), "bias": "none", "use_rslora": False,
                   "use_dora": False, "fan_in_fan_out": False}, f)
    return path
