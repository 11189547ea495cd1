"""Where the suite's time goes: an opt-in pytest plugin that sums JAX's own compile events per
test module and per jitted function, and prints the totals.

    python -m pytest -q -n 2 -p tests.compile_profile            # or any subset of the suite

Each worker writes its sums to `$COMPILE_PROFILE.<worker>.json` (default
`.compile-profile.<worker>.json` in the working directory); the report merges every such file:

    python -m tests.compile_profile [prefix] [how many of the slowest tests to list]

The events are the ones JAX records (`jax.monitoring`): tracing to a jaxpr, lowering to MLIR,
XLA's backend compile (per function name), and persistent-cache reads; beside them, the time
Python's cyclic garbage collector runs (`gc.callbacks`), and the cache key of each compile that
missed the persistent cache (jax's compiler logs it), from which the report counts distinct
programs and those compiled more than once. Wall time is each test's setup to teardown.
"""

from __future__ import annotations

import collections
import gc
import glob
import json
import logging
import os
import sys
import time

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache read"}

_modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_functions: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_tests: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_current = {"module": "<collection>", "test": "<collection>", "start": 0.0, "gc": 0.0,
            "miss": None}
_misses: list[tuple[str, str, str, float]] = []  # (cache key, module, function, compile s)


class _MissLog(logging.Handler):
    """Keeps the key of each persistent-cache miss that jax logs (its compiler's debug record
    "PERSISTENT COMPILATION CACHE MISS for ... with key ..."), for the compile that follows."""

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("PERSISTENT COMPILATION CACHE MISS"):
            _current["miss"] = str(record.args[1])


def _prefix() -> str:
    return os.environ.get("COMPILE_PROFILE", ".compile-profile")


def _on_event(event: str, duration: float, **kwargs) -> None:
    name = EVENTS.get(event)
    if name is None:
        return
    _modules[_current["module"]][name] += duration
    _tests[_current["test"]][name] += duration
    if name == "compile":
        _modules[_current["module"]]["compiles"] += 1
        _tests[_current["test"]]["compiles"] += 1
        fn = _functions[str(kwargs.get("fun_name"))]
        fn["seconds"] += duration
        fn["compiles"] += 1
        if _current["miss"] is not None:
            fn["misses"] += 1
            _misses.append((_current["miss"], _current["module"], str(kwargs.get("fun_name")),
                            duration))
            _current["miss"] = None


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _current["gc"] = time.perf_counter()
        return
    duration = time.perf_counter() - _current["gc"]
    _modules[_current["module"]]["gc"] += duration
    _tests[_current["test"]]["gc"] += duration


def pytest_configure(config) -> None:
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_event)
    compiler_log = logging.getLogger("jax._src.compiler")
    compiler_log.addHandler(_MissLog(logging.DEBUG))
    compiler_log.setLevel(logging.DEBUG)
    gc.callbacks.append(_on_gc)


def pytest_runtest_setup(item) -> None:
    _current["module"] = item.nodeid.split("::")[0]
    _current["test"] = item.nodeid
    _current["start"] = time.perf_counter()


def pytest_runtest_teardown(item) -> None:
    wall = time.perf_counter() - _current["start"]
    _modules[_current["module"]]["wall"] += wall
    _tests[item.nodeid]["wall"] += wall


def pytest_sessionfinish(session) -> None:
    if not _modules:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{_prefix()}.{worker}.json", "w") as f:
        json.dump({"modules": _modules, "functions": _functions, "tests": _tests,
                   "misses": _misses}, f)


def report(prefix: str, top: int = 25) -> str:
    """The merged sums of every worker's file under `prefix`, largest first: per module, per
    jitted function, and the `top` slowest tests (a test's wall is its setup, call and
    teardown, so a fixture's cost falls to the first test that requests it)."""
    modules: dict = collections.defaultdict(collections.Counter)
    functions: dict = collections.defaultdict(collections.Counter)
    tests: dict = collections.defaultdict(collections.Counter)
    misses: dict = collections.defaultdict(list)  # cache key -> [(function, compile s)]
    for path in sorted(glob.glob(f"{prefix}.*.json")):
        with open(path) as f:
            data = json.load(f)
        for key, _, fn, seconds in data.get("misses", []):
            misses[key].append((fn, seconds))
        for into, key in ((modules, "modules"), (functions, "functions"), (tests, "tests")):
            for name, sums in data.get(key, {}).items():
                into[name].update(sums)
    cols = ("wall", "trace", "lower", "compile", "cache read", "gc")
    lines = [f"{'module':44s}" + "".join(f"{c:>11s}" for c in cols) + f"{'compiles':>10s}"]
    total = collections.Counter()
    for name, sums in sorted(modules.items(), key=lambda kv: -kv[1]["wall"]):
        total.update(sums)
        lines.append(f"{name[:44]:44s}" + "".join(f"{sums[c]:11.1f}" for c in cols)
                     + f"{sums['compiles']:10d}")
    lines.append(f"{'total':44s}" + "".join(f"{total[c]:11.1f}" for c in cols)
                 + f"{total['compiles']:10d}")
    lines += ["", f"{'function':44s}{'compile s':>11s}{'compiles':>10s}{'misses':>8s}"]
    for name, sums in sorted(functions.items(), key=lambda kv: -kv[1]["seconds"])[:top]:
        lines.append(f"{name[:44]:44s}{sums['seconds']:11.1f}{sums['compiles']:10d}"
                     f"{sums['misses']:8d}")
    if misses:
        lines += ["", _repeated_misses(misses, top)]
    lines += ["", f"{'test':90s}{'wall':>8s}{'compile':>9s}{'trace+lower':>12s}{'gc':>6s}"
              f"{'compiles':>9s}"]
    for name, sums in sorted(tests.items(), key=lambda kv: -kv[1]["wall"])[:top]:
        lines.append(f"{name[-90:]:90s}{sums['wall']:8.1f}{sums['compile']:9.1f}"
                     f"{sums['trace'] + sums['lower']:12.1f}{sums['gc']:6.1f}"
                     f"{sums['compiles']:9d}")
    return "\n".join(lines)


def _repeated_misses(misses: dict, top: int) -> str:
    """The programs XLA compiled more than once (the same persistent-cache key missed again:
    both workers compiling it at once, or a worker compiling it before the other's copy was
    written), and the seconds those repeats took, per function."""
    repeats: dict = collections.defaultdict(collections.Counter)
    programs = sum(len(v) for v in misses.values())
    for compiles in misses.values():
        for fn, seconds in sorted(compiles, key=lambda c: c[1])[:-1]:
            repeats[fn]["seconds"] += seconds
            repeats[fn]["repeats"] += 1
    total = sum(r["seconds"] for r in repeats.values())
    lines = [f"cache misses: {programs} compiles of {len(misses)} distinct programs; "
             f"repeats: {sum(r['repeats'] for r in repeats.values())}, {total:.1f} s",
             f"{'function (repeated)':44s}{'repeat s':>11s}{'repeats':>10s}"]
    for name, r in sorted(repeats.items(), key=lambda kv: -kv[1]["seconds"])[:top]:
        lines.append(f"{name[:44]:44s}{r['seconds']:11.1f}{r['repeats']:10d}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1] if len(sys.argv) > 1 else _prefix(),
                 int(sys.argv[2]) if len(sys.argv) > 2 else 25))
