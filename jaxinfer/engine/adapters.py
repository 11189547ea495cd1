"""LoRA adapters in the serving engine (docs/architecture.md, decision 18): which adapters are
registered (`AdapterRegistry`), which of them sit in the device pool's slots (`AdapterSlots`), and
the engine's view of both (`Adapters`). The device writes are the runner's
(`ModelRunner.write_lora`).

A registered adapter is read and checked once (`jaxinfer.checkpoint.lora.read_peft`) and kept in
host memory, laid out for the pool. Its key, "<name>#<n>", is unique per registration: requests,
pool slots and the prefix cache's namespaces (`jaxinfer.engine.pages.PrefixCache`) name adapters
by key, so an adapter unloaded and registered again under the same name never meets K/V or a
pool slot of the old one.

The device pool has `EngineConfig.max_loras` slots. A request pins its adapter's slot while it
holds an engine slot (`sched_state.FreeSlots`); admitting a request whose adapter is not resident
pages it in: into a free slot, else into the least recently used slot no running request pins.
When every slot is pinned by running requests, the request waits (first in line: the queue
waits behind it, FCFS) until one of them ends. Loading a slot writes its values into the pool
arrays in place of the old ones: the same shapes, so no step recompiles.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable

from jaxinfer.checkpoint.lora import read_peft
from jaxinfer.config import ModelConfig
from jaxinfer.model import kv_heads, lora


class UnknownAdapter(ValueError):
    """A request or an unload names an adapter that is not registered (the server: 404)."""


@dataclasses.dataclass(frozen=True)
class Registered:
    """One registered adapter: its name, key (module doc), directory, rank, targets and its
    pool values (opaque here: `jaxinfer.model.lora.slot_values`, laid out for the model's
    pool)."""

    name: str
    key: str
    path: str
    rank: int
    targets: tuple[str, ...]
    values: dict


class AdapterRegistry:
    """name -> `Registered`, with the counters the engine reports."""

    def __init__(self):
        self.by_name: dict[str, Registered] = {}
        self.by_key: dict[str, Registered] = {}
        self._serial = itertools.count()
        self.requests = collections.Counter()  # adapter name -> requests added with it

    def check_free(self, name: str) -> None:
        """ValueError if an adapter is registered as `name`."""
        if name in self.by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (from "
                             f"{self.by_name[name].path}); unload it first")

    def add(self, name: str, path: str, rank: int, targets: tuple[str, ...],
            values: dict) -> Registered:
        self.check_free(name)
        entry = Registered(name=name, key=f"{name}#{next(self._serial)}", path=path, rank=rank,
                           targets=targets, values=values)
        self.by_name[name] = self.by_key[entry.key] = entry
        return entry

    def get(self, name: str) -> Registered:
        entry = self.by_name.get(name)
        if entry is None:
            raise UnknownAdapter(f"unknown LoRA adapter {name!r}; loaded: "
                                 f"{sorted(self.by_name) or 'none'}")
        return entry

    def remove(self, name: str) -> Registered:
        entry = self.get(name)
        del self.by_name[name], self.by_key[entry.key]
        return entry


class AdapterSlots:
    """Residency of adapters (by key) in the device pool's `num_slots` slots, least recently
    used first out (module doc). `load(pool_slot, key)` writes an adapter into a slot."""

    def __init__(self, num_slots: int, load: Callable[[int, str], None]):
        self.keys: list[str | None] = [None] * num_slots
        self.pins = [0] * num_slots
        self.last_used = [0] * num_slots
        self.load = load
        self._clock = itertools.count(1)
        self.num_loads = 0  # adapters paged into the pool
        self.num_evictions = 0  # ... that replaced another resident adapter

    def resident(self) -> list[str]:
        return [k for k in self.keys if k is not None]

    def _victim(self) -> int | None:
        """A free slot, else the least recently used unpinned one; None if all are pinned."""
        free = [s for s, k in enumerate(self.keys) if k is None]
        if free:
            return free[0]
        unpinned = [s for s, p in enumerate(self.pins) if p == 0]
        return min(unpinned, key=self.last_used.__getitem__, default=None)

    def available(self, key: str | None) -> bool:
        return key is None or key in self.keys or self._victim() is not None

    def acquire(self, key: str | None) -> int:
        """The pool slot holding `key`, paged in if needed, pinned once more (-1 for None)."""
        if key is None:
            return -1
        if key in self.keys:
            slot = self.keys.index(key)
        else:
            slot = self._victim()
            if slot is None:
                raise RuntimeError(f"no adapter pool slot is free for {key!r} (check "
                                   "`available` first)")
            self.num_evictions += self.keys[slot] is not None
            self.load(slot, key)
            self.keys[slot] = key
            self.num_loads += 1
        self.pins[slot] += 1
        self.last_used[slot] = next(self._clock)
        return slot

    def release(self, pool_slot: int) -> None:
        if pool_slot >= 0:
            self.pins[pool_slot] -= 1

    def forget(self, key: str) -> None:
        """Frees `key`'s slot (it must not be pinned): the adapter was unloaded."""
        if key in self.keys:
            slot = self.keys.index(key)
            assert self.pins[slot] == 0, f"{key} is pinned"
            self.keys[slot] = None


