"""Quantized loading: checkpoint tensors -> int8 / int4 `quant.QTensor`s, one tensor at a time.

A quantized load never holds the model in f32: each matrix goes from the file to its quantized
form in chunks of rows (at most CHUNK_ELEMENTS floats alive at once), in its Hugging Face layout
`[out, in]` (contraction axis 1); `weights.from_hf_tensors` then transposes the stored integers.

- GGUF: a chunk of rows is decoded from its blocks (`quants.dequantize`, bit-identical to
  gguf-py) and requantized round-to-nearest per output row (int8) or per group (int4). To int4
  with groups of 32, Q4_0, Q4_1 and Q4_K blocks convert exactly instead: their 4-bit values are
  kept and their block (sub-block) scale and offset become the group's (Q4_0: d, -8 d; Q4_1:
  d, m; Q4_K: d * sc, -(dmin * m)), so the int4 model computes with the file's own weights.
- Hugging Face safetensors: the memory-mapped rows are read in chunks, widened to f32 and
  quantized round-to-nearest.

The embedding and LM head are int8 whenever the layers are quantized (`quant` module doc).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxinfer.checkpoint import quants
from jaxinfer.model import quant

Q = GGMLQuantizationType
CHUNK_ELEMENTS = 1 << 22  # floats decoded at once (16 MiB of f32)
TABLES = ("model.embed_tokens.weight", "lm_head.weight")  # int8 whenever quantized
_EXACT_INT4 = (Q.Q4_0, Q.Q4_1, Q.Q4_K)  # 4-bit blocks of 32 that are int4 groups as stored


def kind_for(hf_name: str, weight_kind: str) -> str:
    """Storage of the matrix `hf_name` in a model of `weight_kind` weights."""
    return "int8" if hf_name in TABLES else weight_kind


def _rows_chunks(num_rows: int, row_len: int):
    step = max(1, CHUNK_ELEMENTS // max(row_len, 1))
    for start in range(0, num_rows, step):
        yield slice(start, min(start + step, num_rows))


def _concat(parts: list[quant.QTensor], shape: tuple[int, ...]) -> quant.QTensor:
    """Row chunks (axis 0) of one [out, in] QTensor, joined."""
    fields = {k: np.concatenate([p.fields()[k] for p in parts]) for k in parts[0].fields()}
    first = parts[0]
    return quant.QTensor(q=fields["q"], scale=fields["scale"], zero=fields.get("zero"),
                         shape=shape, contract=first.contract, kind=first.kind,
                         group=first.group)


def quantize_rows(read_rows, shape: tuple[int, ...], kind: str, group: int) -> quant.QTensor:
    """Round-to-nearest quantization of a matrix [out, in] over its input axis, `read_rows(sl)`
    giving f32 rows `sl` (the only floats alive at a time)."""
    parts = [quant.quantize(read_rows(sl), (1,), kind, group)
             for sl in _rows_chunks(shape[0], shape[1])]
    return _concat(parts, shape)


def from_array(a: np.ndarray, kind: str, group: int) -> quant.QTensor:
    """A float matrix [out, in] (e.g. a memory-mapped safetensors tensor) quantized by rows."""
    return quantize_rows(lambda sl: np.asarray(a[sl], np.float32), tuple(a.shape), kind, group)


def from_gguf(raw: np.ndarray, qtype: Q | int, shape: tuple[int, ...], kind: str,
              group: int) -> quant.QTensor:
    """One GGUF matrix (its bytes `raw`, numpy shape `shape` = [out, in]) -> QTensor [out, in].

    Raises ValueError naming the type for a type we cannot decode."""
    qtype = Q(qtype)
    if qtype not in quants.SUPPORTED_TYPES:
        names = ", ".join(t.name for t in quants.SUPPORTED_TYPES)
        raise ValueError(f"unsupported GGML tensor type {qtype.name}; supported: {names}")
    rows = np.ascontiguousarray(raw).reshape(shape[0], -1)
    if kind == "int4" and group == 32 and qtype in _EXACT_INT4:
        return _exact_int4(rows, qtype, shape)
    return quantize_rows(lambda sl: quants.dequantize(rows[sl], qtype, (sl.stop - sl.start,
                                                                        shape[1])),
                         shape, kind, group)


def _exact_int4(rows: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> quant.QTensor:
    """Q4_0 / Q4_1 / Q4_K rows u8[out, row_bytes] -> int4 groups of 32, values kept."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    parts = []
    for sl in _rows_chunks(shape[0], shape[1]):
        blocks = rows[sl].reshape(-1, type_size)
        q, scale, zero = _INT4_BLOCKS[qtype](blocks)  # u8[n, 32], f32[n], f32[n]
        n_rows = sl.stop - sl.start
        parts.append(quant.QTensor(
            q=quant.pack_int4(q.reshape(n_rows, shape[1]), 1, 32),
            scale=scale.reshape(n_rows, -1), zero=zero.reshape(n_rows, -1),
            shape=(n_rows, shape[1]), contract=(1,), kind="int4", group=32))
    return _concat(parts, shape)


def _q4_0_groups(blocks):
    d = quants._f16(blocks[:, :2])[:, 0]
    q = quants._nibbles(blocks[:, 2:], 16).reshape(len(blocks), 32)
    return q, d, d * np.float32(-8)


def _q4_1_groups(blocks):
    d, m = quants._f16(blocks[:, :2])[:, 0], quants._f16(blocks[:, 2:4])[:, 0]
    return quants._nibbles(blocks[:, 4:], 16).reshape(len(blocks), 32), d, m


def _q4_k_groups(blocks):
    n = len(blocks)
    d, dmin = quants._f16(blocks[:, :2])[..., None], quants._f16(blocks[:, 2:4])[..., None]
    sc, mn = quants._k_scale_min(blocks[:, 4:16])  # f32[n, 8, 1]
    q = quants._nibbles(blocks[:, 16:], 32).reshape(n * 8, 32)
    return q, (d * sc).reshape(-1), (-(dmin * mn)).reshape(-1)


_INT4_BLOCKS = {Q.Q4_0: _q4_0_groups, Q.Q4_1: _q4_1_groups, Q.Q4_K: _q4_k_groups}
