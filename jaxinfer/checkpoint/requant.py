"""Quantized loading: checkpoint tensors -> int8 / int4 `quant.QTensor`s, one tensor at a time.

A quantized load never holds the model in f32: each matrix goes from the file to its quantized
form in chunks of rows (at most CHUNK_ELEMENTS floats alive at once), in its Hugging Face layout
`[out, in]` (contraction axis 1); `weights.from_hf_tensors` then transposes the stored integers.

- GGUF: int8 is grouped (`int8_group_size`: groups of 32, the GGML block). Blocks of 32 whose
  values fit the target convert exactly: their integers are kept and their block (sub-block)
  scale and offset become the group's (Q4_0: d, -8 d; Q4_1: d, m; Q4_K: d * sc, -(dmin * m);
  for int8 also Q5_0: d, -16 d; Q5_1: d, m; Q8_0: q + 128 with d, -128 d), so the model
  computes with the file's own weights. Every other type (Q6_K, a float tensor, or int4 from
  Q8_0) is decoded a chunk of rows at a time (`quants.dequantize`, bit-identical to gguf-py)
  and requantized round-to-nearest per group.
- Hugging Face safetensors: the memory-mapped rows are read in chunks, widened to f32 and
  quantized round-to-nearest; int8 per output channel (1 byte per weight).

The embedding and LM head are int8 whenever the layers are quantized (`quant` module doc).

int4 from a GGUF keeps the file's own mix: a GGUF quantized to 4 bits (Q4_K_M, Q4_K_S, Q4_0,
Q4_1) stores some matrices wider on purpose (Q4_K_M: attn_v and ffn_down at Q6_K in half the
layers; Q5_0 where a row is not a multiple of Q4_K's 256), because 4 bits cost those matrices
the most accuracy. Rounding them to 4 bits again costs that accuracy (Gemma 3 270M: KL 1.24
against the f32 model). So a matrix that such a file stores above 4 bits in any layer is int8
in every layer (`int8_matrices`; one kind per stored matrix, fused q/k/v and gate/up alike,
so the layers stack), its Q5_x/Q8_0 blocks kept exactly; the 4-bit blocks stay int4, exactly.
A file without 4-bit layer matrices (Q8_0, F16) has no mix to keep: int4 rounds all of it.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxinfer.checkpoint import quants
from jaxinfer.config import MATRICES
from jaxinfer.model import quant

Q = GGMLQuantizationType
CHUNK_ELEMENTS = 1 << 22  # floats decoded at once (16 MiB of f32)
GGUF_GROUP = 32  # the GGML block (and K-quant sub-block) length


def int8_matrices(types: dict[str, Q | int], stored_in: dict[str, str]) -> tuple[str, ...]:
    """The stored matrices an int4 load of a GGUF keeps int8 (module doc): given the GGML type
    of each layer matrix (`types`, by tensor name) and the stored matrix each is part of
    (`stored_in`, by the same names), those with a type wider than 4 bits in any layer, if the
    file holds 4-bit layer matrices at all; else ()."""
    four_bit = set(_EXACT["int4"])
    if not any(Q(t) in four_bit for t in types.values()):
        return ()
    wider = {stored_in[name] for name, t in types.items() if Q(t) not in four_bit}
    return tuple(m for m in MATRICES if m in wider)


def int8_group_size(source_format: str) -> int:
    """The int8 layout of a quantized load from a checkpoint of `source_format`: groups of 32
    for a GGUF (its blocks convert exactly), per output channel (0) for anything else."""
    return GGUF_GROUP if source_format == "gguf" else 0


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
    if group == GGUF_GROUP and qtype in _EXACT[kind]:
        return _exact_groups(rows, qtype, shape, kind)
    return quantize_rows(lambda sl: quants.dequantize(rows[sl], qtype, (sl.stop - sl.start,
                                                                        shape[1])),
                         shape, kind, group)


def _exact_groups(rows: np.ndarray, qtype: Q, shape: tuple[int, ...], kind: str
                  ) -> quant.QTensor:
    """Rows u8[out, row_bytes] of a type in `_EXACT[kind]` -> groups of 32, values kept."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    parts = []
    for sl in _rows_chunks(shape[0], shape[1]):
        blocks = rows[sl].reshape(-1, type_size)
        q, scale, zero = _GROUPS[qtype](blocks)  # u8[n, 32], f32[n], f32[n]
        n_rows = sl.stop - sl.start
        q = q.reshape(n_rows, shape[1])
        parts.append(quant.QTensor(
            q=quant.pack_int4(q, 1, GGUF_GROUP) if kind == "int4" else q,
            scale=scale.reshape(n_rows, -1), zero=zero.reshape(n_rows, -1),
            shape=(n_rows, shape[1]), contract=(1,), kind=kind, group=GGUF_GROUP))
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


def _q5_0_groups(blocks):
    d = quants._f16(blocks[:, :2])[:, 0]
    return quants._q5_values(blocks[:, 2:6], blocks[:, 6:]), d, d * np.float32(-16)


def _q5_1_groups(blocks):
    d, m = quants._f16(blocks[:, :2])[:, 0], quants._f16(blocks[:, 2:4])[:, 0]
    return quants._q5_values(blocks[:, 4:8], blocks[:, 8:]), d, m


def _q8_0_groups(blocks):
    """q + 128 in u8; (q + 128) d - 128 d is q d exactly (both products and the result fit
    f32's 24 bits: an 8-bit integer times an f16 scale)."""
    d = quants._f16(blocks[:, :2])[:, 0]
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.int16) + 128
    return q.astype(np.uint8), d, d * np.float32(-128)


_GROUPS = {Q.Q4_0: _q4_0_groups, Q.Q4_1: _q4_1_groups, Q.Q4_K: _q4_k_groups,
           Q.Q5_0: _q5_0_groups, Q.Q5_1: _q5_1_groups, Q.Q8_0: _q8_0_groups}
# The block types whose integers fit each target as stored (the 4-bit ones also fit int8).
_EXACT = {"int4": (Q.Q4_0, Q.Q4_1, Q.Q4_K), "int8": tuple(_GROUPS)}
