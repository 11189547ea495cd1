"""The layer stack's two layouts and the plan that runs the scanned one (docs/architecture.md,
decision 16).

Unrolled (`ModelConfig.scan_layers` False): one `Block` per layer (`Llama.layers`, a list) and
one KV pool per layer (`KVCache.k_pages[l]`: [K, pages, page_size, H]); the forward calls the
layers in turn, so XLA compiles L copies of the layer.

Scanned (True): the weights of each layer kind (`config.LayerKind`: one kind for Llama and
Qwen3, Gemma 3's local and global layers) are stacked on a leading `layers` axis
(`Llama.layers`: kind name -> a `Block` whose arrays are [L_kind, ...]), and the KV pool is one
stacked array per pool (`pool_keys`: the global pool, and a hybrid cache's local pool):
[L_pool, K, pages, page_size, H]. Layer l's weights are row `slots[l].weight` of its kind's
stack, its K/V row `slots[l].pool_index` of pool `slots[l].pool` (`layer_slots`).

The forward runs the layers as `segments`: a run of layers whose kinds repeat with period p
(Llama: p = 1 over all L layers; Gemma 3: 5 local + 1 global, p = 6) is one `jax.lax.scan`
over its repetitions, each step running the group's p layers unrolled, so XLA compiles each
layer of the group once whatever the depth; layers that fill no second repetition run
unrolled. Within a segment a layer's rows advance by a fixed step per repetition (the group
holds the same count of each kind and pool every time), so the scan carries only the
activations and the pools. Each layer reads its weights by indexing its kind's stack (a
dynamic slice that XLA:TPU fuses into the matmuls or stages into VMEM; XLA:CPU and XLA:GPU copy
the layer's weights out first, which is why "auto" unrolls there: `config.SCANNED_PLATFORMS`)
and reads and writes its K/V in the stacked pool at its row (a scatter, and a gather or a
kernel's DMA at that row: never a slice of the layer's pool), so the pool, threaded through the
scan's carry, is updated in place under donation.

Kinds and pools are found from the config alone, so a family whose layers differ (a dense MLP
on some, experts on others) only adds a `LayerKind` field: its layers then stack apart and the
segments follow the pattern.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxinfer.config import LayerKind, ModelConfig

GLOBAL, LOCAL = "global", "local"  # pool keys: full-length pages, a hybrid cache's window pool


def layer_kinds(config: ModelConfig) -> tuple[LayerKind, ...]:
    """The kind of every layer, in order."""
    kinds = tuple(config.layer_kind(i) for i in range(config.num_layers))
    names: dict[str, LayerKind] = {}
    for kind in kinds:
        if names.setdefault(kind.name, kind) != kind:
            raise ValueError(f"layer kinds {names[kind.name]} and {kind} share the name "
                             f"{kind.name!r}: LayerKind.name must tell distinct kinds apart")
    return kinds


def kind_layers(config: ModelConfig) -> dict[str, list[int]]:
    """Each layer kind's name -> its layers in order (their rows in the kind's stack when
    scanned), the kinds in order of their first layer."""
    out: dict[str, list[int]] = {}
    for i, kind in enumerate(layer_kinds(config)):
        out.setdefault(kind.name, []).append(i)
    return out


def kind_names(config: ModelConfig) -> tuple[str, ...]:
    """The names of the model's layer kinds, in order of their first layer."""
    return tuple(dict.fromkeys(kind.name for kind in layer_kinds(config)))


def local_layers(config: ModelConfig, hybrid: bool) -> tuple[int, ...]:
    """The layers whose K/V goes to the local (sliding-window) pool: with a hybrid cache, the
    model's local layers; else none (every layer reads full-length pages)."""
    return tuple(i for i in range(config.num_layers) if hybrid and config.is_local(i))


def pool_keys(num_layers: int, local: Sequence[int]) -> tuple[str, ...]:
    """The stacked pools of a scanned cache, in order of their first layer: GLOBAL and LOCAL,
    each where a layer uses it."""
    return tuple(dict.fromkeys(LOCAL if i in local else GLOBAL for i in range(num_layers)))


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where layer l's state lives. kind: its kind's name; weight: its row in the kind's stack
    (scanned) or l; pool: its K/V pool (index into `KVCache.k_pages`); pool_index: its row in
    that stacked pool, or None where the pool is the layer's own (unrolled)."""

    kind: str
    weight: int
    pool: int
    pool_index: int | None


def layer_slots(config: ModelConfig, local: Sequence[int], *, stacked: bool) -> tuple[Slot, ...]:
    """Every layer's `Slot`, for a cache whose local layers are `local` (`local_layers`)."""
    kinds = [kind.name for kind in layer_kinds(config)]
    keys = pool_keys(config.num_layers, local)
    out, seen_kind, seen_pool = [], {}, {}
    for i, name in enumerate(kinds):
        key = LOCAL if i in local else GLOBAL
        weight = seen_kind.setdefault(name, [0])
        row = seen_pool.setdefault(key, [0])
        if stacked:
            out.append(Slot(name, weight[0], keys.index(key), row[0]))
        else:
            out.append(Slot(name, i, i, None))
        weight[0] += 1
        row[0] += 1
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers start .. start + period * repeats - 1: `repeats` repetitions of a group of
    `period` layers (a scan when repeats > 1; else the layers run unrolled)."""

    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats


def segments(kinds: Sequence[object]) -> tuple[Segment, ...]:
    """The layers split into segments, greedily from the first: at each layer, the group of
    `period` layers that repeats over the most layers (the shortest group among equals; at least
    two repetitions), else the layer alone; consecutive lone layers are one unrolled segment.
    Llama: (0, 1, L). Gemma 3 at 26 layers: (0, 6, 4) then (24, 1, 2)."""
    out: list[Segment] = []
    start, n = 0, len(kinds)
    while start < n:
        period, repeats = 1, 1
        for p in range(1, (n - start) // 2 + 1):
            group = list(kinds[start:start + p])
            r = 1
            while start + (r + 1) * p <= n and list(kinds[start + r * p:start + (r + 1) * p]) \
                    == group:
                r += 1
            if r > 1 and p * r > period * repeats:
                period, repeats = p, r
        if repeats == 1 and out and out[-1].repeats == 1:
            last = out.pop()
            out.append(Segment(last.start, last.period + 1, 1))
        else:
            out.append(Segment(start, period, repeats))
        start += period * repeats
    return tuple(out)
