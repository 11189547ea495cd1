"""Multi-host serving: process 0 serves HTTP and schedules; every process runs the same steps.

On a slice of several hosts each jitted step is one SPMD program over all processes' devices,
so every process must call it, in the same order, with the same host inputs. The seam is the
`ModelRunner`: all device work of the engine (and of its warm-up) goes through its
`set_sampling`, `copy_pages`, `mixed` and `write_lora` calls, whose arguments are host values
(sampling configs, page pairs, the step's `MixedBatch` of numpy arrays and its token masks, a
LoRA adapter's pool values when one pages in). On process 0
a `Broadcaster` wraps the runner: each call is first broadcast to the other processes
(`broadcast_one_to_all`, pickled and padded to a power-of-two size so the broadcast compiles a
few shapes only), then run: a step with unchanged sampling rows and no page copies costs one
broadcast. The other processes run `follow`, which receives each call and makes it on their own
runner, until `Broadcaster.close` sends the end. Speculative decoding (whose drafter makes
device calls of its own) is not served multi-host.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

MIN_BYTES = 1024


def _broadcast(message: Any = None) -> Any:
    """Process 0's `message` on every process (others pass None)."""
    lead = jax.process_index() == 0
    data = np.frombuffer(pickle.dumps(message), np.uint8) if lead else None
    size = int(multihost_utils.broadcast_one_to_all(
        np.int32(data.size if lead else 0)))
    padded = max(MIN_BYTES, 1 << (size - 1).bit_length())
    buffer = np.zeros(padded, np.uint8)
    if lead:
        buffer[:size] = data
    buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return pickle.loads(buffer[:size].tobytes())


def _host(value: Any) -> Any:
    return jax.tree.map(np.asarray, value)


class Broadcaster:
    """Process 0's runner: each device call is sent to every process, then run here. A call is
    sent before it runs because placing arrays on the slice's mesh (new sampling rows) is
    itself a collective the other processes must join. Other attributes are the wrapped
    runner's."""

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def set_sampling(self, configs) -> None:
        configs = list(configs)
        if configs != self.runner.slot_configs:  # the runner uploads only a change
            _broadcast([("set_sampling", (configs,))])
            self.runner.set_sampling(configs)

    def copy_pages(self, pairs, local_pairs=()) -> None:
        if pairs or local_pairs:
            _broadcast([("copy_pages", (list(pairs), list(local_pairs)))])
            self.runner.copy_pages(pairs, local_pairs)

    def write_lora(self, pool_slot: int, values) -> None:
        """A LoRA adapter paged into the pool: its values go to every process."""
        _broadcast([("write_lora", (pool_slot, _host(values)))])
        self.runner.write_lora(pool_slot, values)

    def mixed(self, batch, pages: int, allowed=None, prompt_logprobs: bool = False):
        _broadcast([("mixed", (_host(batch), pages, allowed, prompt_logprobs))])
        return self.runner.mixed(batch, pages, allowed, prompt_logprobs)

    def verify(self, *args, **kwargs):
        raise RuntimeError("speculative decoding is not served multi-host")

    def close(self) -> None:
        """Ends every `follow`."""
        _broadcast([("stop", ())])


def follow(runner) -> int:
    """Makes process 0's device calls on this process's runner until it closes; returns how
    many calls were made."""
    calls = 0
    while True:
        for name, args in _broadcast():
            if name == "stop":
                return calls
            getattr(runner, name)(*args)
            calls += 1
