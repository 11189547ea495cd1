"""Our dequantizers vs gguf-py's reference (written by the llama.cpp authors): bit-identical."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as ref

from jaxinfer.checkpoint import quants

Q = GGMLQuantizationType
# Byte offsets of the f16 scale fields (d, dmin/m) inside one block, per type.
_F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}


def _random_blocks(qtype, rows: int, blocks_per_row: int, rng) -> np.ndarray:
    """u8[rows, blocks_per_row * type_size] of random blocks with finite, small f16 scales."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        scale = rng.uniform(-0.1, 0.1, size=rows * blocks_per_row).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(_F16_FIELDS), ids=lambda t: t.name)
def test_block_types_match_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = _random_blocks(qtype, rows=7, blocks_per_row=3, rng=rng)
    want = ref.dequantize(raw, qtype)
    got = quants.dequantize(raw, qtype, (7, 3 * block_size))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_float_types_match_reference(qtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    raw = ref.quantize(x, qtype) if qtype != Q.F32 else x
    want = ref.dequantize(raw if qtype != Q.BF16 else raw.view(np.uint8), qtype)
    got = quants.dequantize(raw, qtype, (5, 64))
    np.testing.assert_array_equal(got, want.astype(np.float32).reshape(5, 64))
    bytes_got = quants.dequantize(np.ascontiguousarray(raw).view(np.uint8), qtype, (5, 64))
    np.testing.assert_array_equal(bytes_got, got)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_quantize_roundtrip(qtype):
    x = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    got = quants.dequantize(ref.quantize(x, qtype), qtype, x.shape)
    step = {Q.Q4_0: 2 / 8, Q.Q4_1: 2 / 15, Q.Q8_0: 1 / 127}[qtype]  # relative quantization step
    tol = step * np.abs(x).reshape(4, -1, 32).max(-1, keepdims=True)
    assert np.all(np.abs(got - x).reshape(4, -1, 32) <= tol)


def test_large_tensor_is_chunked_consistently():
    rng = np.random.default_rng(2)
    raw = _random_blocks(Q.Q8_0, rows=(1 << 16) // 4 + 3, blocks_per_row=8, rng=rng)
    got = quants.dequantize(raw, Q.Q8_0, (raw.shape[0], 256))
    np.testing.assert_array_equal(got, ref.dequantize(raw, Q.Q8_0))


def test_unsupported_type_names_it():
    with pytest.raises(ValueError, match=r"IQ2_XXS.*supported: F32.*Q6_K"):
        quants.dequantize(np.zeros(66, np.uint8), Q.IQ2_XXS, (256,))


def test_wrong_byte_count():
    with pytest.raises(ValueError, match="Q8_0 data has 33 bytes"):
        quants.dequantize(np.zeros(33, np.uint8), Q.Q8_0, (32,))
