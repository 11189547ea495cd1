"""`ModelRunner`: one model's device state (weights, KV pool, slot state, sampling rows) and the
jitted steps run on it, on its mesh. The engine holds one for the target; a model drafter holds
one for its draft model, whose pool the target's page table also addresses."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer import sharding
from jaxinfer.config import CacheConfig, ModelConfig, SamplingConfig
from jaxinfer.engine import steps
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.model.attention import trash_page


class ModelRunner:
    """Owns (graph, params), the KV pool, the per-slot state and the per-slot sampling
    parameters of one model; every step runs under its mesh (`sharding.mesh_context`).

    Args:
      graph, params: from `steps.split_model` (already placed on `mesh`).
      config: the model's config; cache: the resolved pool config (num_pages set).
      max_slots: rows of the device batch; mesh: None = one device.
      attention_impl: resolved, "xla" or "pallas"; max_top_logprobs: static top-n width.
    """

    def __init__(self, graph: steps.ModelGraph, params: dict, *, config: ModelConfig,
                 cache: CacheConfig, max_slots: int, mesh: Mesh | None = None,
                 attention_impl: str = "xla", max_top_logprobs: int = 0):
        self.graph, self.params, self.config = graph, params, config
        self.mesh = mesh
        self.attention_impl = attention_impl
        self.max_top_logprobs = max_top_logprobs
        self.kv = create_cache(config, cache, max_slots, mesh=mesh)
        self.state = steps.create_slot_state(max_slots, config.vocab_size)
        if mesh is not None:
            self.state = sharding.replicated(self.state, mesh)
        self._slot_configs: list[SamplingConfig | None] = [None] * max_slots
        self.sampling = SamplingParams.from_configs(self._slot_configs)
        self._all_allowed: dict[tuple[int, ...], jax.Array] = {}

    @property
    def trash_page(self) -> int:
        """A page id that pads copy lists (the last data shard's trash page)."""
        return trash_page(self.kv.k_pages[0])

    def set_sampling(self, configs: Sequence[SamplingConfig | None]) -> None:
        """Per-slot sampling parameters (None: an idle slot); uploaded only when they change."""
        configs = list(configs)
        if configs != self._slot_configs:
            self._slot_configs = configs
            self.sampling = SamplingParams.from_configs(configs)

    def _masks(self, allowed: np.ndarray | None, *shape: int) -> jax.Array:
        """i32[*shape, W] token masks on device, placed the same way whether given or all ones
        (so they share one compiled step); the all-ones masks are uploaded once: a step without
        constrained rows uploads no mask."""
        if allowed is not None:
            return jax.device_put(allowed) if self.mesh is None else sharding.replicated(
                allowed, self.mesh)
        if shape not in self._all_allowed:
            ones = np.full(shape + (-(-self.config.vocab_size // 32),), -1, np.int32)
            self._all_allowed[shape] = self._masks(ones)
        return self._all_allowed[shape]

    def mixed(self, batch: steps.MixedBatch, pages: int, allowed: np.ndarray | None = None
              ) -> steps.SampleOutput:
        """One `mixed_step` (asynchronous: returns device arrays). allowed: i32[B, W] the
        slots' token masks (`jaxinfer.engine.constraints`); None = unconstrained."""
        allowed = self._masks(allowed, batch.decode.shape[0])
        with sharding.mesh_context(self.mesh):
            self.kv, self.state, out = steps.mixed_step(
                self.graph, self.params, self.kv, self.state, self.sampling, batch,
                num_pages_read=pages, num_top_logprobs=self.max_top_logprobs,
                attention_impl=self.attention_impl, allowed=allowed)
        return out

    def verify(self, batch: steps.VerifyBatch, draft_probs, pages: int, num_rows: int,
               allowed: np.ndarray | None = None) -> steps.VerifyOutput:
        """One `verify_step` over `num_rows` flat rows (`steps.verify_rows`); allowed:
        i32[B, R + 1, W] token masks per position, None = unconstrained."""
        allowed = self._masks(allowed, *batch.draft_ids.shape[:1], batch.draft_ids.shape[1] + 1)
        with sharding.mesh_context(self.mesh):
            self.kv, self.state, out = steps.verify_step(
                self.graph, self.params, self.kv, self.state, self.sampling, batch, draft_probs,
                num_rows=num_rows, num_pages_read=pages, num_top_logprobs=self.max_top_logprobs,
                attention_impl=self.attention_impl, allowed=allowed)
        return out

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies pages src -> dst (forks' copy-on-write), padded to a few static sizes."""
        if not pairs:
            return
        n = max(8, 1 << (len(pairs) - 1).bit_length())
        src = np.full((n,), self.trash_page, np.int32)
        dst = np.full((n,), self.trash_page, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        with sharding.mesh_context(self.mesh):
            self.kv = steps.copy_pages(self.kv, src, dst)

    def block_until_ready(self) -> None:
        jax.block_until_ready((self.kv, self.state))
