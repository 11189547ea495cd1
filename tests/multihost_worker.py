"""One process of the 2-process multi-host test (tests/test_multihost.py): `python
tests/multihost_worker.py OUT_JSON [ORBAX_DIR]` with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID, JAX_PLATFORMS=cpu and XLA_FLAGS=--xla_force_host_platform_device_count=2 set.

It joins the distributed run through `sharding.maybe_initialize_distributed(True)` (the CLI's
`--multihost` path) with gloo CPU collectives, runs the toy model over a model:4 mesh that spans
both processes' devices, and process 0 alone writes the greedy token ids as JSON. With
ORBAX_DIR, the model is restored from that orbax checkpoint (`jaxinfer.checkpoint.orbax.load_orbax`
on the mesh: each process reads only the shards its devices hold) instead of built in memory.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxinfer import sharding  # noqa: E402
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig  # noqa: E402
from jaxinfer.engine.llm import LLM  # noqa: E402
from jaxinfer.model import Llama, init_params  # noqa: E402
from tests.helpers import toy_config  # noqa: E402

CACHE = CacheConfig(page_size=4, max_seq_len=64)
ENGINE = EngineConfig(max_slots=4, prefill_buckets=(8, 16), max_num_batched_tokens=24,
                      prefill_chunk_size=8)
SC = SamplingConfig(max_new_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(40, 57)), [120, 3, 64, 7, 7]]


def toy_config_and_params():
    """4 kv heads x 2 = 8 query heads, FFN 64, vocab 128: model:4 splits every weight."""
    config = toy_config(vocab_size=128, embed_dim=32, num_q_heads=8, num_kv_heads=4, head_dim=8,
                        ffn_dim=64)
    params = init_params(config, seed=11, scale=0.3)
    params["lm_head"] *= 8.0  # sharp logits: no near-ties for reduction-order noise
    return config, params


def toy_model() -> Llama:
    return Llama(*toy_config_and_params())


def run(mesh=None, model: Llama | None = None) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model or toy_model(), None, cache=CACHE, engine=ENGINE, mesh=mesh)
    return llm, [c.token_ids for c in llm.generate(PROMPTS, SC, use_tqdm=False)]




def main(out_path: str, orbax_dir: str | None = None) -> int:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    assert sharding.maybe_initialize_distributed(True)
    mesh = sharding.make_mesh("data:1,model:4")
    model = None
    if orbax_dir is not None:
        from jaxinfer.checkpoint import orbax as orbax_ckpt

        model, _, _ = orbax_ckpt.load_orbax(orbax_dir, mesh=mesh)
    llm, token_ids = run(mesh, model)
    k_pages = llm.engine.runner.kv.k_pages[0]
    ffn = llm.engine.runner.params["layers"][0]["down"]  # ("ffn", "embed"): ffn split over model
    if jax.process_index() == 0:  # the only writer, as in the CLI
        with open(out_path, "w") as f:
            json.dump({"token_ids": token_ids, "process_count": jax.process_count(),
                       "global_devices": len(jax.devices()),
                       "local_devices": len(jax.local_devices()),
                       # model:4 over 2 processes: each holds 2 of the 4 kv-head shards
                       "k_pages_spec": list(k_pages.sharding.spec),
                       "k_pages_local_shards": len(k_pages.addressable_shards),
                       "k_pages_fully_addressable": k_pages.is_fully_addressable,
                       "ffn_spec": [str(a) for a in ffn.sharding.spec],
                       "ffn_local_shards": len(ffn.addressable_shards),
                       "ffn_fully_addressable": ffn.is_fully_addressable}, f)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
