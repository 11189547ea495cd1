"""Step executables compiled ahead of time on a pool of threads, each exactly once.

A warm-up that runs each step variant on dummy inputs compiles them one after another, and
running them from several threads would need a KV pool per thread (each step donates its
pool). Instead, warm-up work runs on twins of the engine's runners (`ModelRunner.compiling`)
whose device state is abstract (`jax.ShapeDtypeStruct`s in the real arrays' shardings) and
whose step calls go to `Precompiler.compile`: `fn.trace(...).lower().compile()`, which runs
nothing and allocates nothing. The executable lands in jit's own caches (the lowering cache
and its compiled executable), which every thread shares, so the engine's ordinary call
`fn(*args)` with arrays of those shapes and shardings, under the same mesh context, finds it
and compiles nothing (`tests/test_warmup.py` counts the compiles). XLA releases the GIL while
it compiles, so several compile at once; tracing and lowering (Python) take their turns.

Each executable is compiled once: `Precompiler` keys every call by its function, static
arguments and the shapes, dtypes and shardings of its array arguments, and the first thread
to ask compiles it while any other that asks waits for that result. While some executables
are still compiling (a server that is ready before all its variants are: `Warmup`), the
runners call their steps through `Precompiler.guarded`: a step whose executable is still
compiling waits for it, one not started yet is compiled by the caller, then it runs; when
all are done the runners call their steps directly again (`steps.run`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from jaxinfer.engine import steps

log = logging.getLogger("jaxinfer.warmup")


def abstract(tree):
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s of the same shape, dtype, weak type and
    sharding (numpy arrays and other leaves as they are): what a compile-only twin holds."""
    def leaf(x):
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                        weak_type=getattr(x, "weak_type", False))
        return x

    return jax.tree.map(leaf, tree)


