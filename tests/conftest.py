"""Test setup: 8 fake CPU devices (before jax initialises), f32 matmuls at full precision."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Kernel tests first: XLA's CPU compiler has segfaulted compiling Pallas interpret-mode programs
# late in this long-lived process (twice, in tests that pass alone and beside their neighbours;
# after the engine and real-model tests had compiled hundreds of programs). Run fresh, they pass.
_FIRST = ("test_pallas_tpu", "test_pallas_gpu", "test_pallas_page_sizes", "test_spec_verify",
          "test_tpu_compile")


def pytest_collection_modifyitems(config, items):
    def early(item):
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        return 0 if name in _FIRST else 1

    items.sort(key=early)  # stable: file order is kept within each group