class Adapters:
    """The engine's adapters: registration (`add`, `remove`), the key a request runs with
    (`key_of`), paging into the pool (`slots`, handed to the scheduler) and counters.

    config: the served model's config (with its pool: `lora_slots`, `lora_rank`; kv heads
    possibly duplicated for the mesh, `jaxinfer.model.kv_heads`); base: the checkpoint's config,
    which adapters are checked against.  write(pool slot, values): the device write."""

    def __init__(self, *, config: ModelConfig, base: ModelConfig,
                 write: Callable[[int, dict], None]):
        self.config, self.base, self.write = config, base, write
        self.registry = AdapterRegistry()
        self.slots = AdapterSlots(config.lora_slots, self._load)

    def add(self, name: str, path: str) -> Registered:
        """Reads, checks and registers the PEFT adapter in directory `path` as `name`
        (ValueError naming the adapter and what is wrong; nothing changes then)."""
        if not isinstance(name, str) or not name or any(c in name for c in ",=#"):
            raise ValueError(f"LoRA adapter name {name!r} must be a non-empty string without "
                             "',', '=' or '#'")
        self.registry.check_free(name)
        adapter = read_peft(path, self.base, name=name, max_rank=self.config.lora_rank)
        dtype = lora.pool_dtype(self.config)
        copies = self.config.num_kv_heads // self.base.num_kv_heads
        values = {}
        for i in range(self.base.num_layers):
            layer = lora.pack_layer(self.base, adapter.layers.get(i, {}), dtype,
                                    rank=self.config.lora_rank)
            if copies > 1:
                layer["lora_qkv_b"] = kv_heads.duplicate_arrays(layer["lora_qkv_b"], copies,
                                                                self.base.q_per_kv)
            values[i] = layer
        return self.registry.add(name, path, adapter.rank, tuple(adapter.targets),
                                 lora.slot_values(self.config, values))

    def key_of(self, name: str | None) -> str | None:
        """The key requests naming adapter `name` run with (None: the base model); ValueError
        for a name that is not registered."""
        return None if name is None else self.registry.get(name).key

    def remove(self, name: str, in_use: bool) -> None:
        """Unregisters `name` and frees its pool slot; refused (ValueError) while `in_use`
        (a request that has not finished runs with it)."""
        entry = self.registry.get(name)
        if in_use:
            raise ValueError(f"LoRA adapter {name!r} has unfinished requests; unload it when "
                             "they are done (or abort them)")
        self.registry.remove(name)
        self.slots.forget(entry.key)

    def warm(self) -> None:
        """Compiles the pool write, writing zeros (no adapter) into a free slot, so that the
        first adapter a request pages in compiles nothing."""
        free = [s for s, k in enumerate(self.slots.keys) if k is None]
        if free:
            empty = lora.pack_layer(self.config, {}, lora.pool_dtype(self.config),
                                    rank=self.config.lora_rank)
            self.write(free[0], lora.slot_values(
                self.config, {i: empty for i in range(self.base.num_layers)}))

    def _load(self, slot: int, key: str) -> None:
        self.write(slot, self.registry.by_key[key].values)

    def listing(self) -> list[Registered]:
        return list(self.registry.by_name.values())

    def stats(self) -> dict:
        resident = {self.registry.by_key[k].name for k in self.slots.resident()
                    if k in self.registry.by_key}
        return {"lora_adapters": len(self.registry.by_name), "lora_resident": len(resident),
                "lora_loads": self.slots.num_loads, "lora_evictions": self.slots.num_evictions,
                "lora_requests": dict(self.registry.requests)}
