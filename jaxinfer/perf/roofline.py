"""Rooflines (docs/architecture.md, decision 10): the chips, this host as measured, bytes, FLOPs.

A benchmark point is reported as a fraction of its roofline: decode as bytes moved per step over
(step time x memory bandwidth), prefill as FLOPs over (time x peak FLOP/s). The byte and FLOP
counts below are models of the minimum work, stated exactly in each docstring; they are not
measured traffic (caches, re-reads and padding rows make the real traffic larger).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np

from jaxinfer.config import ModelConfig, kv_bytes_per_token

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Spec-sheet (or measured) limits of one device. FLOP/s are dense (no sparsity); None =
    not published."""

    name: str
    hbm_bytes_per_s: float
    peak_flops_bf16: float | None
    peak_flops_f32: float | None
    memory_bytes: int

    def peak_flops(self, dtype: str) -> float | None:
        return self.peak_flops_bf16 if dtype == "bfloat16" else self.peak_flops_f32


# Per-chip numbers. TPU: Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v4, /v5e,
# /v5p, /v6e): HBM capacity, HBM bandwidth, peak bf16 per chip; Google publishes no f32 peak (f32
# matmuls run as several bf16 MXU passes), hence None. NVIDIA: H100 and H200 product pages /
# datasheets (SXM form factor): bf16 Tensor Core 1,979 TFLOP/s *with sparsity* -> 989 dense;
# FP32 (non-tensor) 67 TFLOP/s (TF32 Tensor Core is 494.7 dense, used only when a matmul's
# precision allows it). Capacities: TPU pages state GiB; NVIDIA's "80GB" / "141GB" are taken as 1e9.
CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("tpu-v4", 1200e9, 275e12, None, 32 * GIB),  # 32 GiB HBM2, 1,200 GB/s, 275 TFLOP/s
    Chip("tpu-v5e", 819e9, 197e12, None, 16 * GIB),  # 16 GiB HBM2, 819 GB/s, 197 TFLOP/s
    Chip("tpu-v5p", 2765e9, 459e12, None, 95 * GIB),  # 95 GiB HBM2e, 2,765 GB/s, 459 TFLOP/s
    Chip("tpu-v6e", 1640e9, 918e12, None, 32 * GIB),  # 32 GiB HBM, 1,640 GB/s, 918 TFLOP/s
    Chip("h100-sxm", 3.35e12, 989e12, 67e12, 80 * 10**9),  # 80 GB HBM3, 3.35 TB/s
    Chip("h200", 4.8e12, 989e12, 67e12, 141 * 10**9),  # 141 GB HBM3e, 4.8 TB/s
)}

# This machine, measured by `measure_host_cpu` on a quiet 2-core host (notes/cpu_peers.md): the
# 2-core OpenBLAS GEMV read bandwidth and 4096^2 f32 GEMM rate. For quick runs that skip measuring.
NOTES_HOST_BYTES_PER_S = 24.8e9
NOTES_HOST_FLOPS_F32 = 74.2e9


def chip(name: str) -> Chip:
    if name not in CHIPS:
        raise ValueError(f"unknown chip {name!r}; known: {sorted(CHIPS)}")
    return CHIPS[name]


