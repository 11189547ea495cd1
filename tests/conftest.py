"""Test setup: 8 fake CPU devices (before jax initialises), f32 matmuls at full precision."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module. The suite compiles thousands of
    XLA CPU executables in one process; each keeps its JIT code mapped, and late in the run
    XLA's CPU compiler segfaulted (three runs, three different tests, each passing alone) —
    consistent with the process running out of memory mappings (vm.max_map_count)."""
    yield
    jax.clear_caches()
    gc.collect()


# Kernel tests first, in the freshest process: XLA's CPU compiler segfaulted compiling Pallas
# interpret-mode programs late in this long-lived process (see `_release_compiled_programs`).
_FIRST = ("test_pallas_tpu", "test_pallas_gpu", "test_pallas_page_sizes", "test_spec_verify",
          "test_tpu_compile")


def pytest_collection_modifyitems(config, items):
    def early(item):
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        return 0 if name in _FIRST else 1

    items.sort(key=early)  # stable: file order is kept within each group
