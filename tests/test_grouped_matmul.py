"""The grouped matmul (`pallas_kernels.grouped_matmul`): the TPU kernel in interpret mode and
XLA's loop on CPU against the dense reference on ragged group sizes (empty experts, one expert
taking every row, groups that are not multiples of the row tile, padding rows poisoned with
NaN), float and int8 / int4 weights as jaxinfer stores them; the kernel compiled for TPU v5e /
v6e without one, where XLA's bytes accessed must equal the grid's DMA traffic counted here from
the shapes; XLA's loop compiled for CPU and sm_90a reading one expert per step, never all."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.grouped_matmul.tpu import grouped_matmul_tpu, tile_sizes
from pallas_kernels.grouped_matmul.xla import grouped_matmul_xla
from tests.helpers import require_cuda_compiler

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
E, K, N = 8, 256, 256
# ||out - ref|| / ||ref|| over the valid rows: f32 differs from the reference only in the
# summation order; bf16 x (and bf16 or bf16-rounded dequantized weights) in its rounding.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}
# name: (weight dtype, group, offset); "packed int4" is the u8 layout of a CPU load
LAYOUTS = {"f32": (jnp.float32, 0, 0), "bf16": (jnp.bfloat16, 0, 0), "int8": (jnp.int8, 0, 0),
           "int4 g128": (jnp.int4, 128, 8), "u8 g32": (jnp.uint8, 32, 0),
           "int4 g8": (jnp.int4, 8, 8), "packed int4 g32": ("packed", 32, 0)}
# name: (group sizes over E experts, M): the sum < M leaves poisoned padding rows
SIZES = {"ragged": ([3, 0, 9, 1, 0, 0, 5, 2], 24),  # empty experts, groups across tiles
         "one expert": ([0, 0, 0, 21, 0, 0, 0, 0], 24),  # every valid row
         "decode": ([1, 1, 0, 1, 0, 1, 0, 1], 6),  # one row each, M under a tile
         "none": ([0] * 8, 8)}  # no valid rows: nothing read, nothing to compare


def _weights(layout: str, seed: int = 0, k: int = K, blocks: int = 0):
    """(w, scale, zero, group, offset) of E experts [k, N] in `layout` (reference.py); with
    `blocks` C, the same columns as C blocks [E, C, k, N / C] (gate and up), fields too."""
    w, scale, zero, group, offset = _weights_3d(layout, seed, k)
    if not blocks:
        return w, scale, zero, group, offset

    def split(a):  # [E, rows, N] -> [E, C, rows, N / C]
        e, rows, n = a.shape
        return jnp.transpose(a.reshape(e, rows, blocks, n // blocks), (0, 2, 1, 3))

    return (split(w), *(None if a is None else split(a) for a in (scale, zero)), group,
            offset)


def _weights_3d(layout: str, seed: int, k: int):
    rng = np.random.default_rng(seed)
    dtype, group, offset = LAYOUTS[layout]
    if dtype in (jnp.float32, jnp.bfloat16):
        return jnp.asarray(rng.normal(0, 0.05, (E, k, N)), dtype), None, None, 0, 0
    rows = k // group if group else 1
    scale = jnp.asarray(rng.uniform(0.001, 0.02, (E, rows, N)), jnp.float32)
    zero = jnp.asarray(rng.normal(0, 0.02, (E, rows, N)), jnp.float32) if group else None
    if dtype == "packed":
        return jnp.asarray(rng.integers(0, 256, (E, k // 2, N)), jnp.uint8), scale, zero, \
            group, offset
    lo, hi = {jnp.int8: (-127, 128), jnp.int4: (-8, 8), jnp.uint8: (0, 256)}[dtype]
    w = jnp.asarray(rng.integers(lo, hi, (E, k, N)), jnp.int32).astype(dtype)
    return w, scale, zero, group, offset


def _rows(sizes: str, x_dtype, seed: int = 1, k: int = K):
    """(x [M, k] with the padding rows NaN, group_sizes i32[E], the number of valid rows)."""
    group_sizes, m = SIZES[sizes]
    valid = sum(group_sizes)
    x = np.random.default_rng(seed).normal(size=(m, k)).astype(np.float32)
    x[valid:] = np.nan
    return jnp.asarray(x, x_dtype), jnp.asarray(group_sizes, jnp.int32), valid


def _check(out, x, w, group_sizes, valid, fields):
    ref = grouped_matmul_reference(x, w, group_sizes, **fields)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # rows are the second-minor axis ([M, N], or [C, M, N] for C blocks)
    got, want = (a[..., :valid, :].astype(jnp.float32) for a in (out, ref))
    assert not jnp.isnan(got).any()
    if valid:
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert err < TOLERANCE[x.dtype], err


# (layout, x dtype, sizes, tiles): tm 8 splits the ragged groups across tiles; tm 16 with
# groups of 8 dequantizes each expert's tile before its dot, the others apply scales after
CASES = ([("f32", jnp.float32, s, (8, 128)) for s in SIZES]
         + [("bf16", jnp.bfloat16, "ragged", (16, 128)),
            ("int8", jnp.float32, "ragged", (8, 128)), ("int8", jnp.bfloat16, "decode", None),
            ("int4 g128", jnp.float32, "ragged", (8, 128)),
            ("int4 g128", jnp.bfloat16, "one expert", (16, 256)),
            ("u8 g32", jnp.float32, "ragged", (8, 128)),
            ("int4 g8", jnp.float32, "ragged", (24, 128)),
            ("int4 g8", jnp.bfloat16, "one expert", (16, 256))])


@pytest.mark.parametrize("layout, x_dtype, sizes, tiles", CASES)
def test_tpu_kernel_interpret_matches_reference(layout, x_dtype, sizes, tiles):
    w, scale, zero, group, offset = _weights(layout)
    x, group_sizes, valid = _rows(sizes, x_dtype)
    fields = dict(scale=scale, zero=zero, group=group, offset=offset)
    out = grouped_matmul_tpu(x, w, group_sizes, tiles=tiles, interpret=True, **fields)
    _check(out, x, w, group_sizes, valid, fields)


# C = 2 blocks [E, 2, K, 128] (a mixture's gate and up as stored): float, per-channel int8,
# groups after and before the dot (tm 24 > 2 * 8), u8 groups
BLOCK_CASES = [("f32", jnp.float32, "ragged", (8, 128)),
               ("bf16", jnp.bfloat16, "one expert", None),
               ("int8", jnp.bfloat16, "decode", None),
               ("int4 g8", jnp.float32, "ragged", (24, 128)),
               ("int4 g128", jnp.float32, "ragged", (8, 128)),
               ("u8 g32", jnp.float32, "none", None),
               ("packed int4 g32", jnp.float32, "ragged", None)]  # XLA's forms only


@pytest.mark.parametrize("layout, x_dtype, sizes, tiles", BLOCK_CASES)
def test_blocks_read_as_stored_match_the_reference(layout, x_dtype, sizes, tiles):
    """A weight of two output blocks [E, 2, K, N'] gives [2, M, N']: block c's product equals
    the grouped matmul of w[:, c] alone, through the kernel (interpret mode) and both XLA
    forms."""
    w, scale, zero, group, offset = _weights(layout, blocks=2)
    x, group_sizes, valid = _rows(sizes, x_dtype)
    fields = dict(scale=scale, zero=zero, group=group, offset=offset)
    ref = grouped_matmul_reference(x, w, group_sizes, **fields)
    assert ref.shape == (2, x.shape[0], N // 2)
    for c in range(2):
        one = {**fields, **{f: None if a is None else a[:, c]
                            for f, a in (("scale", scale), ("zero", zero))}}
        _check(ref[c], x, w[:, c], group_sizes, valid, one)
    outs = [] if layout.startswith("packed") else [
        grouped_matmul_tpu(x, w, group_sizes, tiles=tiles, interpret=True, **fields)]
    outs += [jax.jit(lambda x, g, form=form: grouped_matmul_xla(x, w, g, form=form, **fields))(
        x, group_sizes) for form in ("tiles", "rows")]
    for out in outs:
        _check(out, x, w, group_sizes, valid, fields)


@pytest.mark.parametrize("layout, x_dtype", [("bf16", jnp.bfloat16), ("int8", jnp.float32),
                                             ("int4 g8", jnp.float32)])
def test_a_stack_row_is_read_at_its_layer(layout, x_dtype):
    """`layer` given, w and its fields are stacks [L, ...] (a scanned model's experts): the
    kernel (interpret mode, the row a scalar prefetch in its index maps and scale DMAs) and the
    dispatch on CPU multiply row `layer` only, as the reference does w[layer]."""
    rows = [_weights(layout, seed=seed, blocks=2) for seed in range(3)]
    w, scale, zero = (None if rows[0][i] is None else jnp.stack([r[i] for r in rows])
                      for i in range(3))
    group, offset = rows[0][3:]
    x, group_sizes, valid = _rows("ragged", x_dtype)
    fields = dict(scale=scale, zero=zero, group=group, offset=offset)
    one = dict(scale=rows[1][1], zero=rows[1][2], group=group, offset=offset)
    layer = jnp.int32(1)
    for out in (grouped_matmul_tpu(x, w, group_sizes, layer=layer, tiles=(8, 128),
                                   interpret=True, **fields),
                jax.jit(lambda x, g, i: grouped_matmul(x, w, g, layer=i, **fields))(
                    x, group_sizes, layer)):
        _check(out, x, rows[1][0], group_sizes, valid, one)


@pytest.mark.parametrize("layout, k, tiles", [("int4 g8", K, (16, 128)),
                                              ("u8 g32", 192, (8, 128))])
def test_tpu_interpret_mode_without_races(layout, k, tiles):
    """TPU interpret mode (simulated DMAs run at their waits, uninitialised VMEM as NaN, race
    detection), groups sharing row tiles: int4 dequantized per expert into scratch (scales
    [E, rows, N] as XLA stores them); u8 groups with 6 scale rows, which XLA TPU stores
    rows-major ([rows][E][N]): the kernel DMAs each expert's rows out of the middle axis."""
    from jax._src.pallas.mosaic import interpret as tpu_interpret
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.grouped_matmul.tpu import rows_major

    # one column tile of 128 (TPU interpret mode costs ~0.1-1 s a grid step)
    w, scale, zero = (a[..., :128] for a in _weights(layout, k=k)[:3])
    group, offset = LAYOUTS[layout][1:]
    x, group_sizes, valid = _rows("ragged", jnp.float32, k=k)
    assert rows_major(E, k // group) == (k == 192)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait",
                                   uninitialized_memory="nan")
    fields = dict(scale=scale, zero=zero, group=group, offset=offset)
    try:
        out = grouped_matmul_tpu(x, w, group_sizes, tiles=tiles, interpret=params, **fields)
        races = tpu_interpret.interpret_pallas_call.races.races_found
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert not races
    _check(out, x, w, group_sizes, valid, fields)


@pytest.mark.parametrize("layout, x_dtype, sizes, tm", [
    (layout, jnp.float32, sizes, tm) for layout in ("f32", "int8", "int4 g128", "u8 g32",
                                                   "packed int4 g32")
    for sizes, tm in (("ragged", 8), ("one expert", None), ("decode", None))
] + [("bf16", jnp.bfloat16, "ragged", 4), ("packed int4 g32", jnp.bfloat16, "ragged", 1),
     ("f32", jnp.float32, "none", None)])
def test_xla_matches_reference(layout, x_dtype, sizes, tm):
    w, scale, zero, group, offset = _weights(layout)
    x, group_sizes, valid = _rows(sizes, x_dtype)
    fields = dict(scale=scale, zero=zero, group=group, offset=offset)
    out = jax.jit(lambda x, g: grouped_matmul_xla(x, w, g, tm=tm, **fields))(x, group_sizes)
    _check(out, x, w, group_sizes, valid, fields)
    assert not jnp.any(out[valid:])  # padding rows are never written


@pytest.mark.parametrize("kind, group", [("int8", 0), ("int8", 32), ("int4", 32),
                                         ("int4", 128)])
def test_jaxinfer_quantized_experts(kind, group):
    """An expert stack [E, K, N] quantized by jaxinfer (`jaxinfer.model.quant.quantize`, the
    contraction axis 1): its stored fields as they are (int4 u8-packed, the CPU layout) through
    XLA's loop, and int4 as placed on a TPU (native 4-bit) through the kernel in interpret
    mode, against the dense product with the weight the fields stand for."""
    from jaxinfer.model import quant

    rng = np.random.default_rng(5)
    t = quant.quantize(rng.normal(0, 0.05, (E, K, N)).astype(np.float32), (1,), kind, group)
    x, group_sizes, valid = _rows("ragged", jnp.float32)
    want = grouped_matmul_reference(x, jnp.asarray(quant.dequantize_host(t)), group_sizes)
    fields = dict(scale=jnp.asarray(t.scale), zero=None if t.zero is None
                  else jnp.asarray(t.zero), group=t.group)
    outs = [grouped_matmul(x, jnp.asarray(t.q), group_sizes, **fields)]
    if kind == "int4":
        native = quant._to_native(jnp.asarray(t.q), 1, t.group)
        outs.append(grouped_matmul_tpu(x, native, group_sizes, offset=quant.NATIVE_INT4_OFFSET,
                                       tiles=(8, 128), interpret=True, **fields))
    for out in outs:
        err = float(jnp.linalg.norm(out[:valid] - want[:valid]) / jnp.linalg.norm(want[:valid]))
        assert err < TOLERANCE[x.dtype], err


def test_dispatch_on_cpu_is_the_xla_loop():
    w, *_ = _weights("f32")
    x, group_sizes, valid = _rows("ragged", jnp.float32)
    hlo = jax.jit(lambda x, g: grouped_matmul(x, w, g)).lower(x, group_sizes).as_text()
    assert "while" in hlo and "tpu_custom_call" not in hlo
    _check(grouped_matmul(x, w, group_sizes), x, w, group_sizes, valid, {})


def test_bad_inputs_name_the_value():
    w, scale, zero, _, _ = _weights("u8 g32")
    x, group_sizes, _ = _rows("ragged", jnp.float32)
    with pytest.raises(ValueError, match="group 48 must be > 0 and divide K = 256"):
        grouped_matmul(x, w, group_sizes, scale=scale, zero=zero, group=48)
    with pytest.raises(ValueError, match=r"scale and zero must both be f32\[8, 8, 256\]"):
        grouped_matmul(x, w, group_sizes, scale=scale[:, :4], zero=zero, group=32)
    with pytest.raises(ValueError, match=r"need w \[E, K, N\].*E = 7"):
        grouped_matmul(x, w, group_sizes[:7], scale=scale, zero=zero, group=32)
    with pytest.raises(ValueError, match=r"group_sizes int32\[8\]|need i32\[E\]"):
        grouped_matmul(x, w, group_sizes.astype(jnp.float32), scale=scale, zero=zero, group=32)
    with pytest.raises(ValueError, match=r"x float32\[256\]: need a \[M, K\] array"):
        grouped_matmul(x[0], w, group_sizes, scale=scale, zero=zero, group=32, backend="tpu")
    with pytest.raises(ValueError, match="no grouped matmul for backend 'metal'"):
        grouped_matmul(x, w, group_sizes, scale=scale, zero=zero, group=32, backend="metal")
    packed, *_ = _weights("packed int4 g32")
    with pytest.raises(ValueError, match="u8-packed int4 w: the TPU kernel reads native"):
        grouped_matmul_tpu(x, packed, group_sizes, scale=scale, zero=zero, group=32)


# ----- compiled without the hardware -----------------------------------------------------------
@pytest.fixture(scope="module")
def tpu_devices():
    return {name: topologies.get_topology_desc(name, platform="tpu").devices[0]
            for name in ("v5e:2x2", "v6e:2x2")}


def _compile(device, fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(device)) for s, d in shapes]
    with jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("x",))):
        return jax.jit(fn).trace(*args).lower().compile()


