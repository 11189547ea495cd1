"""Roofline byte/FLOP counts checked against numbers worked out by hand (notes/cpu_peers.md)."""

import math

import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.perf import roofline

# SmolLM2-135M-Instruct (the embedded default): 30 layers, D 576, 9/3 heads, H 64, F 1536.
SMOLLM2 = ModelConfig(vocab_size=49152, embed_dim=576, num_layers=30, num_q_heads=9,
                      num_kv_heads=3, head_dim=64, ffn_dim=1536, tie_embeddings=True)

# By hand: per layer q,k,v,o = 4*2*(2+2) + 2*2*4 = 48, MLP 3*4*8 = 96 -> 144; 2 layers -> 288.
# num_params = 2 * (144 + 2 norms * 4) + embed 10*4 + final norm 4 = 348 (tied: no LM head).
TINY = ModelConfig(vocab_size=10, embed_dim=4, num_layers=2, num_q_heads=2, num_kv_heads=1,
                   head_dim=2, ffn_dim=8, tie_embeddings=True)


def test_smollm2_weight_bytes_match_notes():
    # 134.5 M params, tied embedding once: 538.1 MB in f32, 269.0 MB in bf16.
    assert SMOLLM2.num_params() == 134_515_008
    assert roofline.weight_bytes(SMOLLM2, 4) == 538_060_032
    assert roofline.weight_bytes(SMOLLM2, 2) == 269_030_016
    # Non-embedding matmul weights: 30 * (576*64*15 + 9*64*576 + 3*576*1536).
    assert roofline.matmul_params(SMOLLM2) == 30 * (552_960 + 331_776 + 2_654_208)


def test_smollm2_kv_bytes_match_notes():
    # 2 * 30 layers * 3 kv heads * 64 * 4 bytes = 46,080 B per token; the notes' b=1 "full"
    # 256-position read is 11.8 MB and b=64 is 755 MB.
    assert roofline.kv_bytes_per_token(SMOLLM2, 4) == 46_080
    b1 = roofline.decode_step_bytes(SMOLLM2, 1, 256, 4, 4)
    assert b1 == 538_060_032 + 46_080 * 256 + 46_080
    b64 = roofline.decode_step_bytes(SMOLLM2, 64, 256, 4, 4)
    assert b64 - 538_060_032 == 46_080 * 257 * 64  # 755 MB read + 2.9 MB written
    # Weights alone at the notes' 24.8 GB/s: 21.7 ms per step.
    assert roofline.weight_bytes(SMOLLM2, 4) / 24.8e9 == pytest.approx(21.7e-3, abs=0.05e-3)


def test_smollm2_flops():
    # Decode: 2 * (106,168,320 + 576 * 49152) = 0.269 GFLOP per token (the notes' compute cap).
    assert roofline.decode_step_flops(SMOLLM2, 1, 0) == 268_959_744
    # Prefill 512: 2*106,168,320*512 + 2*576*49152 + 4*30*9*64*512^2/2.
    assert roofline.prefill_flops(SMOLLM2, 512) == (108_716_359_680 + 56_623_104
                                                    + 9_059_696_640)


def test_tiny_config_by_hand():
    assert roofline.matmul_params(TINY) == 288
    assert TINY.num_params() == 348
    # KV per token: 2 * 2 layers * 1 head * 2 * 4 B = 32; batch 3, 5 tokens read each:
    # weights 1392 + read 32*5*3 = 480 + written 32*3 = 96.
    assert roofline.decode_step_bytes(TINY, 3, 5, 4, 4) == 1392 + 480 + 96
    assert roofline.decode_step_bytes(TINY, 3, 5, 2, 2) == 696 + 240 + 48
    # Prefill T=4: 2*288*4 = 2304, LM head 2*4*10 = 80, attention 4*2*2*2*16/2 = 256.
    assert roofline.prefill_flops(TINY, 4) == 2304 + 80 + 256
    # Decode B=3, kv_len 5: 2*(288 + 40)*3 = 1968, attention 4*2*2*2*5*3 = 480.
    assert roofline.decode_step_flops(TINY, 3, 5) == 1968 + 480


def test_speculative_speedup_by_hand():
    # TINY in f32, one sequence at 5 cached positions, on a chip of 1,000 B/s and 10 FLOP/s:
    # t(1) = max(1392 + 32*5 + 32 B -> 1.584 s, (656 + 160) FLOPs -> 81.6 s) = 81.6 s (compute
    # bound); t(3) = max(1.648 s, (1968 + 480) FLOPs -> 244.8 s) = 244.8 s; two draft steps of
    # 500 B: 1 s. L = 2.5: 2.5 * 81.6 / (244.8 + 1).
    chip = roofline.Chip("hand", 1000.0, None, 10.0, 1 << 30)
    got = roofline.speculative_speedup(TINY, chip, tokens_per_verification=2.5, num_spec=2,
                                       draft_step_bytes=500, kv_len=5, dtype_bytes=4)
    assert got == pytest.approx(2.5 * 81.6 / (244.8 + 1.0))
    # Bandwidth-bound (no FLOP limit): t(1) = 1.584 s, t(3) = 1.584 + 2 * 0.032 = 1.648 s.
    fast = roofline.Chip("hand", 1000.0, None, None, 1 << 30)
    got = roofline.speculative_speedup(TINY, fast, tokens_per_verification=2.5, num_spec=2,
                                       draft_step_bytes=500, kv_len=5, dtype_bytes=4)
    assert got == pytest.approx(2.5 * 1.584 / (1.648 + 1.0))
    # Free drafts that are all accepted on a bandwidth-bound chip: nearly R + 1.
    assert roofline.speculative_speedup(
        SMOLLM2, roofline.chip("tpu-v5e"), tokens_per_verification=5, num_spec=4,
        draft_step_bytes=0) == pytest.approx(5, rel=0.01)


def test_fraction_helpers():
    assert roofline.fraction(2.0, 4.0) == 0.5
    assert roofline.fraction(1.0, None) is None
    assert roofline.fraction(1.0, 0.0) is None
    assert roofline.bandwidth_fraction(10e9, 1.0, 20e9) == 0.5
    assert roofline.flops_fraction(1e9, 0.5, 4e9) == 0.5
    assert roofline.flops_fraction(1e9, 0.5, None) is None


def test_chip_table():
    h200 = roofline.chip("h200")
    assert h200.hbm_bytes_per_s == 4.8e12 and h200.peak_flops("bfloat16") == 989e12
    assert roofline.chip("tpu-v5e").peak_flops("float32") is None
    assert set(roofline.CHIPS) == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "h100-sxm", "h200"}
    with pytest.raises(ValueError, match="unknown chip"):
        roofline.chip("tpu-v9")


def test_measure_host_cpu_quick():
    m = roofline.measure_host_cpu(quick=True)
    for key in ("numpy_gemv_bytes_per_s", "jax_gemv_bytes_per_s", "numpy_gemm_flops_per_s",
                "jax_gemm_flops_per_s", "hbm_bytes_per_s", "peak_flops_f32"):
        assert math.isfinite(m[key]) and m[key] > 0, key
    assert m["hbm_bytes_per_s"] == max(m["numpy_gemv_bytes_per_s"], m["jax_gemv_bytes_per_s"])
    host = roofline.host_chip(m)
    assert host.peak_flops("bfloat16") == host.peak_flops("float32") > 0
