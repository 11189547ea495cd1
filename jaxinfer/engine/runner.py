"""`ModelRunner`: one model's device state (weights, KV pool, slot state, sampling rows) and the
jitted steps run on it, on its mesh. The engine holds one for the target; a model drafter holds
one for its draft model, whose pool the target's page table also addresses."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer import sharding
from jaxinfer.config import CacheConfig, DraftTree, ModelConfig, SamplingConfig
from jaxinfer.engine import spec_tree, steps
from jaxinfer.engine.kv_cache import cache_specs, create_cache
from jaxinfer.engine.precompile import abstract
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.model import lora
from jaxinfer.model.attention import trash_page


class ModelRunner:
    """Owns (graph, params), the KV pool, the per-slot state and the per-slot sampling
    parameters of one model; every step runs under its mesh (`sharding.mesh_context`).

    jit compiles per argument sharding, so every argument of a step reaches it in one form,
    whoever made it (the host, a warm-up, the previous step, a drafter): the device-side arrays
    committed to their one sharding (`jaxinfer.sharding` module doc), the small host-built
    inputs as numpy arrays (`host`). The pool and the slot state are placed in their shardings
    once, here, and every step returns them there (`sharding.constrain`); the sampling rows and
    a drafter's proposals pass through `placed` each time. Warm-up and serving then run the
    same executables.

    An abstract runner (params from an abstract model, `Llama.abstract`) holds
    `jax.ShapeDtypeStruct`s in those same shardings instead of arrays, and its `call` compiles
    each step instead of running it: the ahead-of-time check (`jaxinfer.proof.aot`) runs the
    engine's own warm-up on it, so it compiles the engine's executables from the engine's own
    arguments.

    Args:
      graph, params: from `steps.split_model` (already placed on `mesh`).
      config: the model's config; cache: the resolved pool config (num_pages set).
      max_slots: rows of the device batch; mesh: None = one device.
      attention_impl: resolved, "xla" or "pallas"; max_top_logprobs: static top-n width.
      call: how each jitted step function is invoked (`steps.Call`; default: run it).
    """

    def __init__(self, graph: steps.ModelGraph, params: dict, *, config: ModelConfig,
                 cache: CacheConfig, max_slots: int, mesh: Mesh | None = None,
                 attention_impl: str = "xla", max_top_logprobs: int = 0,
                 call: steps.Call = steps.run):
        self.graph, self.params, self.config = graph, params, config
        self.mesh = mesh
        self.attention_impl = attention_impl
        self.max_top_logprobs = max_top_logprobs
        self.call = call
        self.abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        self.kv = self._new(lambda: create_cache(config, cache, max_slots, mesh=mesh),
                            cache_specs)
        self.state = self._new(lambda: steps.create_slot_state(max_slots, config.vocab_size),
                               steps.state_specs)
        # Each slot's sampling config as last uploaded (`set_sampling` uploads only a change).
        self.slot_configs: list[SamplingConfig | None] = [None] * max_slots
        self.sampling = self.placed(SamplingParams.from_configs(self.slot_configs))
        self._all_allowed: dict[tuple[int, ...], jax.Array] = {}
        self._write_lora = None  # the jitted LoRA slot write (`write_lora`)
        # The target layers a feature drafter reads (`jaxinfer.engine.eagle`): with any, each
        # step also leaves its rows' hidden states in `features` (device arrays), for the
        # drafter to take before the next step.
        self.feature_layers: tuple[int, ...] = ()
        self.features: jax.Array | None = None

    def compiling(self, call: steps.Call) -> ModelRunner:
        """A twin of this runner that compiles instead of running: its device state abstract
        (shapes, dtypes and shardings of this runner's arrays), its steps invoked through
        `call` (`jaxinfer.engine.precompile.Precompiler.compile`). Steps on the twin allocate
        nothing and leave this runner as it is; each thread of a warm-up uses its own."""
        twin = copy.copy(self)
        twin.params, twin.kv, twin.state, twin.sampling = abstract(
            (self.params, self.kv, self.state, self.sampling))
        twin._all_allowed = abstract(self._all_allowed)
        twin.slot_configs = list(self.slot_configs)
        twin.abstract, twin.call = True, call
        return twin

    def use_call(self, call: steps.Call) -> None:
        """Invokes the steps through `call` from now on (`steps.run`: run them)."""
        self.call = call

    def _new(self, make, specs: sharding.Specs):
        """The device state `make()` builds, placed by `specs`; an abstract runner takes only
        its shapes (`jax.eval_shape`: nothing is allocated)."""
        return self.placed(jax.eval_shape(make) if self.abstract else make(), specs)

    def resident(self) -> dict:
        """The device arrays the runner holds between steps: weights, KV pool, slot state,
        sampling rows and the all-ones token masks."""
        return {"params": self.params, "kv": self.kv, "state": self.state,
                "sampling": self.sampling, "masks": self._all_allowed}

    @property
    def trash_page(self) -> int:
        """A page id that pads copy lists (the last data shard's trash page) of the global
        pool: a padding pair must not land on a real page of the layers it is applied to."""
        pools = [i for i in range(len(self.kv.k_pages)) if not self.kv.is_local_pool(i)]
        return trash_page(self.kv.k_pages[pools[0] if pools else 0])

    @property
    def local_trash_page(self) -> int:
        """`trash_page` of a hybrid pool's local layers (of the global pool without them)."""
        pools = [i for i in range(len(self.kv.k_pages)) if self.kv.is_local_pool(i)]
        return trash_page(self.kv.k_pages[pools[0] if pools else 0])

    def placed(self, inputs, specs: sharding.Specs = sharding.whole):
        """Device-side `inputs` (host or device arrays) committed to their shardings on the
        runner's mesh: `specs(inputs, mesh)`, replicated by default (an abstract runner's:
        their shapes in those shardings)."""
        if self.abstract:
            inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), inputs)
        return sharding.place(inputs, sharding.placement(inputs, specs, self.mesh))

    @staticmethod
    def host(inputs):
        """A step's host-built `inputs` as numpy arrays: jit caches on their shapes alone and
        copies them to the devices itself, in native code (`placed` would cost a Python
        `device_put` per array: ~1 ms for a MixedBatch on this CPU, against ~0.2 ms)."""
        return jax.tree.map(np.asarray, inputs)

    def set_sampling(self, configs: Sequence[SamplingConfig | None]) -> None:
        """Per-slot sampling parameters (None: an idle slot); uploaded only when they change."""
        configs = list(configs)
        if configs != self.slot_configs:
            self.slot_configs = configs
            self.sampling = self.placed(SamplingParams.from_configs(configs))

    def _masks(self, allowed: np.ndarray | None, *shape: int) -> jax.Array:
        """i32[*shape, W] token masks on device, placed like the sampling rows whether given or
        all ones (so they share one compiled step); the all-ones masks are uploaded once: a
        step without constrained rows uploads no mask."""
        if allowed is not None:
            return self.placed(allowed)
        if shape not in self._all_allowed:
            ones = np.full(shape + (-(-self.config.vocab_size // 32),), -1, np.int32)
            self._all_allowed[shape] = self.placed(ones)
        return self._all_allowed[shape]

    def mixed(self, batch: steps.MixedBatch, pages: int, allowed: np.ndarray | None = None,
              prompt_logprobs: bool = False
              ) -> tuple[steps.SampleOutput, steps.SampleOutput | None]:
        """One `mixed_step` (asynchronous: returns device arrays): (the samples, the chunk
        rows' prompt logprobs or None). allowed: i32[B, W] the slots' token masks
        (`jaxinfer.engine.constraints`); None = unconstrained. prompt_logprobs: run the
        prompt-logprob variant (`steps.mixed_step`)."""
        allowed = self._masks(allowed, batch.decode.shape[0])
        batch = self.host(batch)
        with sharding.mesh_context(self.mesh):
            self.kv, self.state, out, prompt, *feats = steps.mixed_step(
                self.graph, self.params, self.kv, self.state, self.sampling, batch,
                num_pages_read=pages, num_top_logprobs=self.max_top_logprobs,
                attention_impl=self.attention_impl, allowed=allowed,
                prompt_logprobs=prompt_logprobs, feature_layers=self.feature_layers,
                call=self.call)
        self.features = feats[0] if feats else None
        return out, prompt

    def verify(self, batch: steps.VerifyBatch, draft_probs, pages: int, num_rows: int,
               allowed: np.ndarray | None = None, tree: DraftTree | None = None
               ) -> steps.VerifyOutput:
        """One `verify_step` over `num_rows` flat rows (`steps.verify_rows`). The proposals
        (`batch.draft_ids`, `draft_probs`) are device arrays: a model drafter's stay there.
        allowed: i32[B, R + 1, W] token masks per position, None = unconstrained. tree: a
        static draft tree (R = its T nodes); the accepted paths' K/V is moved into place
        (`spec_tree.commit_path`) before this returns its (asynchronous) output."""
        allowed = self._masks(allowed, *batch.draft_ids.shape[:1], batch.draft_ids.shape[1] + 1)
        ids = self.placed(batch.draft_ids)
        batch = dataclasses.replace(self.host(dataclasses.replace(batch, draft_ids=None)),
                                    draft_ids=ids)
        if draft_probs is not None:
            draft_probs = self.placed(draft_probs, sharding.vocab_last)
        with sharding.mesh_context(self.mesh):
            self.kv, self.state, out, *feats = steps.verify_step(
                self.graph, self.params, self.kv, self.state, self.sampling, batch, draft_probs,
                num_rows=num_rows, num_pages_read=pages, num_top_logprobs=self.max_top_logprobs,
                attention_impl=self.attention_impl, allowed=allowed, tree=tree,
                feature_layers=self.feature_layers, call=self.call)
            if tree is not None:
                self.kv = self.call(spec_tree.commit_path, self.kv, batch.page_table, batch.pos,
                                    out.path, out.num_emitted)
        self.features = feats[0] if feats else None
        return out

    def copy_pages(self, pairs: Sequence[tuple[int, int]],
                   local_pairs: Sequence[tuple[int, int]] = ()) -> None:
        """Copies pages src -> dst (forks' copy-on-write; `local_pairs`: a hybrid pool's local
        pages), padded to a few static sizes."""
        if not pairs and not local_pairs:
            return
        n = max(8, 1 << (max(len(pairs), len(local_pairs)) - 1).bit_length())

        def padded(pairs, trash):
            src, dst = np.full((n,), trash, np.int32), np.full((n,), trash, np.int32)
            if pairs:
                src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
            return src, dst

        arrays = self.host(padded(pairs, self.trash_page)
                           + padded(local_pairs, self.local_trash_page))
        with sharding.mesh_context(self.mesh):
            self.kv = self.call(steps.copy_pages, self.kv, *arrays)

    def write_lora(self, pool_slot: int, values: dict) -> None:
        """Writes one adapter's values (host arrays in the pool's structure, the slot axis left
        out: `jaxinfer.model.lora.slot_values`) into slot `pool_slot` of the weights' LoRA
        pool, every layer at once. The slot is a traced argument and the pool keeps its shapes
        and shardings, so one compiled write serves every load and no step recompiles."""
        if self.abstract:
            return
        pool = lora.pool_of(self.params)
        if self._write_lora is None:  # the pool's shardings never change
            self._write_lora = jax.jit(
                functools.partial(lora.write_slot, stacked=self.config.scan_layers),
                out_shardings=jax.tree.map(lambda a: a.sharding, pool))
        self.params = lora.with_pool(self.params,
                                     self._write_lora(pool, np.int32(pool_slot), values))

    def block_until_ready(self) -> None:
        jax.block_until_ready((self.kv, self.state))
