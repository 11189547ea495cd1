"""Quantized weights: the storage layout, the host (numpy) quantizers, and the in-step matmul.

Two formats (int8 in two layouts), stored as ordinary sharded params next to their scales
(docs/architecture.md, decision 12):

- int8 with `group` 0: symmetric, one scale per output channel. `q: i8[shape]`, `scale: f32` of
  the weight's shape with every contraction axis 1; w = q * scale. 1 byte per weight: the
  layout for float checkpoints (Hugging Face), where the bytes a TPU step reads matter most.
- int8 with `group` > 0: asymmetric, one scale and one offset per group along the last
  contraction axis, as int4 below but unpacked: `q: u8[shape]` in [0, 255], w = q * scale + zero.
  The layout of a GGUF load (groups of 32, its block size; `jaxinfer.checkpoint.requant`):
  Q8_0, Q4_0, Q4_1, Q4_K, Q5_0 and Q5_1 blocks become groups with their stored integers and
  scales, so the model computes with the file's own weights; 1.25 bytes per weight.
- int4: asymmetric, one scale and one offset per group of `group` consecutive elements along the
  weight's last contraction axis (the Q4_1 / Q4_K form, so those GGUF blocks convert exactly).
  `q: u8` packs two 4-bit values per byte within each group, as ggml's Q4_0 / Q4_1 blocks do:
  byte j of a group holds element j in its low nibble and element j + group / 2 in its high
  one, so that axis is halved; `scale, zero: f32` have that axis divided by `group` (the other
  contraction axes kept); w = q * scale + zero with q in [0, 15]. A grouped axis shorter than
  `group` (the o projection's head dim at group 128) is one group. Packing within a group keeps
  a byte, its group and its activations on one device when the axis is split over "model"
  (the down projection's ffn axis), and unpacks by a concatenation inside the group. The u8
  packing is the host and checkpoint layout (numpy's `uint4` takes a byte per value and orbax
  cannot save it) and the CPU device's; on TPU and GPU `q` is native 4-bit on device (below).

Every field keeps the weight's logical axis names (`jaxinfer.sharding.RULES` shards them the
same way; a field whose dimension the mesh axis does not divide, e.g. an int8 scale's 1, is
replicated).

Rule for the embedding and the LM head: when the layers are int8 or int4, the token embedding
(and the LM head, tied or not) is int8 in the model's int8 layout (`int8_group_size`: a scale
per vocabulary row, or groups along the embedding axis); a step dequantizes only the gathered
rows. The head is the most sensitive matrix (its error lands on the logits
unattenuated): int4 there costs far more accuracy than in the layers, which is also why the GGUFs
we load keep it at Q8_0/Q6_K. Norms and biases stay f32.

The step dequantizes inside the jit (`dequantize` / `einsum`), so each weight is read from HBM
once in its stored form, with no float copy of it in HBM (no temporaries; tests/test_quant_tpu.py
compiles for TPU v5e). On XLA TPU only a bare convert fuses into the dot's operand, so
per-channel int8 applies its scale to the dot's output. For int4 on TPU and GPU the u8 packing
is the host and checkpoint layout only: `native_int4_params` (run by
`jaxinfer.engine.steps.split_model`) converts each int4 `q` as it is placed to JAX's native
4-bit `jnp.int4` of the weight's own shape (XLA stores it two per byte), the values shifted to
[-8, 7] (q - NATIVE_INT4_OFFSET, added back in the step; XLA GPU fuses an s4 convert into its
Triton dot but materialises a u4 one as a bf16 weight, TPU treats both alike). `einsum` then
applies the scale and offset after a dot batched over the groups (`_einsum_groups_after`)
while its [rows, groups, out] f32 intermediate has at most 2 elements per weight element
(rows <= 2 * group: 256 rows at groups of 128: decode, verification, short chunks), and
dequantizes before the dot otherwise (long prompt chunks). On CPU int4 stays u8-packed
(`_einsum_chunked`, measured faster there). Default group (`default_int4_group`): 128 for a
float checkpoint placed on TPU or GPU (an 8B projection at 8 rows: 3.68x fewer bytes accessed
than bf16, against 3.69x at 32, but 0.5625 bytes per weight against 0.75 and the after form up
to 256 rows; docs/benchmarks.md, "Quantized weights"), 32 on CPU and for a GGUF (its 4-bit
blocks of 32 are kept exactly).

On TPU, a projection of int8 (per channel, or grouped: a GGUF load) or native int4 weights
with at most `quant_tpu.KERNEL_MAX_ROWS` (256) rows per data shard (decode, verification),
in the unrolled layout (`jaxinfer.model.layers`: a scanned layer's weights, a row of their
stack, keep XLA's fused dot, which reads the row in place; the kernel would need it copied),
runs the Pallas kernel `pallas_kernels.quant_matmul` under `jax.shard_map` (`_einsum_kernel`,
`jaxinfer.model.quant_tpu`): it reads each stored weight tile from HBM once and applies the
scales (and the groups' offsets) to its f32 accumulator. Through XLA's fused dot instead,
memory-space assignment prefetches the stored weights into VMEM, a copy XLA's cost model counts
besides the read (docs/benchmarks.md, "Quantized weights"). Shapes that do not tile (a 576-wide
SmolLM2 matrix, an 8B LM head shard of 32064 columns), the tied LM head ([V, D]: contraction
last) and longer prompt chunks keep the XLA forms above; CPU and GPU never take the kernel.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import AFTER_DOT_ROWS_PER_GROUP, INT4_GROUP, INT4_GROUP_NATIVE
from jaxinfer.model import quant_tpu
from pallas_kernels.platform import traced_backend

QUANT_DTYPES = ("int8", "int4")
INT4_MAX = 15
UINT8_MAX = 255  # grouped int8's top level
# Platforms whose int4 params are native 4-bit on device (`native_int4_params`); jax spells a
# CUDA device's platform "gpu", a deviceless CUDA target "cuda".
NATIVE_INT4_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")
NATIVE_INT4_OFFSET = 8  # native int4 stores q - 8 in [-8, 7] (`native_int4_params`)


def default_int4_group(platform: str, source_format: str, dims: Sequence[int] = ()) -> int:
    """The int4 group size of a quantized load from a `source_format` checkpoint for devices of
    `platform` (module doc): a GGUF keeps its blocks of 32; a float checkpoint gets groups of
    INT4_GROUP_NATIVE (128) where int4 is native 4-bit (its bytes accessed drop most), halved
    until it divides every grouped dimension in `dims` (the embedding and FFN widths: 576 takes
    64), and INT4_GROUP (32) elsewhere."""
    if source_format == "gguf" or platform not in NATIVE_INT4_PLATFORMS:
        return INT4_GROUP
    group = INT4_GROUP_NATIVE
    while group > INT4_GROUP and any(d % group for d in dims):
        group //= 2
    return group


@dataclasses.dataclass(frozen=True)
class QTensor:
    """A host-side quantized weight: numpy arrays (or `jax.ShapeDtypeStruct`s for an abstract
    model) in the layout of the module doc.

    shape: the float weight's shape; contract: its contraction axes (ascending);
    kind: "int8" or "int4"; group: elements per scale along the last contraction axis (0:
    per-channel int8).
    """

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    shape: tuple[int, ...]
    contract: tuple[int, ...]
    kind: str
    group: int = 0

    def fields(self) -> dict[str, np.ndarray]:
        out = {"q": self.q, "scale": self.scale}
        if self.zero is not None:
            out["zero"] = self.zero
        return out

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(a) for a in self.fields().values())


def _nbytes(a) -> int:
    return array_bytes(a.shape, a.dtype)


def array_bytes(shape: Sequence[int], dtype) -> int:
    """Bytes an array of `shape` and `dtype` takes on a device: 4-bit types two per byte (as XLA
    stores them; numpy's `itemsize` says one byte each)."""
    size = int(np.prod(shape, dtype=np.int64))
    if np.dtype(dtype) in (np.dtype(jnp.int4), np.dtype(jnp.uint4)):
        return -(-size // 2)
    return size * np.dtype(dtype).itemsize


def field_shapes(shape: Sequence[int], contract: Sequence[int], kind: str,
                 group: int) -> dict[str, tuple[int, ...]]:
    """The shapes of q, scale (and zero) of a weight of `shape` (see the module doc)."""
    shape = tuple(shape)
    last = contract[-1]
    if kind == "int8" and not group:
        scale = tuple(1 if i in contract else d for i, d in enumerate(shape))
        return {"q": shape, "scale": scale}
    if group <= 0 or shape[last] % group or (kind == "int4" and group % 2):
        raise ValueError(f"{kind}: contraction dim {shape[last]} of a weight {shape} is not a "
                         f"multiple of the group size {group}"
                         + (" (an even number)" if kind == "int4" else ""))
    q = tuple(d // 2 if i == last and kind == "int4" else d for i, d in enumerate(shape))
    scale = tuple(d // group if i == last else d for i, d in enumerate(shape))
    return {"q": q, "scale": scale, "zero": scale}


def check_kind(kind: str) -> None:
    if kind not in QUANT_DTYPES:
        raise ValueError(f"quantized weight dtype {kind!r} is not one of {QUANT_DTYPES}")


# ----- host quantizers (numpy; the reference the tests compare against) -----------------------
def quantize(w: np.ndarray, contract: Sequence[int], kind: str,
             group: int | None = None) -> QTensor:
    """Round-to-nearest quantization of a float weight (numpy) to `kind` (module doc layout);
    `group` None: 32 for int4, per channel (0) for int8; a group longer than the grouped axis is
    that axis. A `jax.ShapeDtypeStruct` gives the abstract QTensor (shapes only)."""
    check_kind(kind)
    contract = tuple(sorted(a % len(w.shape) for a in contract))
    if group is None:
        group = 32 if kind == "int4" else 0
    if kind == "int4" and group <= 0:
        raise ValueError(f"int4 needs a group size > 0, got {group}")
    group = min(group, w.shape[contract[-1]]) if group else 0
    shapes = field_shapes(w.shape, contract, kind, group)
    if isinstance(w, jax.ShapeDtypeStruct):
        dtypes = {"q": np.uint8 if group else np.int8, "scale": np.float32, "zero": np.float32}
        fields = {k: jax.ShapeDtypeStruct(s, dtypes[k]) for k, s in shapes.items()}
        return QTensor(shape=tuple(w.shape), contract=contract, kind=kind, group=group,
                       zero=fields.pop("zero", None), **fields)
    w = np.asarray(w, np.float32)
    if not group:
        q, scale, zero = (*_quantize_int8(w, contract), None)
    else:
        q, scale, zero = _quantize_grouped(w, contract[-1], group, kind)
    return QTensor(q=q, scale=scale, zero=zero, shape=w.shape, contract=contract, kind=kind,
                   group=group)


def _quantize_int8(w: np.ndarray, contract: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    amax = np.max(np.abs(w), axis=contract, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def _quantize_grouped(w: np.ndarray, axis: int, group: int, kind: str
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group: levels evenly from the group's min (zero) to its max; int4 packed."""
    top = INT4_MAX if kind == "int4" else UINT8_MAX
    g = _grouped(w, axis, group)  # [..., n, group, ...]
    lo = np.min(g, axis=axis + 1, keepdims=True)
    hi = np.max(g, axis=axis + 1, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / np.float32(top), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint((g - lo) / scale), 0, top).astype(np.uint8).reshape(w.shape)
    if kind == "int4":
        q = pack_int4(q, axis, group)
    return q, np.squeeze(scale, axis + 1), np.squeeze(lo, axis + 1)


def _grouped(a, axis: int, group: int):
    """a with `axis` split into (a.shape[axis] // group, group)."""
    return a.reshape(a.shape[:axis] + (a.shape[axis] // group, group) + a.shape[axis + 1:])


def pack_int4(q: np.ndarray, axis: int, group: int) -> np.ndarray:
    """u8 values in [0, 15] -> bytes along `axis` (halved): within each group of `group`,
    byte j = element j (low nibble) | element j + group / 2 (high nibble)."""
    g = _grouped(q, axis, group)
    half = group // 2
    lo = np.take(g, np.arange(half), axis=axis + 1)
    hi = np.take(g, np.arange(half, group), axis=axis + 1)
    packed = (lo | (hi << np.uint8(4))).astype(np.uint8)
    return packed.reshape(q.shape[:axis] + (q.shape[axis] // 2,) + q.shape[axis + 1:])


def unpack_grouped(p, axis: int, group: int, xp=np):
    """Inverse of `pack_int4`, grouped (numpy or jax.numpy): u8 [.., n * group / 2, ..] ->
    u8 [.., n, group, ..]."""
    g = _grouped(p, axis, group // 2)
    return xp.concatenate([g & 0x0F, g >> 4], axis=axis + 1)


def unpack_int4(p, axis: int, group: int, xp=np):
    """Inverse of `pack_int4`: u8 [.., n/2, ..] -> u8 [.., n, ..]."""
    g = unpack_grouped(p, axis, group, xp)
    return g.reshape(p.shape[:axis] + (p.shape[axis] * 2,) + p.shape[axis + 1:])


def grouped_values(q, kind: str, axis: int, group: int, xp=np):
    """The integer values of a grouped weight's `q` (numpy or jax.numpy), `axis` split into
    (n, group): int4 unpacked, int8 reshaped."""
    if kind == "int4":
        return unpack_grouped(q, axis, group, xp)
    return _grouped(q, axis, group)


def dequantize_host(t: QTensor) -> np.ndarray:
    """The float weight (numpy f32) a QTensor stands for."""
    if not t.group:
        return t.q.astype(np.float32) * t.scale
    axis = t.contract[-1]
    q = grouped_values(t.q, t.kind, axis, t.group).astype(np.float32)
    out = q * np.expand_dims(t.scale, axis + 1) + np.expand_dims(t.zero, axis + 1)
    return out.reshape(t.shape)


# ----- host layout ops on QTensors (the loaders' transposes, the model's fusion) ---------------
def transform(t: QTensor, shape: Sequence[int], contract: Sequence[int],
              fn: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]) -> QTensor:
    """`t` as a weight of `shape` with contraction axes `contract`: every field is passed to
    fn(field, its target shape) (a reshape, a transpose, an index). The grouped axis must stay
    the last contraction axis."""
    shapes = field_shapes(shape, contract, t.kind, t.group)
    fields = {k: fn(v, shapes[k]) for k, v in t.fields().items()}
    for k, v in fields.items():
        if tuple(v.shape) != shapes[k]:
            raise ValueError(f"{t.kind} weight {t.shape} -> {tuple(shape)}: field {k} has "
                             f"shape {tuple(v.shape)}, expected {shapes[k]}")
    return dataclasses.replace(t, shape=tuple(shape), contract=tuple(contract),
                               zero=fields.pop("zero", None), **fields)


def reshape(t: QTensor, shape: Sequence[int], contract: Sequence[int]) -> QTensor:
    return transform(t, shape, contract, lambda a, s: a.reshape(s))


def transpose(t: QTensor, perm: Sequence[int]) -> QTensor:
    """Axes permuted (numpy `transpose` semantics); contraction axes follow."""
    inv = {old: new for new, old in enumerate(perm)}
    contract = tuple(sorted(inv[a] for a in t.contract))
    shape = tuple(t.shape[p] for p in perm)
    return transform(t, shape, contract, lambda a, s: np.ascontiguousarray(a.transpose(perm)))


def join(parts: Sequence[QTensor], axis: int, *, stack: bool) -> QTensor:
    """Concatenate (or stack) along a non-contraction `axis`, field by field."""
    first = parts[0]
    op = np.stack if stack else np.concatenate
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in first.fields().values()):
        op = None  # an abstract model: shapes only
    shape = list(first.shape)
    if stack:
        shape.insert(axis, len(parts))
        contract = tuple(a + (a >= axis) for a in first.contract)
    else:
        shape[axis] = sum(p.shape[axis] for p in parts)
        contract = first.contract
    shapes = field_shapes(shape, contract, first.kind, first.group)
    fields = {}
    for k in first.fields():
        arrays = [p.fields()[k] for p in parts]
        fields[k] = (jax.ShapeDtypeStruct(shapes[k], arrays[0].dtype) if op is None
                     else op(arrays, axis=axis))
    return dataclasses.replace(first, shape=tuple(shape), contract=contract,
                               zero=fields.pop("zero", None), **fields)


# ----- the model side (jax) ---------------------------------------------------------------------
class QuantWeight(nnx.Module):
    """A quantized weight inside the model: Params q, scale (and zero) carrying the weight's
    logical axes, plus the static layout (kind, contraction axes, group) and those axes
    (`axes`: the TPU kernel's shard_map finds each field's sharding from them). `kernel`: the
    step may run the TPU Pallas kernel on it; False for one layer's row of a scanned stack
    (`jaxinfer.model.layers`), a dynamic slice that XLA:TPU fuses into its own dot but would
    copy out of the stack for a kernel, which reads whole arrays."""

    def __init__(self, t: QTensor, axes: tuple[str, ...],
                 param: Callable[[object, tuple[str, ...]], nnx.Param], *, kernel: bool = True):
        self.kind, self.contract, self.group = t.kind, t.contract, t.group
        self.axes = tuple(axes)
        self.kernel = kernel
        self.q = param(t.q, axes)
        self.scale = param(t.scale, axes)
        if t.zero is not None:
            self.zero = param(t.zero, axes)

    @property
    def native(self) -> bool:
        """Whether `q` holds native 4-bit values of the weight's shape (`native_int4_params`)
        rather than the u8 packing."""
        return self.q.dtype == jnp.int4

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.q.shape)
        if self.kind == "int4" and not self.native:
            shape[self.contract[-1]] *= 2
        return tuple(shape)


# ----- native 4-bit on device ---------------------------------------------------------------------
def native_int4(platform: str) -> bool:
    """Whether int4 params are placed as native 4-bit on devices of `platform`."""
    return platform in NATIVE_INT4_PLATFORMS


def _to_native(q: jax.Array, axis: int, group: int) -> jax.Array:
    values = unpack_int4(q, axis, group, xp=jnp).astype(jnp.int8) - NATIVE_INT4_OFFSET
    return values.astype(jnp.int4)


def native_int4_params(model: nnx.Module, params: dict) -> dict:
    """`params` (`nnx.to_pure_dict` of `model`'s state, placed) with every int4 weight's u8
    packed `q` converted on its devices to `jnp.int4` (q - NATIVE_INT4_OFFSET) of the weight's
    shape, in the same
    sharding (the packing is within a group, so each shard unpacks its own bytes). An abstract
    leaf becomes the matching `jax.ShapeDtypeStruct`. One jitted conversion per weight shape."""
    for path, node in nnx.iter_graph(model):
        if not (isinstance(node, QuantWeight) and node.kind == "int4"):
            continue
        holder = params
        for key in path:
            holder = holder[key]
        q, axis = holder["q"], node.contract[-1]
        if q.dtype == jnp.int4:
            continue
        shape = tuple(d * 2 if i == axis else d for i, d in enumerate(q.shape))
        if isinstance(q, jax.ShapeDtypeStruct):
            holder["q"] = jax.ShapeDtypeStruct(shape, jnp.int4, sharding=q.sharding)
        else:
            holder["q"] = jax.jit(_to_native, static_argnums=(1, 2),
                                  out_shardings=q.sharding)(q, axis, node.group)
    return params


def dequantize(w, dtype, shape: tuple[int, ...] | None = None) -> jax.Array:
    """The float weight of a QuantWeight (or of a plain Param: its value) in `dtype`, computed
    inside the step; `shape`: reshaped to it (e.g. the o projection as a 2-D matrix)."""
    if not isinstance(w, QuantWeight):
        out = w[...].astype(dtype)
    elif not w.group:
        out = w.q[...].astype(dtype) * w.scale[...].astype(dtype)
    else:
        axis = w.contract[-1]
        if w.native:
            q = _grouped(w.q[...], axis, w.group).astype(dtype) + NATIVE_INT4_OFFSET
        else:
            q = grouped_values(w.q[...], w.kind, axis, w.group, xp=jnp).astype(dtype)
        out = (q * jnp.expand_dims(w.scale[...].astype(dtype), axis + 1)
               + jnp.expand_dims(w.zero[...].astype(dtype), axis + 1)).reshape(w.shape)
    return out if shape is None else out.reshape(shape)


def einsum(spec: str, x: jax.Array, w, *, shape: tuple[int, ...] | None = None,
           **kwargs) -> jax.Array:
    """jnp.einsum(spec, x, weight) for a projection whose output ends with the weight's
    non-contracted axes, in order (every one of the model). `shape`: the weight is reshaped to
    it first (contraction axes merged). Per-channel int8 applies its scale to the output, so
    only the convert sits between the stored bytes and the dot.

    Per backend: on one CPU device int8 and int4 run `_einsum_chunked` (XLA CPU does not fuse
    the dequantization into the dot, and whole-weight f32 temporaries cost more than the f32
    model); everywhere else the dequantization is a producer of the dot, which XLA TPU and GPU
    fuse. Native 4-bit int4 (`native_int4_params`) applies its scales after a dot batched
    over the groups when few rows multiply it (`_einsum_groups_after`). On TPU, decode-sized
    rows of int8 (per channel or grouped) and native int4 run the Pallas kernel
    (`_einsum_kernel`), unless the weight is a row of a scanned stack (`QuantWeight.kernel`).
    A weight with an output axis before its contraction (gate_up [2, D, F]) runs the kernel
    batched over it, and the other two forms once per index of that axis (`_per_leading`)."""
    if isinstance(w, QuantWeight) and w.kernel and (w.native or w.kind == "int8") \
            and traced_backend() == "tpu":
        out = _einsum_kernel(spec, x, w, shape, **kwargs)
        if out is not None:
            return out
    if isinstance(w, QuantWeight) and w.native:
        out = _per_leading(_einsum_groups_after, spec, x, w, shape, **kwargs)
        if out is not None:
            return out
    elif isinstance(w, QuantWeight) and _one_cpu_device():
        out = _per_leading(_einsum_chunked, spec, x, w, shape, **kwargs)
        if out is not None:
            return out
    if isinstance(w, QuantWeight) and not w.group:
        q = w.q[...].astype(x.dtype)
        out = _dot(spec, x, q if shape is None else q.reshape(shape), **kwargs)
        kept = [d for i, d in enumerate(w.scale.shape) if i not in w.contract]
        return out * w.scale[...].reshape(kept).astype(out.dtype)
    return _dot(spec, x, dequantize(w, x.dtype, shape), **kwargs)


def _leading_output(spec: str) -> str | None:
    """The weight's first label when it is an output before the contraction and more outputs
    follow ([C, D, F] in "ND,CDF->NCF"), else None."""
    x_labels, w_labels, out_labels, contract = _split_spec(spec)
    if "..." in spec or not contract or not w_labels[1:].startswith(contract) \
            or len(w_labels) == 1 + len(contract) or x_labels[:-len(contract)] + w_labels[0] \
            + w_labels[1 + len(contract):] != out_labels:
        return None
    return w_labels[0]


def _dot(spec: str, x: jax.Array, w: jax.Array, **kwargs) -> jax.Array:
    """jnp.einsum(spec, x, w) for a float weight; one with an output axis before its
    contraction (gate_up [2, D, F]) as a dot batched over that axis, x broadcast to it: as a
    plain dot XLA:CPU transposes such a weight to [2 x F, D] every step."""
    head = _leading_output(spec)
    if head is None:
        return jnp.einsum(spec, x, w, **kwargs)
    x_labels, w_labels, out_labels, _ = _split_spec(spec)
    inner = f"{head}{x_labels},{w_labels}->{head}{out_labels.replace(head, '')}"
    batched = jnp.einsum(inner, jnp.broadcast_to(x, w.shape[:1] + x.shape), w, **kwargs)
    return jnp.moveaxis(batched, 0, out_labels.index(head))


def _einsum_kernel(spec: str, x: jax.Array, w: QuantWeight, shape: tuple[int, ...] | None, *,
                   preferred_element_type=None, interpret: bool = False) -> jax.Array | None:
    """`einsum` through the TPU Pallas kernel (`quant_tpu.projection`: each weight tile read
    from HBM once, per-channel scales or the groups' scale and offset applied to its f32
    accumulator); None (XLA's dot) unless the spec is [.., contraction] x [leading..,
    contraction.., outputs..] -> [.., leading.., outputs..] with the weight's contraction axes
    after its leading outputs (if any) and its outputs kept by `shape`, and the rows and local
    shapes suit the kernel."""
    x_labels, w_labels, out_labels, contract = _split_spec(spec)
    nc, lc = len(w.contract), len(contract)  # more axes than labels: merged by `shape`
    lead = w_labels.find(contract) if contract else -1
    if lead < 0 or w.contract != tuple(range(lead, lead + nc)) \
            or not x_labels.endswith(contract) \
            or out_labels != x_labels[:-lc] + w_labels[:lead] + w_labels[lead + lc:] \
            or (shape is not None and (lead or tuple(shape[lc:]) != w.shape[nc:])):
        return None
    fields = {name: getattr(w, name)[...] for name in ("q", "scale", "zero") if hasattr(w, name)}
    return quant_tpu.projection(
        x, fields, w.axes, x_contract=len(contract), num_contract=nc, lead=lead, group=w.group,
        offset=NATIVE_INT4_OFFSET if w.native else 0,
        out_dtype=preferred_element_type or x.dtype, interpret=interpret)




class _Index:
    """Index i of a `QuantWeight`'s leading output axis, read like one (kind, contract, group,
    its fields, `native`, `shape`): a static slice of the stored arrays, which XLA reads in
    place."""

    def __init__(self, w: QuantWeight, i: int):
        self.kind, self.group, self.kernel = w.kind, w.group, False
        self.contract = tuple(a - 1 for a in w.contract)
        self.axes = w.axes[1:]
        for name in ("q", "scale", "zero"):
            if hasattr(w, name):
                setattr(self, name, getattr(w, name)[...][i])

    native = QuantWeight.native
    shape = QuantWeight.shape


def _per_leading(form, spec: str, x: jax.Array, w: QuantWeight,
                 shape: tuple[int, ...] | None, **kwargs) -> jax.Array | None:
    """`form(spec, x, w, shape)` (a contraction-first einsum form: `_einsum_groups_after`,
    `_einsum_chunked`) for a weight whose first axis is an output before its contraction
    (spec [.., contraction] x [leading, contraction.., outputs..] -> [.., leading,
    outputs..]): once per index of that axis, stacked. Contraction-first weights go to `form`
    as they are. None where `form` gives None."""
    head = _leading_output(spec)
    if head is None or w.contract[0] != 1 or shape is not None:
        return form(spec, x, w, shape, **kwargs)
    x_labels, w_labels, out_labels, contract = _split_spec(spec)
    batch = x_labels[:-len(contract)]
    inner = f"{x_labels},{w_labels[1:]}->{out_labels.replace(head, '')}"
    outs = [form(inner, x, _Index(w, i), None, **kwargs) for i in range(w.shape[0])]
    return None if any(o is None for o in outs) else jnp.stack(outs, axis=len(batch))


def _split_spec(spec: str) -> tuple[str, str, str, str]:
    """(x labels, weight labels, output labels, contracted labels) of a two-operand spec."""
    ins, out_labels = spec.replace("...", "").split("->")
    x_labels, w_labels = ins.split(",")
    return x_labels, w_labels, out_labels, "".join(c for c in w_labels if c not in out_labels)


def _einsum_groups_after(spec: str, x: jax.Array, w: QuantWeight,
                         shape: tuple[int, ...] | None, *, preferred_element_type=None
                         ) -> jax.Array | None:
    """`einsum` of a native 4-bit weight with its scale and offset applied after the dot: the
    last contraction axis split into (n, group), y = x . q batched over the n groups (and the
    other contraction axes), out = sum (y * scale) + (x summed over each group) . zero, so only
    a convert sits between the stored 4-bit values and the dot (the form XLA TPU fuses into the
    dot's operand). Only the grouped axis is reshaped (x's contraction to the weight's own
    contraction axes), never the outputs: merging a split output axis with another would make
    XLA gather the weight. None (the caller dequantizes before the dot) when the spec is not
    [.., contraction] x [contraction.., outputs..] or M > AFTER_DOT_ROWS_PER_GROUP * group
    (long prompt chunks), M the rows of x."""
    x_labels, w_labels, out_labels, contract = _split_spec(spec)
    nc = len(w.contract)
    outs = w.shape[nc:]
    if not contract or w.contract != tuple(range(nc)) \
            or not (x_labels.endswith(contract) and w_labels.startswith(contract)) \
            or out_labels != x_labels[:-len(contract)] + w_labels[len(contract):] \
            or tuple((shape or w.shape)[len(contract):]) != outs:
        return None
    batch = x.shape[:x.ndim - len(contract)]
    rows = math.prod(batch)
    if rows > AFTER_DOT_ROWS_PER_GROUP * w.group:
        return None
    *lead, last = w.shape[:nc]
    grouped = (*lead, last // w.group, w.group)
    c, o = "abcdef"[:len(lead)], "uvwxyz"[:len(outs)]
    xg = x.reshape(rows, *grouped)
    q = w.q[...].reshape(*grouped, *outs).astype(x.dtype)
    scale, zero = (getattr(w, name)[...].astype(jnp.float32) for name in ("scale", "zero"))
    y = jnp.einsum(f"m{c}ng,{c}ng{o}->m{c}n{o}", xg, q, preferred_element_type=jnp.float32)
    sums = xg.astype(jnp.float32).sum(-1)
    # q is stored less the offset: x . (q + 8) = x . q + 8 sum(x), added to the small
    # intermediate (an add on the weight-shaped scales would be a new array every step)
    y = y + NATIVE_INT4_OFFSET * sums.reshape(sums.shape + (1,) * len(outs))
    out = (jnp.einsum(f"m{c}n{o},{c}n{o}->m{o}", y, scale)
           + jnp.einsum(f"m{c}n,{c}n{o}->m{o}", sums, zero))
    return out.astype(preferred_element_type or x.dtype).reshape(*batch, *outs)


def take_rows(w, rows: jax.Array, dtype) -> jax.Array:
    """Rows `rows` of an embedding table [V, D] (float, or int8 with a scale per row or per
    group along D) in `dtype`: only the gathered rows are dequantized."""
    if not isinstance(w, QuantWeight):
        return w[...][rows].astype(dtype)
    q, scale = w.q[...][rows].astype(dtype), w.scale[...][rows].astype(dtype)
    if not w.group:
        return q * scale
    zero = w.zero[...][rows].astype(dtype)
    out = _grouped(q, q.ndim - 1, w.group) * scale[..., None] + zero[..., None]
    return out.reshape(q.shape)


# ----- XLA CPU: dequantize in cache-sized chunks -------------------------------------------------
# XLA CPU dequantizes an int8 / int4 weight to an f32 temporary before its dot; the conversions
# depend only on the parameters, so they are scheduled together and every temporary (the f32
# model's size) is mapped afresh each step: a page fault per KiB of int8 weights, which made the
# int8 step 9x the f32 one (docs/benchmarks.md, "Quantized weights", CPU). A fori_loop over output
# chunks of this many f32 bytes reuses one temporary that stays in the core's L2 and faults once;
# chunks of 2 MiB and more bring the faults back (docs/architecture.md, "Decisions").
CPU_CHUNK_BYTES = 1 << 19


def _one_cpu_device() -> bool:
    """True when the step is traced for one CPU device: no context mesh (or a one-device one)
    and the CPU backend (a context mesh's own platform when it names one, e.g. a deviceless
    TPU compile on a CPU host)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        return False
    device = None if mesh.empty else mesh.abstract_device
    platform = device.platform if device is not None else jax.default_backend()
    return platform == "cpu"


def _einsum_chunked(spec: str, x: jax.Array, w: QuantWeight, shape: tuple[int, ...] | None, *,
                    preferred_element_type=None) -> jax.Array | None:
    """`einsum` of a quantized weight as a 2-D matmul over chunks of its output columns, each
    chunk dequantized and multiplied in a fori_loop iteration (CPU_CHUNK_BYTES of f32
    temporary); per-channel int8's scale is applied to the whole output after the loop. The
    last chunk is clamped to end at the last column (it recomputes a few columns of the one
    before it, with the same values). None (the caller runs the fused form) when the spec is not
    [.., contraction] x [contraction.., outputs..] (or, per-channel int8 only, [outputs..,
    contraction]) or the weight fits one chunk."""
    x_labels, w_labels, _, contract = _split_spec(spec)
    if not contract or not x_labels.endswith(contract):
        return None
    leading = w_labels.startswith(contract)
    if not (leading or (w_labels.endswith(contract) and not w.group)):
        return None
    wshape = shape or w.shape
    k = int(np.prod(wshape[:len(contract)] if leading else wshape[-len(contract):]))
    n = int(np.prod(wshape)) // k
    size = max(1, CPU_CHUNK_BYTES // (4 * k))
    if size >= n:
        return None
    axis = 1 if leading else 0  # the output columns' axis in the 2-D fields
    fields = {name: getattr(w, name)[...].reshape((-1, n) if leading else (n, -1))
              for name in ("q", "scale", "zero") if hasattr(w, name)}
    rows = x.reshape(-1, k)
    dtype = preferred_element_type or x.dtype

    def chunk(i, out):
        start = jnp.minimum(i * size, n - size)
        part = {name: jax.lax.dynamic_slice_in_dim(a, start, size, axis=axis)
                for name, a in fields.items() if w.group or name == "q"}
        if not w.group:
            weight = part["q"].astype(x.dtype)
        else:  # [k / group, group, size]: the group's values, then scaled and offset
            g = grouped_values(part["q"], w.kind, 0, w.group, xp=jnp).astype(x.dtype)
            weight = (g * part["scale"][:, None].astype(x.dtype)
                      + part["zero"][:, None].astype(x.dtype)).reshape(k, size)
        dims = ((1,), (0,)) if leading else ((1,), (1,))
        part = jax.lax.dot_general(rows, weight, (dims, ((), ())), preferred_element_type=dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, part, start, axis=1)

    out = jax.lax.fori_loop(0, -(-n // size), chunk, jnp.zeros((rows.shape[0], n), dtype))
    if not w.group:
        out = out * fields["scale"].reshape(n).astype(dtype)
    out_dims = [d for i, d in enumerate(wshape) if w_labels[i] not in contract]
    return out.reshape(x.shape[:x.ndim - len(contract)] + tuple(out_dims))