def _key(fn, args, kwargs) -> tuple:
    """What one executable is compiled for: the function, the pytree structure, every static
    argument's value and every array's shape, dtype and sharding (a numpy array: no sharding,
    as jit sees it)."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    parts = []
    for x in leaves:
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            parts.append((x.shape, x.dtype, x.sharding, getattr(x, "weak_type", False)))
        elif isinstance(x, np.ndarray | np.generic):
            parts.append((x.shape, x.dtype))
        else:
            parts.append(x)
    return (fn, treedef, tuple(parts))


class Precompiler:
    """A table of compiled step executables, each compiled once, by whichever thread asks
    first (see the module doc). `compile` and `guarded` are `steps.Call`s."""

    def __init__(self):
        self._lock = threading.Lock()
        self._done: dict[tuple, Future] = {}
        self.compiled: list[str] = []  # function name of each executable compiled, in order

    def compile(self, fn, *args, **kwargs):
        """Compiles jitted `fn` for these (abstract or real) arguments, once; returns its
        outputs as abstract arrays in the executable's output shardings (what the next step
        of a compile-only twin takes)."""
        key = _key(fn, args, kwargs)
        with self._lock:
            future = self._done.get(key)
            mine = future is None
            if mine:
                future = self._done[key] = Future()
        if not mine:
            return future.result()
        try:
            exe = fn.trace(*args, **kwargs).lower().compile()
            out = jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s),
                               exe.out_info, exe.output_shardings)
        except BaseException as e:
            future.set_exception(e)
            raise
        with self._lock:
            self.compiled.append(fn.__name__)
        future.set_result(out)
        return out

    def guarded(self, fn, *args, **kwargs):
        """Runs `fn(*args, **kwargs)` once its executable is compiled (waiting for it, or
        compiling it here if no thread has started it)."""
        self.compile(fn, *args, **kwargs)
        return fn(*args, **kwargs)


class Warmup:
    """Warm-up tasks (each a function of no arguments making compile-only calls) run on
    `workers` threads in the order given; `wait(n)` returns once the first `n` have finished,
    `wait(ready)` once the first `ready` (what a server needs before it reports ready).

    While tasks remain, `runners` call their steps through `precompiler.guarded`; once all
    have finished (or been skipped), directly again. A task that fails is logged and fails
    `wait`, and the executable it was compiling fails every call that needs it. The threads
    stop taking tasks when `cancelled()` is true (a server told to shut down) or the main
    thread ends (interpreter exit): the tasks not started are skipped (what they would have
    compiled compiles when first used), and a cancel or an exit waits at most for the tasks
    under way.

    Args:
      tasks: the work, most needed first.
      precompiler: the table every task's calls compile into.
      runners: the runners whose steps need the compiled executables (`ModelRunner`).
      workers: threads (at least 1).
      ready: how many of the first tasks make the engine ready (default: all).
      on_done: called (on a warm-up thread) when the last task has finished, unless some
        were skipped.
      cancelled: asked before each task.
      counts: how many step variants each task compiles (`num_variants`,
        `num_ready_variants`: their sums over all tasks and over the first `ready`;
        `num_compiled_variants`: over the tasks that ran).
    """

    def __init__(self, tasks: Sequence[Callable[[], Any]], *, precompiler: Precompiler,
                 runners: Sequence[Any], workers: int, ready: int | None = None,
                 on_done: Callable[[], Any] | None = None,
                 cancelled: Callable[[], bool] | None = None, counts: Sequence[int] = ()):
        self.precompiler = precompiler
        self._on_done = on_done
        self._cancelled = cancelled or (lambda: False)
        self.ready = len(tasks) if ready is None else ready
        self._counts = list(counts) or [0] * len(tasks)
        self.num_variants = sum(self._counts)
        self.num_ready_variants = sum(self._counts[:self.ready])
        self.num_compiled_variants = 0
        self._tasks = list(tasks)
        self._runners = list(runners)
        self._lock = threading.Lock()
        self._next = 0
        self._finished = [threading.Event() for _ in self._tasks]
        self._errors: list[BaseException] = []
        self.skipped = 0  # tasks never started (cancelled)
        self._left = len(self._tasks)
        for runner in self._runners:
            runner.use_call(precompiler.guarded if self._left else steps.run)
        # Not daemons (a thread inherits the flag from the one that starts it, e.g. a
        # server's engine thread): the interpreter must not tear jax down under a compile.
        self._threads = [threading.Thread(target=self._work, name=f"jaxinfer-warmup-{i}",
                                          daemon=False)
                         for i in range(min(max(1, workers), len(self._tasks)))]
        for t in self._threads:
            t.start()
        if not self._tasks and on_done is not None:
            on_done()

    def _work(self) -> None:
        main = threading.main_thread()
        while True:
            stop = self._cancelled() or not main.is_alive()
            with self._lock:
                i = self._next
                if i == len(self._tasks):
                    return
                self._next = len(self._tasks) if stop else i + 1
            if stop:
                self._skip(range(i, len(self._tasks)))
                return
            try:
                self._tasks[i]()
                with self._lock:
                    self.num_compiled_variants += self._counts[i]
            except BaseException as e:  # noqa: BLE001 - reported by `wait`
                log.exception("warm-up task %d failed", i)
                with self._lock:
                    self._errors.append(e)
            self._finish([i])

    def _skip(self, tasks: range) -> None:
        with self._lock:
            self.skipped += len(tasks)
        self._finish(list(tasks))

    def _finish(self, tasks: list[int]) -> None:
        with self._lock:
            self._left -= len(tasks)
            last = self._left == 0
        if last:
            for runner in self._runners:
                runner.use_call(steps.run)
        for i in tasks:
            self._finished[i].set()
        if last and not self.skipped and self._on_done is not None:
            self._on_done()

    @property
    def done(self) -> bool:
        return self._left == 0

    def wait(self, n: int | None = None, timeout: float | None = None) -> bool:
        """Waits until the first `n` tasks (None: all) have finished or been skipped; False
        if `timeout` seconds passed first or any of them was skipped. Raises the first
        task's error, if any failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in self._finished[:n]:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not event.wait(left):
                return False
        if self._errors:
            raise self._errors[0]
        return self.skipped == 0 or self._next_skipped() >= len(self._finished[:n])

    def _next_skipped(self) -> int:
        """The index of the first skipped task (the tasks from there on were skipped)."""
        return len(self._tasks) - self.skipped