def _bytes_accessed(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


# Qwen3-30B-A3B's experts (E 128, D 2048, F 768; gate and up as one [D, 2F] weight, down
# [F, D]) at decode steps of 8 tokens x 8 experts (64 rows, tm 16: scales after) and of one
# token (8 rows), and a 2048-token prompt (16384 rows, tm 64: u8 groups of 32 dequantized
# before the dot, int4 groups of 128 after)
@pytest.mark.parametrize("topology, m, layout, cost_groups, k, n", [
    ("v5e:2x2", 64, "bf16", 42, 2048, 1536), ("v5e:2x2", 64, "int8", None, 2048, 1536),
    ("v6e:2x2", 64, "int4 g128", 42, 2048, 1536), ("v5e:2x2", 8, "int4 g128", 8, 768, 2048),
    ("v5e:2x2", 16384, "u8 g32", None, 2048, 1536),
    ("v6e:2x2", 16384, "int4 g128", None, 2048, 1536)])
def test_tpu_compile_bytes_are_the_grid_traffic(tpu_devices, topology, m, layout, cost_groups,
                                                k, n):
    """The weights of `cost_groups` experts (default min(E, M) = all 128 at the prompt) once,
    their scales once, x once per 512-column tile, the output once, and the metadata. The down
    projection's int4 scales f32[128, 6, 2048] are stored rows-major by XLA TPU: read in that
    order, with no relayout copy (one would add 2 x 12.6 MB)."""
    e = 128
    dtype, group, offset = LAYOUTS[layout]
    tm, tn = tile_sizes(m, k, n, e, x_dtype=jnp.bfloat16, w_dtype=dtype, group=group)
    steps = -(-m // tm) + e - 1
    rows = k // group if group else 1
    fields = [] if jnp.issubdtype(dtype, jnp.floating) else [((e, rows, n), jnp.float32)] * (
        2 if group else 1)

    def fn(offsets, ids, tiles, num_steps, slots, x, w, *sz):
        return grouped_matmul_tpu(
            x, w, jnp.zeros(e, jnp.int32), scale=sz[0] if sz else None,
            zero=sz[1] if group else None, group=group, offset=offset, cost_groups=cost_groups,
            metadata=(offsets, ids, tiles, num_steps, slots))

    compiled = _compile(tpu_devices[topology], fn, ((e + 1,), jnp.int32),
                        ((steps,), jnp.int32), ((steps,), jnp.int32), ((), jnp.int32),
                        ((e,), jnp.int32), ((m, k), jnp.bfloat16), ((e, k, n), dtype), *fields)
    bits = 4 if dtype == jnp.int4 else 8 * jnp.dtype(dtype).itemsize
    expert = k * n * bits // 8 + 4 * rows * n * len(fields)
    traffic = ((cost_groups or min(e, m)) * expert + (n // tn) * m * k * 2 + m * n * 2
               + 4 * (2 * e + 1 + 2 * steps))
    # + XLA's copy of the grid's step count into SMEM (a 128-word tile read and written);
    # XLA reports bytes accessed as a float32
    assert tn == 512 and _bytes_accessed(compiled) == np.float32(traffic + 2 * 4 * 128)


@pytest.mark.parametrize("layout", ["bf16", "int8", "int4 g128"])
def test_tpu_gate_up_blocks_compile_without_a_weight_copy(tpu_devices, layout):
    """Qwen3-30B-A3B's gate/up experts as the model stores them, [128, 2, 2048, 768] (gate and
    up before the contraction), at a decode step's 64 rows on v6e: the kernel's index map reads
    them (and their scales [128, 2, rows, 768]) where they lie, so the program has no copy,
    transpose or kept reshape of them, and XLA's bytes accessed are the grid's traffic with
    N = 2 x 768 (tn 256)."""
    from jaxinfer.proof import hlo_scan

    e, c, k, n, m, cost_groups = 128, 2, 2048, 768, 64, 42
    dtype, group, offset = LAYOUTS[layout]
    tm, tn = tile_sizes(m, k, n, e, x_dtype=jnp.bfloat16, w_dtype=dtype, group=group)
    rows = k // group if group else 1
    fields = [] if jnp.issubdtype(dtype, jnp.floating) else [((e, c, rows, n), jnp.float32)] * (
        2 if group else 1)

    def fn(x, w, g, *sz):
        return grouped_matmul(x, w, g, scale=sz[0] if sz else None,
                              zero=sz[1] if group else None, group=group, offset=offset,
                              cost_groups=cost_groups)

    compiled = _compile(tpu_devices["v6e:2x2"], fn, ((m, k), jnp.bfloat16),
                        ((e, c, k, n), dtype), ((e,), jnp.int32), *fields)
    hlo = compiled.as_text()
    assert "tpu_custom_call" in hlo
    shapes = {hlo_scan.shape_key((e, c, k, n)): "weight",  # any permutation of it, merged
              hlo_scan.shape_key((e, k, c * n)): "weight",
              hlo_scan.shape_key((e, c, rows, n)): "scales"}
    assert hlo_scan.shape_moves(hlo, shapes) == []
    bits = 4 if dtype == jnp.int4 else 8 * jnp.dtype(dtype).itemsize
    expert = c * k * n * bits // 8 + 4 * c * rows * n * len(fields)
    steps = -(-m // tm) + e - 1
    kernel = (cost_groups * expert + (c * n // tn) * m * k * 2 + c * m * n * 2
              + 4 * (2 * e + 1 + 2 * steps))
    # the kernel, and the few KB of group metadata XLA computes around it
    assert tn == 256 and kernel < _bytes_accessed(compiled) < kernel + 64 * 1024


@pytest.mark.parametrize("layout", ["bf16", "int8"])
def test_tpu_reads_lane_padded_weights_transposed(tpu_devices, layout):
    """A weight whose N pads the 128-lane tile, K not (a toy's expert shard [4, 2, 256, 192]),
    XLA TPU stores with its two minor dims swapped: the kernel reads it so (no copy), and in
    interpret mode the transposed tiles give the reference's product."""
    from jaxinfer.proof import hlo_scan
    from pallas_kernels.grouped_matmul.tpu import lanes_transposed

    e, c, k, n = 4, 2, 256, 192
    dtype = LAYOUTS[layout][0]
    assert lanes_transposed(k, n) and not lanes_transposed(k, 384)
    fields = [((e, c, 1, n), jnp.float32)] if layout == "int8" else []
    fn = lambda x, w, g, *sz: grouped_matmul(x, w, g, scale=sz[0] if sz else None)  # noqa: E731
    hlo = _compile(tpu_devices["v5e:2x2"], fn, ((8, k), jnp.bfloat16), ((e, c, k, n), dtype),
                   ((e,), jnp.int32), *fields).as_text()
    assert "tpu_custom_call" in hlo
    assert hlo_scan.shape_moves(hlo, {hlo_scan.shape_key((e, c, k, n)): "weight"}) == []
    w, scale = (a if a is None else a[..., :n // 2] for a in _weights(layout, blocks=2)[:2])
    x, group_sizes, valid = _rows("ragged", jnp.float32)
    out = grouped_matmul_tpu(x, w, group_sizes, scale=scale, tiles=(8, n // 2), interpret=True)
    _check(out, x, w, group_sizes, valid, dict(scale=scale))


def test_tpu_reads_a_scanned_row_of_the_stack_in_place(tpu_devices):
    """Qwen3-30B-A3B's gate/up experts of 4 scanned layers [4, 128, 2, 2048, 768], multiplied
    in a `lax.scan` over the layers, each at its row: the kernel reads the row where it lies
    (a scalar prefetch in its index map), so no layer's experts are copied out of the stack
    (the loop body's bytes: the kernel's declared traffic plus a few KB of metadata)."""
    from jaxinfer.proof import hlo_scan

    num_layers, e, c, k, n, m = 4, 128, 2, 2048, 768, 64

    def fn(x, stack, g):
        def body(x, layer):
            y = grouped_matmul(x, stack, g, layer=layer, cost_groups=8)
            return x + y[0, :, :1].astype(x.dtype), None
        return jax.lax.scan(body, x, jnp.arange(num_layers, dtype=jnp.int32))[0]

    compiled = _compile(tpu_devices["v6e:2x2"], fn, ((m, k), jnp.bfloat16),
                        ((num_layers, e, c, k, n), jnp.bfloat16), ((e,), jnp.int32))
    hlo = compiled.as_text()
    assert "tpu_custom_call" in hlo
    shapes = {hlo_scan.shape_key((e, c, k, n)): "weight row",
              hlo_scan.shape_key((num_layers, e, c, k, n)): "weight"}
    assert hlo_scan.shape_moves(hlo, shapes) == []
    # XLA counts a loop body once: one row's 8 experts, not a row copied (128 experts)
    assert _bytes_accessed(compiled) < 10 * c * k * n * 2


def test_float_blocks_no_lane_tile_divides_run_ragged_column_tiles(tpu_devices):
    """gpt-oss's experts, blocks of N = 2880 (no 128-lane tile divides it, and a whole
    [2880, 2880] tile does not fit VMEM): the kernel runs 128-multiple column tiles with a
    ragged last one (its padding columns dropped), in interpret mode equal to the reference on
    [E, 2, 192, 192], and compiled for v6e it reads the 8 routed experts, not a copy."""
    from pallas_kernels.grouped_matmul.tpu import tile_sizes as tiles_for

    assert tiles_for(64, 2880, 2880, 16, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16)[1] == 512
    # quantized: whole-N tiles only (the scales' DMAs would run past N); int8's fits
    assert tiles_for(64, 2880, 2880, 16, x_dtype=jnp.bfloat16, w_dtype=jnp.int8)[1] == 2880
    w = _weights("f32", k=192, blocks=2)[0][..., :192]
    x, group_sizes, valid = _rows("ragged", jnp.float32, k=192)
    out = grouped_matmul_tpu(x, w, group_sizes, tiles=(8, 128), interpret=True)
    _check(out, x, w, group_sizes, valid, {})
    e, c, k, n, m = 16, 2, 2880, 2880, 64
    compiled = _compile(tpu_devices["v6e:2x2"],
                        lambda x, w, g: grouped_matmul(x, w, g, cost_groups=8),
                        ((m, k), jnp.bfloat16), ((e, c, k, n), jnp.bfloat16), ((e,), jnp.int32))
    assert "tpu_custom_call" in compiled.as_text()
    assert 8 * c * k * n * 2 < _bytes_accessed(compiled) < 9 * c * k * n * 2


def test_tpu_dispatch_compiles_the_kernel(tpu_devices):
    """Traced for a TPU, `grouped_matmul` runs the Mosaic kernel, and the group metadata XLA
    computes around it costs a few KB (megablox's would count 1-5 MB)."""
    e, k, n, m = 128, 2048, 1536, 64
    compiled = _compile(tpu_devices["v5e:2x2"],
                        lambda x, w, g: grouped_matmul(x, w, g, cost_groups=0),
                        ((m, k), jnp.bfloat16), ((e, k, n), jnp.bfloat16), ((e,), jnp.int32))
    assert "tpu_custom_call" in compiled.as_text()
    kernel = 3 * m * k * 2 + m * n * 2 + 4 * (2 * e + 1 + 2 * (4 + e - 1))  # no weight read
    assert kernel < _bytes_accessed(compiled) < kernel + 64 * 1024, _bytes_accessed(compiled)


def test_xla_loop_compiled_for_cpu_reads_one_expert_per_step():
    """XLA's cost analysis counts a while loop's body once: the body copies its expert out of
    the stack and reads it in the dot (4 experts' bytes at most, x and the output besides); a
    program that read every expert would count all 64."""
    e, k, n, m = 64, 1024, 512, 64
    compiled = jax.jit(grouped_matmul_xla).trace(
        jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((e, k, n), jnp.float32),
        jax.ShapeDtypeStruct((e,), jnp.int32)).lower().compile()
    assert "while" in compiled.as_text()
    assert _bytes_accessed(compiled) < 4 * k * n * 4


@pytest.mark.parametrize("m, form", [(64, "rows"), (16384, "tiles")])
def test_xla_forms_compile_for_sm90a(m, form):
    """Deviceless XLA:GPU compile for an H100 (sm_90a) of Qwen3-30B-A3B's gate/up experts,
    bf16 and int4 in groups of 128: a decode step's 64 rows (each row's expert read inside one
    reduction, no loop) and a 2048-token prompt's 16384 rows (the tile loop); no temporary
    near the experts' size (XLA gives no cost analysis for a compile-only CUDA device)."""
    require_cuda_compiler()
    from pallas_kernels.platform import GPU_TARGETS

    device = topologies.get_topology_desc("h100", "cuda", target_config=GPU_TARGETS["h100"],
                                          topology="1x1x1").devices[0]
    e, k, n = 128, 2048, 1536
    for dtype, group in ((jnp.bfloat16, 0), (jnp.int4, 128)):
        fields = [((e, k // group, n), jnp.float32)] * 2 if group else []

        def fn(x, w, g, *sz, group=group):
            return grouped_matmul(x, w, g, scale=sz[0] if sz else None,
                                  zero=sz[1] if sz else None, group=group,
                                  offset=8 if group else 0)

        compiled = _compile(device, fn, ((m, k), jnp.bfloat16), ((e, k, n), dtype),
                            ((e,), jnp.int32), *fields)
        hlo = compiled.as_text()
        assert (" while(" in hlo and "gemm_fusion" in hlo) == (form == "tiles")
        # a f32 expert at most (a prompt tile's copy of its expert, int4's group products)
        assert compiled.memory_analysis().temp_size_in_bytes < 4 * k * n