# ----- this host --------------------------------------------------------------------------------
def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls of fn after one untimed warm-up (fn must block)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _gemv_rates(num_bytes: int, repeats: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    cols = 4096
    a = np.full((max(1, num_bytes // (4 * cols)), cols), 0.5, np.float32)  # written: all mapped
    x = np.ones((cols,), np.float32)
    out = {"gemv_matrix_bytes": float(a.nbytes),
           "numpy_gemv_bytes_per_s": a.nbytes / _best_seconds(lambda: a @ x, repeats)}
    a_dev, x_dev = jnp.asarray(a), jnp.asarray(x)
    matvec = jax.jit(lambda m, v: m @ v)
    secs = _best_seconds(lambda: matvec(a_dev, x_dev).block_until_ready(), repeats)
    out["jax_gemv_bytes_per_s"] = a_dev.nbytes / secs
    return out


def _gemm_rates(n: int, repeats: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    m = np.full((n, n), 0.5, np.float32)
    flops = 2.0 * n**3
    out = {"gemm_n": float(n),
           "numpy_gemm_flops_per_s": flops / _best_seconds(lambda: m @ m, repeats)}
    m_dev = jnp.asarray(m)
    matmul = jax.jit(lambda p, q: jnp.matmul(p, q, precision="highest"))
    secs = _best_seconds(lambda: matmul(m_dev, m_dev).block_until_ready(), repeats)
    out["jax_gemm_flops_per_s"] = flops / secs
    return out


def measure_host_cpu(*, quick: bool = False, repeats: int | None = None,
                     gemv_bytes: int = 512 << 20, gemm_n: int = 4096) -> dict[str, float]:
    """Measures this host's memory bandwidth and f32 matmul peak, numpy and jax.

    Bandwidth = matrix bytes / time of a GEMV `a @ x` over an f32 matrix of `gemv_bytes`
    (default 512 MiB, far beyond the last-level cache; only the matrix read is counted): the access
    pattern of decode. Peak = 2 n^3 / time of an f32 n x n GEMM (n = 4096). Each is the best of
    `repeats` timed calls after a warm-up. quick=True: 16 MiB and n = 512, for tests only (the
    matrix then partly fits in cache, so the numbers mean nothing).

    Returns a dict: numpy_/jax_ gemv_bytes_per_s and gemm_flops_per_s, and the roofline values
    `hbm_bytes_per_s` and `peak_flops_f32` (the max of numpy and jax for each), plus the sizes.
    """
    if quick:
        gemv_bytes, gemm_n = 16 << 20, 512
    repeats = repeats or (2 if quick else 5)
    out = _gemv_rates(gemv_bytes, repeats) | _gemm_rates(gemm_n, max(1, repeats - 2))
    out["hbm_bytes_per_s"] = max(out["numpy_gemv_bytes_per_s"], out["jax_gemv_bytes_per_s"])
    out["peak_flops_f32"] = max(out["numpy_gemm_flops_per_s"], out["jax_gemm_flops_per_s"])
    return out


def host_chip(measured: dict[str, float]) -> Chip:
    """A Chip for this host from `measure_host_cpu` output. The CPU has no native bf16 (XLA
    converts to f32 and uses the same FMA units), so the bf16 peak is the f32 one."""
    import os

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Chip("host-cpu", measured["hbm_bytes_per_s"], measured["peak_flops_f32"],
                measured["peak_flops_f32"], int(mem))


# ----- bytes and FLOPs per step -----------------------------------------------------------------
def matmul_params(config: ModelConfig) -> int:
    """Weights that take part in one token's matmuls, without the embedding / LM head: per layer
    q, k, v, o (D*H*(N + 2K) + N*H*D) and gate, up, down (3*D*F); a mixture layer's router
    (D*E), its token's k experts (3*D*F_e each) and shared expert (3*D*F_s + D). Norms and
    biases excluded."""
    d, h = config.embed_dim, config.head_dim
    attn = d * h * (config.num_q_heads + 2 * config.num_kv_heads) + config.num_q_heads * h * d
    return sum(attn + _mlp_matmul_params(config, i) for i in range(config.num_layers))


def _mlp_matmul_params(config: ModelConfig, layer: int) -> int:
    c, d = config, config.embed_dim
    if not c.is_moe(layer):
        return 3 * d * c.ffn_dim
    shared = 3 * d * c.shared_expert_ffn_dim + d if c.shared_expert_ffn_dim else 0
    return d * c.num_experts + 3 * d * c.moe_ffn_dim * c.experts_per_token + shared


def weight_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """All parameters (`config.num_params()`: a tied embedding counted once, as the LM head;
    norms and biases included) at `dtype_bytes` each."""
    return config.num_params() * dtype_bytes


def decode_step_bytes(config: ModelConfig, batch: int, kv_tokens_read: float, dtype_bytes: int,
                      cache_dtype_bytes: int) -> float:
    """Bytes one decode step must move between memory and the chip.

    = every weight once (`weight_bytes`; the embedding-row gather of B tokens is negligible and
      not counted)
    + KV read: 2 * L * K * H * kv_tokens_read * batch * cache_dtype_bytes, where kv_tokens_read is
      the number of cached positions each row's attention reads (the page-bucketed span for a
      paged kernel, the live length for an ideal one)
    + KV written: the new token's K and V for every row, 2 * L * K * H * batch * cache bytes.
    Activations and logits are not counted (they stay in cache at these sizes).
    """
    return stored_decode_step_bytes(weight_bytes(config, dtype_bytes),
                                    kv_bytes_per_token(config, cache_dtype_bytes), batch,
                                    kv_tokens_read)


def stored_decode_step_bytes(weights: float, kv_token_bytes: float, batch: int,
                             kv_tokens_read: float) -> float:
    """`decode_step_bytes` from the bytes as stored: `weights` (all parameter arrays, e.g. int8
    or int4 values with their scales) and `kv_token_bytes` (one token's K and V over all layers,
    an int8 pool's scales included): weights + KV read + KV written."""
    return weights + kv_token_bytes * kv_tokens_read * batch + kv_token_bytes * batch


def prefill_flops(config: ModelConfig, prompt_len: int) -> float:
    """FLOPs of a one-chunk causal prefill of T = prompt_len tokens for one sequence.

    = 2 * matmul_params * T (projections and MLP of every token)
    + 2 * D * V (LM head for the last position only)
    + attention: 4 * L * N * H * T^2 / 2 (QK^T and PV, 2 FLOPs per multiply-add each, half the
      T x T score matrix under the causal mask).
    Norms, RoPE, softmax and activations are not counted.
    """
    c, t = config, prompt_len
    attn = 4 * c.num_layers * c.num_q_heads * c.head_dim * t * t / 2
    return 2 * matmul_params(c) * t + 2 * c.embed_dim * c.vocab_size + attn


def decode_step_flops(config: ModelConfig, batch: int, kv_len: float) -> float:
    """FLOPs of one decode step: B rows of one token each.

    = 2 * (matmul_params + D * V) * B (projections, MLP and LM head of every row)
    + attention: 4 * L * N * H * kv_len * B (QK^T and PV over the kv_len positions each row
      attends to; pass the span actually computed, e.g. the page-bucketed span).
    """
    c = config
    dense = 2 * (matmul_params(c) + c.embed_dim * c.vocab_size) * batch
    return dense + 4 * c.num_layers * c.num_q_heads * c.head_dim * kv_len * batch


def speculative_speedup(config: ModelConfig, chip: Chip, *, tokens_per_verification: float,
                        num_spec: int, draft_step_bytes: float, batch: int = 1,
                        kv_len: float = 1024, dtype_bytes: int = 2) -> float:
    """Decode speed with speculation over decode without it, on `chip`'s roofline, for a
    target of `config` (weights and KV at `dtype_bytes`) with B = `batch` sequences at
    `kv_len` cached positions each.

    Without: a step of B rows takes t(1) and emits B tokens. With R = num_spec drafts: R draft
    steps of `draft_step_bytes` each (bandwidth-bound: a head's or drafter's weights read per
    drafted token; 0 for host drafts such as n-gram lookup), then one verification step of
    B(R + 1) rows that takes t(R + 1) and emits L = tokens_per_verification tokens per
    sequence, so speedup = L t(1) / (t(R + 1) + R draft_step_bytes / bandwidth).
    t(m) = max(bytes / bandwidth, FLOPs / peak), bytes = `stored_decode_step_bytes` with each
    sequence's context read once (its m rows share it) and m tokens' K/V written per sequence,
    FLOPs = `decode_step_flops` over B m rows.
    """
    peak = chip.peak_flops("bfloat16" if dtype_bytes == 2 else "float32")
    kv_token = kv_bytes_per_token(config, dtype_bytes)
    weights = weight_bytes(config, dtype_bytes)

    def step_seconds(rows_per_seq: int) -> float:
        num_bytes = (stored_decode_step_bytes(weights, kv_token, batch, kv_len)
                     + kv_token * batch * (rows_per_seq - 1))
        flops = decode_step_flops(config, batch * rows_per_seq, kv_len)
        return max(num_bytes / chip.hbm_bytes_per_s, flops / peak if peak else 0.0)

    drafting = num_spec * draft_step_bytes / chip.hbm_bytes_per_s
    return tokens_per_verification * step_seconds(1) / (step_seconds(num_spec + 1) + drafting)


def fraction(value: float | None, roof: float | None) -> float | None:
    """value / roof, or None when either is missing or the roof is not positive."""
    if value is None or roof is None or roof <= 0 or not math.isfinite(value):
        return None
    return value / roof


def bandwidth_fraction(num_bytes: float, seconds: float, bytes_per_s: float) -> float | None:
    """Achieved bandwidth (num_bytes / seconds) as a fraction of `bytes_per_s`."""
    return fraction(num_bytes / seconds, bytes_per_s) if seconds > 0 else None


def flops_fraction(flops: float, seconds: float, peak: float | None) -> float | None:
    """Achieved FLOP/s (flops / seconds) as a fraction of `peak`."""
    return fraction(flops / seconds, peak) if seconds > 0 else None
