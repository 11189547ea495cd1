"""Vectorized numpy dequantizers for the GGML tensor types a Llama-family GGUF usually holds.

Block layouts follow ggml (`ggml-common.h` / `ggml-quants.c`); each `_dequant_*` takes
`u8[n, type_size]` (one row per block) and returns `f32[n, block_size]`, computed in the same float
order as ggml so the result is bit-identical to `gguf.quants.dequantize`. No Python loop runs over
blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
QK_K = 256  # super-block size of the K-quants
_NIBBLES = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)  # low nibble first, then high


def _f16(raw: np.ndarray) -> np.ndarray:
    """u8[n, 2] -> f32[n, 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """u8[n, c*width] -> u8[n, c, 2, width]: low nibbles of each run of `width` bytes, then high."""
    return (qs.reshape(qs.shape[0], -1, 1, width) >> _NIBBLES) & np.uint8(0x0F)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """u8[n, 4] (little-endian u32) -> u8[n, count]: bit j of the u32 at column j."""
    word = np.ascontiguousarray(packed).view("<u4")
    return ((word >> np.arange(count, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0: f16 d, i8 q[32]; x = q * d."""
    d = _f16(blocks[:, :2])
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)
    return q * d


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0: f16 d, u8 qs[16]; element j is the low nibble of qs[j], j+16 the high; x = d*(q-8)."""
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:], 16).reshape(len(blocks), 32).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1: f16 d, f16 m, u8 qs[16]; x = d*q + m."""
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:], 16).reshape(len(blocks), 32).astype(np.float32)
    return d * q + m


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """u8 qh[n, 4], qs[n, 16] -> u8[n, 32] 5-bit values;
    bit j of qh is the 5th bit of element j."""
    low = _nibbles(qs, 16).reshape(len(qs), 32)
    return low | (_bits(qh, 32) << np.uint8(4))


def _dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0: f16 d, u32 qh, u8 qs[16]; x = d*(q-16)."""
    d = _f16(blocks[:, :2])
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:]).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _dequant_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1: f16 d, f16 m, u32 qh, u8 qs[16]; x = d*q + m."""
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _q5_values(blocks[:, 4:8], blocks[:, 8:]).astype(np.float32)
    return d * q + m


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K packed 6-bit scales u8[n, 12] -> (scale f32[n, 8, 1], min f32[n, 8, 1]).

    ggml `get_scale_min_k4`: sub-blocks 0..3 use the low 6 bits of bytes 0..3 (scale) and 4..7
    (min); sub-blocks 4..7 take their low 4 bits from bytes 8..11 and their top 2 bits from
    bytes 0..7.
    """
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32)[..., None], mn.astype(np.float32)[..., None]


def _dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K: f16 d, f16 dmin, u8 scales[12], u8 qs[128]; 8 sub-blocks of 32: x = d*sc*q - dmin*m.

    Each run of 32 qs bytes holds sub-block 2c in its low nibbles and 2c+1 in its high nibbles.
    """
    n = len(blocks)
    d, dmin = _f16(blocks[:, :2])[..., None], _f16(blocks[:, 2:4])[..., None]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32).astype(np.float32)
    return ((d * sc) * q - dmin * mn).reshape(n, QK_K)


def _dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K: like Q4_K plus u8 qh[32] after the scales; bit u of qh[l] = 5th bit of sub-block u."""
    n = len(blocks)
    d, dmin = _f16(blocks[:, :2])[..., None], _f16(blocks[:, 2:4])[..., None]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    low = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    q = (low | ((qh & np.uint8(1)) << np.uint8(4))).astype(np.float32)
    return ((d * sc) * q - dmin * mn).reshape(n, QK_K)


def _dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: u8 ql[128], u8 qh[64], i8 scales[16], f16 d; x = d*scale[j//16]*(q-32).

    Per half h (128 elements): element nib*64 + r*32 + l takes nibble `nib` of ql[64h + 32r + l]
    and 2 bits (shift 2*(2*nib + r)) of qh[32h + l].
    """
    n = len(blocks)
    nibble_shifts = np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)
    ql = blocks[:, :128].reshape(n, 2, 1, 2, 32) >> nibble_shifts
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts).reshape(n, 2, 2, 2, 32)
    q = ((ql & np.uint8(0x0F)) | ((qh & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    return ((d * scales)[..., None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


_BLOCK_DEQUANT: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q8_0: _dequant_q8_0,
    Q.Q4_0: _dequant_q4_0,
    Q.Q4_1: _dequant_q4_1,
    Q.Q5_0: _dequant_q5_0,
    Q.Q5_1: _dequant_q5_1,
    Q.Q4_K: _dequant_q4_k,
    Q.Q5_K: _dequant_q5_k,
    Q.Q6_K: _dequant_q6_k,
}
_FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: None}
SUPPORTED_TYPES: tuple[Q, ...] = (*_FLOAT_TYPES, *_BLOCK_DEQUANT)
_CHUNK_BLOCKS = 1 << 16  # bounds the temporaries of one vectorized step to tens of MiB


def _floats(raw: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.BF16:
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)
    dtype = _FLOAT_TYPES[qtype]
    if raw.dtype == np.uint8:
        raw = np.ascontiguousarray(raw).view(dtype)
    return raw.astype(np.float32)


def dequantize(raw: np.ndarray, qtype: Q | int, shape: Sequence[int]) -> np.ndarray:
    """Dequantize one GGML tensor.

    Args:
      raw: the tensor's bytes, u8[..., row_bytes] (as `gguf.GGUFReader` gives quantized data) or an
        already typed f32/f16 array for float types.
      qtype: the GGML type.
      shape: numpy (row-major) shape of the result; its last axis is the GGML row (`ne[0]`).
    Returns:
      f32[*shape], a fresh array.
    Raises:
      ValueError: unsupported type, or a byte count that does not match `shape`.
    """
    qtype = Q(qtype)
    shape = tuple(int(s) for s in shape)
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"unsupported GGML tensor type {qtype.name}; supported: {names}")
    size = int(np.prod(shape, dtype=np.int64))
    if qtype in _FLOAT_TYPES:
        out = _floats(raw.reshape(-1), qtype)
        if out.size != size:
            raise ValueError(f"{qtype.name} data has {out.size} elements, expected {shape}")
        return out.reshape(shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if size % block_size or (shape and shape[-1] % block_size):
        raise ValueError(f"{qtype.name} shape {shape} is not a multiple of block {block_size}")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    num_blocks = size // block_size
    if blocks.size != num_blocks * type_size:
        raise ValueError(f"{qtype.name} data has {blocks.size} bytes, expected "
                         f"{num_blocks * type_size} for shape {shape}")
    blocks = blocks.reshape(num_blocks, type_size)
    out = np.empty((num_blocks, block_size), np.float32)
    fn = _BLOCK_DEQUANT[qtype]
    for start in range(0, num_blocks, _CHUNK_BLOCKS):
        out[start:start + _CHUNK_BLOCKS] = fn(blocks[start:start + _CHUNK_BLOCKS])
    return out.reshape(shape)
