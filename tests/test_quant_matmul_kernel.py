"""The quantized matmul kernel (`pallas_kernels.quant_matmul`): interpret mode against the
reference (int8 per channel, native int4 and u8 in groups; several k and n tiles, x whole and
tiled), and compiled for TPU v5e / v6e without one, where XLA's bytes accessed must equal the
DMA traffic of the grid, counted here from the shapes."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from pallas_kernels.quant_matmul import quantized_matmul, quantized_matmul_reference
from pallas_kernels.quant_matmul import tpu as qmm_tpu

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
K, N = 512, 256
# ||out - ref|| / ||ref|| of f32 outputs: the kernel's products of x (f32 or bf16) and integer
# values are exact in f32, so only the summation order differs from the reference.
TOLERANCE = {jnp.float32: 1e-5}
LAYOUTS = {"int8": (0, jnp.int8, 0), "int4 g128": (128, jnp.int4, 8), "u8 g32": (32, jnp.uint8, 0)}


def _fields(k: int, n: int, group: int, q_dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    lo, hi = {jnp.int8: (-127, 128), jnp.int4: (-8, 8), jnp.uint8: (0, 256)}[q_dtype]
    q = jnp.asarray(rng.integers(lo, hi, (k, n)), jnp.int32).astype(q_dtype)
    rows = 1 if not group else k // group
    scale = jnp.asarray(rng.uniform(0.001, 0.02, (rows, n)), jnp.float32)
    zero = jnp.asarray(rng.normal(0, 0.02, (rows, n)), jnp.float32) if group else None
    return q, scale, zero


@pytest.mark.parametrize("layout, m", [(layout, m) for layout in ("int8", "int4 g128")
                                       for m in (1, 8, 13)] + [("u8 g32", 13)])
def test_interpret_matches_reference(layout, m):
    """Tiles (128, 128): 4 k steps x 2 column tiles, so the accumulator carries over k."""
    group, q_dtype, offset = LAYOUTS[layout]
    q, scale, zero = _fields(K, N, group, q_dtype, seed=m)
    x = jnp.asarray(np.random.default_rng(m).normal(size=(m, K)), jnp.float32)
    out = quantized_matmul(x, q, scale, zero, group=group, offset=offset, tiles=(128, 128),
                           interpret=True)
    ref = quantized_matmul_reference(x, q, scale, zero, group=group, offset=offset)
    assert out.shape == (m, N) and out.dtype == jnp.float32
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert err < TOLERANCE[jnp.float32], err


@pytest.mark.parametrize("layout", ["int8", "int4 g128"])
def test_bf16_and_tiled_x(layout, monkeypatch):
    """bf16 activations with x in [M, tk] tiles (re-fetched per column tile), f32 output."""
    monkeypatch.setattr(qmm_tpu, "X_WHOLE_BYTES", 0)
    group, q_dtype, offset = LAYOUTS[layout]
    q, scale, zero = _fields(K, N, group, q_dtype)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, K)), jnp.bfloat16)
    out = quantized_matmul(x, q, scale, zero, group=group, offset=offset, out_dtype=jnp.float32,
                           tiles=(256, 128), interpret=True)
    ref = quantized_matmul_reference(x, q, scale, zero, group=group, offset=offset,
                                     out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert err < TOLERANCE[jnp.float32], err


def test_tpu_interpret_mode_batched_weights_without_races():
    """TPU interpret mode (simulated DMAs run at their waits, uninitialised VMEM as NaN, race
    detection) on B = 2 int4 weights [2, K, N] with their scales [rows, 2, N]: 2 column tiles x
    2 weights x 2 k steps."""
    from jax._src.pallas.mosaic import interpret as tpu_interpret
    from jax.experimental.pallas import tpu as pltpu

    q, scale, zero = _fields(K // 2, N, 128, jnp.int4)
    q2, scale2, zero2 = _fields(K // 2, N, 128, jnp.int4, seed=1)
    q, scale, zero = jnp.stack([q, q2]), jnp.stack([scale, scale2], 1), jnp.stack([zero, zero2], 1)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(8, K // 2)), jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait",
                                   uninitialized_memory="nan")
    try:
        out = quantized_matmul(x, q, scale, zero, group=128, offset=8, tiles=(128, 128),
                               interpret=params)
        races = tpu_interpret.interpret_pallas_call.races.races_found
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    ref = quantized_matmul_reference(x, q, scale, zero, group=128, offset=8)
    assert out.shape == (8, 2, N) and not races
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert err < TOLERANCE[jnp.float32], err


def test_bad_inputs_name_the_value():
    q, scale, zero = _fields(K, N, 128, jnp.int4)
    x = jnp.zeros((2, K), jnp.float32)
    with pytest.raises(ValueError, match="group 96 must be > 0 and divide K"):
        quantized_matmul(x, q, scale, zero, group=96, interpret=True)
    with pytest.raises(ValueError, match=r"scale and zero must both be \(4, 256\)"):
        quantized_matmul(x, q, scale[:2], zero, group=128, interpret=True)
    with pytest.raises(ValueError, match="x dtype int32"):
        quantized_matmul(x.astype(jnp.int32), q, scale, zero, group=128, interpret=True)
    with pytest.raises(ValueError, match="does not tile"):
        q8, s8, _ = _fields(K, 576, 0, jnp.int8)
        quantized_matmul(x, q8, s8, None, group=0, interpret=True)


@pytest.fixture(scope="module")
def tpu_devices():
    return {name: topologies.get_topology_desc(name, platform="tpu").devices[0]
            for name in ("v5e:2x2", "v6e:2x2")}


def _compiled_bytes(device, m, k, n, group, q_dtype) -> float:
    sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(device))  # noqa: E731
    rows = 1 if not group else k // group
    args = (sds((m, k), jnp.bfloat16), sds((k, n), q_dtype), sds((rows, n), jnp.float32),
            sds((rows, n), jnp.float32) if group else None)
    offset = 8 if q_dtype == jnp.int4 else 0
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))  # the device kind Pallas lowers for
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda *a: quantized_matmul(*a, group=group, offset=offset)).trace(
            *args).lower().compile()
    cost = compiled.cost_analysis()
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


@pytest.mark.parametrize("topology, m, k, n, layout, x_fetches", [
    (t, 8, 4096, 3584, layout, 1)  # an 8B projection's shard at decode: x one block
    for t in ("v5e:2x2", "v6e:2x2") for layout in ("int8", "int4 g128")
] + [("v5e:2x2", 256, 14336, 1024, "int4 g128", 1024 // 512)])  # x 7.3 MB: [M, tk] tiles
def test_tpu_compile_bytes_are_the_grid_traffic(tpu_devices, topology, m, k, n, layout,
                                                x_fetches):
    group, q_dtype, _ = LAYOUTS[layout]
    weight = k * n // (2 if q_dtype == jnp.int4 else 1)
    scales = 4 * n * (k // group * 2 if group else 1)
    traffic = weight + scales + x_fetches * m * k * 2 + m * n * 2  # bf16 x and out
    assert _compiled_bytes(tpu_devices[topology], m, k, n, group, q_dtype) == traffic


# ----- through the model's `quant.einsum` wiring, sharded over 8 CPU devices -------------------
WEIGHTS = {  # name: (spec, float weight shape, logical axes, contraction axes, reshaped shape)
    "gate_up": ("ND,CDF->NCF", (2, 256, 512), ("gate_up", "embed", "ffn"), (1,), None),
    "down": ("NF,FD->ND", (512, 256), ("ffn", "embed"), (0,), None),
    "o": ("NX,XD->ND", (8, 64, 256), ("q_heads", "head_dim", "embed"), (0, 1), (512, 256)),
}


def _quant_weight(name: str, kind: str):
    """kind: "int8" (per channel), "int8 g32" (u8 groups: a GGUF load's layout) or "int4"."""
    from flax import nnx

    from jaxinfer.model import quant

    _, shape, axes, contract, _ = WEIGHTS[name]
    w = np.random.default_rng(2).normal(0, 0.05, shape).astype(np.float32)
    kind, group = {"int8": ("int8", 0), "int8 g32": ("int8", 32), "int4": ("int4", 128)}[kind]
    t = quant.quantize(w, contract, kind, group)
    if kind == "int4":  # native 4-bit, as placed on a TPU
        import dataclasses

        t = dataclasses.replace(t, q=quant._to_native(jnp.asarray(t.q), contract[-1], t.group))
    return quant.QuantWeight(t, axes, lambda v, _: nnx.Param(jnp.asarray(v))), w


@pytest.mark.parametrize("kind, name", [("int8", "gate_up"), ("int8", "down"),
                                        ("int8 g32", "down"), ("int8 g32", "gate_up")]
                         + [("int4", name) for name in WEIGHTS])
def test_einsum_kernel_sharded_equals_xla(kind, name):
    """data:2 x model:4: gate_up's ffn outputs split (own columns), down's and o's contraction
    split (partial products added over "model"), rows split over "data"; against the same
    einsum through XLA's dot on one device."""
    from jaxinfer.model import quant
    from jaxinfer.sharding import make_mesh

    spec, _, _, _, shape = WEIGHTS[name]
    w, _ = _quant_weight(name, kind)
    k = shape[0] if shape else math.prod(w.shape[a] for a in w.contract)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(16, k)), jnp.float32)
    want = quant.einsum(spec, x, w, shape=shape)
    with jax.set_mesh(make_mesh("data:2,model:4")):
        got = jax.jit(lambda x: quant._einsum_kernel(spec, x, w, shape, interpret=True))(x)
    assert got is not None and got.shape == want.shape
    err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert err < TOLERANCE[jnp.float32], err
