"""Capacity planner: will a model fit on N chips, how many slots, and how fast (a roofline guess).

Everything is per chip, for one tensor-parallel group of M chips (the mesh's `model` axis, or
on an expert mesh "data:D,expert:E,model:M'" its E x M' chips, written M below); a `data` axis
of D replicas (D x M = num_chips) holds D copies of the weights and splits the slots,
ceil(max_slots / D) rows per replica. `mesh="auto"` is D = 1, M = num_chips.

Assumptions (each is a choice, not a measurement):

Sharding (tensor parallelism over M, as jax-llm-examples' llama3 does it):
- Query heads N, kv heads K, FFN F and vocab V are split over M; a chip holds ceil(N/M), ceil(K/M),
  ceil(F/M), ceil(V/M) of them. When M > K each kv head (its k/v projection and its KV cache) is
  replicated M/K times, so a chip holds one; when M does not divide K the fullest chip decides.
  The same holds for N < M. Norms are replicated. Embedding and LM head split over V.
- Float weights are stored at their dtype's size. Quantized weights (`jaxinfer.model.quant`)
  are counted as stored: int8 per output channel 1 byte per weight + an f32 scale per output
  column; int8 in groups (`int8_group`, a GGUF's 32) 1 byte + an f32 scale and offset per group
  (1.25 bytes at 32); int4 half a byte + an f32 scale and offset per group (`int4_group`:
  0.5625 bytes at 128, 0.75 at 32; the o projection's groups stay within a head), except
  with int4 the matrices of `int8_matrices` (a GGUF's 4-bit mix keeps some int8: a Q4_K_M of
  Gemma 3 its qkv, gate_up and down; `jaxinfer.checkpoint.requant`), int8. Their
  embedding and LM head are int8 in the int8 layout, norms and biases f32. An int8 KV cache
  (`jaxinfer.model.kv_quant`) is counted with its scales: one f32 per token, kv head and K/V
  beside the H int8 values; on TPU each page's scales are a row of whole 128-lane tiles (the
  layout the kernels read as XLA:TPU stores it, `jaxinfer.model.kv_quant`), so a page of fewer
  than 128 tokens takes 128 lanes of scales (page 32: 16 bytes per token and head instead of 4).

Memory per chip = weights + KV pages + activations + runtime reserve; free = HBM - all of it.
- KV pages: rows x ceil(max_seq_len / page_size) x page_size x 2 * L * ceil(K/M) * (H * kv bytes
  + int8's scale bytes) (every slot can reach max_seq_len, as jaxinfer's pool defaults to;
  page_size 16). With `hybrid_kv` (the default) a model's sliding-window layers count only
  their own pool's pages: `config.local_pages_bound(window, page_size, chunk)` per slot (chunk:
  the engine's default prefill chunk), at most the full length, as `CacheConfig.with_pools`
  sizes it; the global layers keep the full length.
- Activations: one layer's f32 intermediates (residual and normed input, q/k/v, attention output,
  gate/up/activation: 2D + (2 ceil(N/M) + 2 ceil(K/M)) H + 3 ceil(F/M) values per token; a
  mixture layer's E router logits + k (2D + 3 ceil(F_e/M)) + 3 ceil(F_s/M) when larger) for
  max(prompt_len, rows) tokens, plus f32 attention scores of a 512-query block of the prompt over
  the whole prompt (ceil(N/M) x min(prompt_len, 512) x prompt_len; a blocked attention, since
  full T x T scores do not fit at long contexts), plus f32 logits of the decode rows
  (rows x ceil(V/M)). XLA keeps fewer buffers live than this sum, or more when it fuses badly.
  With int4 weights a step of more than AFTER_DOT_ROWS_PER_GROUP x int4_group rows (a long
  prompt chunk) dequantizes each int4 matrix before its dot (`jaxinfer.model.quant.einsum`):
  XLA:TPU materialises that float copy (at the activation dtype) one matrix at a time, so the
  largest int4 matrix per chip is counted once more (`dequantized_weight_bytes`; 8B at
  model:4, 512-token chunks: gate_up's 56 MiB, measured as the chunk step's temporaries in a
  deviceless v5e compile, tests/test_aot.py). XLA fuses the dequantization into the dot for
  small matrices (a 1B's 16 MiB gate_up shard): there the count is an overestimate.
- Speculative acceptance (`num_speculative_tokens` R > 0): the verify step's sampling program
  runs apart from the forward, over every slot (S = max_slots: its inputs stay whole over
  "data") and R + 1 positions, on f32 [S, R + 1, V] distributions: the target gathered whole
  on each chip for the acceptance kernel, plus ACCEPTANCE_SPLIT_COPIES vocab-split ones (the
  step's input logits, the masked and the penalised logits with the draft counts beside them,
  the filter's scaled logits and probabilities). Measured on XLA:TPU (8B's vocabulary, 60
  slots, R = 4): temporaries of 5.2 to 7.3 such split buffers besides the whole one over model
  axes 1, 2, 4 (`scripts/experiments/acceptance_memory.py`), plus the input.
  The memory's workspace is the larger of the forward's activations and this, not their sum:
  the two programs run one after the other.
- Runtime reserve: RUNTIME_RESERVE_FRACTION (5%) of HBM for the runtime, compiled programs and
  fragmentation (a guess; vLLM's default gpu_memory_utilization=0.9 leaves 10%).
- Largest batch: the most slots (a multiple of D) whose memory fits at max_seq_len.

Time (efficiency e applies to both HBM bandwidth and peak FLOP/s):
- Decode step at B rows per replica and context S = max_seq_len / 2 (the mean when continuous
  batching keeps sequences spread evenly over [0, max_seq_len]; `context_len` overrides it):
  HBM bytes per chip = weights per chip, except the input embedding shard when it is not tied
  (a decode gathers B of its rows) + KV read B x S x (KV bytes per token per chip) + KV written
  B x (KV bytes per token per chip) (as `roofline.decode_step_bytes`, per chip);
  FLOPs per chip = `roofline.decode_step_flops(B, S)` / M;
  step = max(bytes / (e x HBM bandwidth), FLOPs / (e x peak)) + ICI.
- ICI: two all-reduces per layer (after the attention output and MLP down projections) of the
  step's activations, T x D values in bf16 (f32 when weights are f32), over the M chips as a ring:
  2 (M - 1) / M x bytes / (per-chip one-way ICI bandwidth, all links). Bandwidth only: no
  per-hop latency and no overlap with compute (optimistic on latency, pessimistic on overlap).
  The logits gather (or sharded sampling) is not counted. TPUs: all chips in one ICI slice (no
  data-center network); GPUs: NVLink within 8 GPUs, beyond that the slower per-GPU network
  (InfiniBand) for the whole ring.
- Prefill of one prompt of prompt_len T tokens in one pass on one replica:
  FLOPs per chip = `roofline.prefill_flops(T)` / M; HBM bytes = weights read + T tokens' KV
  written; time = max(FLOPs / (e x peak), bytes / (e x HBM)) + ICI (2 L all-reduces of T x D).
  Peak is the chip's bf16 peak (int8 weights are dequantized into bf16 matmuls; f32 weights use
  the chip's f32 peak where one is published, else bf16: JAX's default TPU matmul precision).
- Tokens/s per sequence = 1 / step; total = max_slots / step (all replicas step together).

Mixtures of experts (`ModelConfig.num_experts` E > 0, k experts per token):
- Memory: a chip holds E / expert of each mixture layer's experts (all E without an expert
  axis), each with its FFN split over the M' chips of the model axis (`jaxinfer.sharding`); the
  router, whole on every chip, and the expert biases count as biases. The mixture's activations
  are those of all k pairs of every row on every chip: the static buffer that bounds the worst
  case of every row choosing this chip's experts (`jaxinfer.model.moe`).
- ICI: the mixture's combine is one all-reduce of the rows' T x D outputs over the E x M' chips,
  in place of the dense MLP's, so the two all-reduces per layer above stand (attention leaves
  every row whole on every chip of a replica: nothing is dispatched, no all-to-all). The plan
  reports the bytes each chip sends per step: 2 L x 2 (M - 1) / M x T x D x activation bytes.
- Decode bytes: a step of B rows (per replica) reads, per mixture layer, only the experts its
  rows route to: E (1 - (1 - k/E)^B) of them in expectation when each row's k experts are an
  independent uniform draw (real routers are skewed: fewer distinct experts, so this is an
  upper bound in expectation); a prefill of T tokens likewise with B = T. FLOPs count the k
  experts per token (`roofline.matmul_params`).
- Parameters: `ModelConfig.num_params` (total) and `num_active_params` (what one token uses:
  all but the E - k experts it skips, embedding tables included).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from jaxinfer.config import (
    AFTER_DOT_ROWS_PER_GROUP,
    DTYPE_BYTES,
    INT4_GROUP_NATIVE,
    MATRICES,
    WEIGHT_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RopeConfig,
    local_pages_bound,
)
from jaxinfer.perf import roofline

GIB = 1 << 30
KV_SCALE_BYTES = {"int8": 4}  # per token, kv head and K/V: an int8 pool's f32 scale
TPU_LANES = 128  # the minor tile of a TPU array: a [.., page_size] scale row pads to it
RUNTIME_RESERVE_FRACTION = 0.05
ATTENTION_QUERY_BLOCK = 512  # prompt queries whose scores are live at once (activation estimate)
ACT_BYTES = 4  # activations are estimated in f32
ACCEPTANCE_SPLIT_COPIES = 7  # vocab-split f32 [S, R + 1, V] buffers of the acceptance (module doc)

# Llama 3.1 RoPE: HF config.json rope_scaling {"rope_type": "llama3", "factor": 8.0,
# "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192};
# Llama 3.2 1B/3B use factor 32.0.
_LLAMA31_ROPE = RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position=8192)
_LLAMA32_ROPE = dataclasses.replace(_LLAMA31_ROPE, factor=32.0)


def _llama3(*, head_dim: int = 128, **kw: Any) -> ModelConfig:
    return ModelConfig(vocab_size=128256, num_kv_heads=8, head_dim=head_dim, rms_norm_eps=1e-5,
                       max_position=131072, dtype="bfloat16", **kw)


# Architectures, literal numbers from each model's Hugging Face config.json: meta-llama/
# Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, Llama-3.1-70B, Llama-3.1-405B (hidden_size,
# intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
# vocab_size 128256, max_position_embeddings 131072, rope_theta 500000, tie_word_embeddings true
# for 3.2 only); the 8B/70B/405B shapes also match jax-ml/jax-llm-examples llama3/configs.py.
# smollm2-135m: the embedded SmolLM2-135M-Instruct GGUF (`load_checkpoint(None).config`; a test
# checks they agree). gemma3-270m: the Gemma 3 270M GGUF (`load_checkpoint("gemma3-270m")`).
MODEL_PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, embed_dim=576, num_layers=30, num_q_heads=9, num_kv_heads=3,
        head_dim=64, ffn_dim=1536, rms_norm_eps=1e-5, rope=RopeConfig(theta=100000.0),
        max_position=8192, tie_embeddings=True, dtype="bfloat16"),
    "llama-3.2-1b": _llama3(embed_dim=2048, ffn_dim=8192, num_layers=16, num_q_heads=32,
                            head_dim=64, rope=_LLAMA32_ROPE, tie_embeddings=True),
    "llama-3.2-3b": _llama3(embed_dim=3072, ffn_dim=8192, num_layers=28, num_q_heads=24,
                            rope=_LLAMA32_ROPE, tie_embeddings=True),
    "llama-3.1-8b": _llama3(embed_dim=4096, ffn_dim=14336, num_layers=32, num_q_heads=32,
                            rope=_LLAMA31_ROPE),
    "llama-3.1-70b": _llama3(embed_dim=8192, ffn_dim=28672, num_layers=80, num_q_heads=64,
                             rope=_LLAMA31_ROPE),
    "llama-3.1-405b": _llama3(embed_dim=16384, ffn_dim=53248, num_layers=126, num_q_heads=128,
                              rope=_LLAMA31_ROPE),
    "gemma3-270m": ModelConfig(
        arch="gemma3", vocab_size=262144, embed_dim=640, num_layers=18, num_q_heads=4,
        num_kv_heads=1, head_dim=256, ffn_dim=2048, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1_000_000.0), rope_local=RopeConfig(theta=10_000.0),
        max_position=32768, tie_embeddings=True, qk_norm=True, post_norms=True,
        norm_plus_one=True, scale_embeddings=True, activation="gelu_tanh",
        query_pre_attn_scalar=256.0, sliding_window=512, sliding_window_pattern=6,
        dtype="bfloat16"),
}

# Mixtures of experts, literal numbers from each model's Hugging Face config.json: Qwen/
# Qwen3-30B-A3B and Qwen3-235B-A22B (hidden_size 2048 / 4096, intermediate_size 6144 / 12288,
# moe_intermediate_size 768 / 1536, num_hidden_layers 48 / 94, num_attention_heads 32 / 64,
# num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8, norm_topk_prob
# true, vocab_size 151936, max_position_embeddings 40960, rope_theta 1e6, rms_norm_eps 1e-6,
# untied); mistralai/Mixtral-8x7B-v0.1 (hidden_size 4096, intermediate_size 14336, 32 layers,
# 32 heads, 8 kv heads, num_local_experts 8, num_experts_per_tok 2, vocab_size 32000,
# max_position_embeddings 32768, rope_theta 1e6, rms_norm_eps 1e-5, untied); openai/gpt-oss-120b
# (hidden_size 2880, intermediate_size 2880, 36 layers, 64 heads, 8 kv heads, head_dim 64,
# num_local_experts 128, num_experts_per_tok 4, vocab_size 201088, max_position_embeddings
# 131072, rope_theta 150000 with yarn factor 32 over 4096 positions, beta_fast 32, beta_slow 1,
# sliding_window 128 on every other layer, attention_bias true, swiglu_limit 7, untied).
_QWEN3_MOE = dict(arch="qwen3_moe", vocab_size=151936, num_kv_heads=4, head_dim=128,
                  rms_norm_eps=1e-6, rope=RopeConfig(theta=1_000_000.0), max_position=40960,
                  qk_norm=True, num_experts=128, experts_per_token=8,
                  router="softmax_topk_norm", dtype="bfloat16")
MODEL_PRESETS.update({
    "qwen3-30b-a3b": ModelConfig(embed_dim=2048, ffn_dim=6144, expert_ffn_dim=768,
                                 num_layers=48, num_q_heads=32, **_QWEN3_MOE),
    "qwen3-235b-a22b": ModelConfig(embed_dim=4096, ffn_dim=12288, expert_ffn_dim=1536,
                                   num_layers=94, num_q_heads=64, **_QWEN3_MOE),
    "mixtral-8x7b": ModelConfig(
        arch="mixtral", vocab_size=32000, embed_dim=4096, ffn_dim=14336, num_layers=32,
        num_q_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=1_000_000.0), max_position=32768, num_experts=8,
        experts_per_token=2, router="softmax_topk_norm", dtype="bfloat16"),
    "gpt-oss-120b": ModelConfig(
        arch="gpt_oss", vocab_size=201088, embed_dim=2880, ffn_dim=2880, num_layers=36,
        num_q_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=150000.0, type="yarn", factor=32.0, original_max_position=4096,
                        beta_fast=32.0, beta_slow=1.0, truncate=False),
        max_position=131072, qkv_bias=True, o_bias=True, attention_sinks=True,
        sliding_window=128, sliding_window_pattern=2, activation="swiglu_clamped",
        num_experts=128, experts_per_token=4, router="topk_softmax", router_bias=True,
        expert_bias=True, dtype="bfloat16"),
})

CHIP_ALIASES = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e",
                "h100": "h100-sxm", "h200": "h200"}


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """Per-chip one-way chip-to-chip bandwidth (all links), within `domain_size` chips (None = a
    whole slice); beyond the domain every chip gets `scale_out_bytes_per_s`."""

    bytes_per_s: float
    domain_size: int | None = None
    scale_out_bytes_per_s: float | None = None


# TPU: Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v5e, /v5p, /v6e) give the
# bidirectional ICI bandwidth per chip, 400 / 1200 / 800 GB/s; one way is half. v4 publishes only
# "all-reduce bandwidth per Pod 1.1 PB/s" for 4096 chips (/tpu/docs/v4): 268.6 GB/s per chip (the
# same rule gives v5e 51.2 TB/s / 256 = 200 GB/s and v6e 102.4 TB/s / 256 = 400 GB/s).
# NVIDIA: H100 SXM and H200 product pages, NVLink 900 GB/s (bidirectional) per GPU, 8 GPUs per
# HGX board; across boards one 400 Gb/s NDR InfiniBand adapter per GPU (HGX reference design).
INTERCONNECTS: dict[str, Interconnect] = {
    "tpu-v4": Interconnect(1.1e15 / 4096),
    "tpu-v5e": Interconnect(200e9),
    "tpu-v5p": Interconnect(600e9),
    "tpu-v6e": Interconnect(400e9),
    "h100-sxm": Interconnect(450e9, 8, 50e9),
    "h200": Interconnect(450e9, 8, 50e9),
}


def model_preset(name: str) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


def chip_spec(name: str) -> roofline.Chip:
    """A chip by its short name (v5e, h100, ...) or its `roofline.CHIPS` name (tpu-v5e, ...)."""
    full = CHIP_ALIASES.get(name, name)
    if full not in roofline.CHIPS:
        raise ValueError(f"unknown chip {name!r}; valid chips: {', '.join(CHIP_ALIASES)}")
    return roofline.CHIPS[full]


def parse_mesh(spec: str, num_chips: int) -> tuple[int, int, int]:
    """"auto" -> (1, 1, num_chips); "data:D,model:M" -> (D, 1, M); "data:D,expert:E,model:M"
    -> (D, E, M); D x E x M must equal num_chips."""
    if spec == "auto":
        return 1, 1, num_chips
    try:
        axes = dict(part.split(":") for part in spec.split(","))
        data, expert, model = (int(axes.pop("data")), int(axes.pop("expert", 1)),
                               int(axes.pop("model")))
        if axes or min(data, expert, model) < 1:
            raise ValueError
    except (ValueError, KeyError):
        raise ValueError(f"mesh={spec!r} must be 'auto' or 'data:D,model:M' or "
                         "'data:D,expert:E,model:M' with D, E, M >= 1") from None
    if data * expert * model != num_chips:
        sizes = f"data {data} x " + (f"expert {expert} x " if expert > 1 else "") + \
            f"model {model}"
        raise ValueError(f"mesh={spec!r}: {sizes} = {data * expert * model} chips, but "
                         f"num_chips={num_chips}")
    return data, expert, model


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """One planning question; the `jaxinfer-plan` flags map onto these fields one to one."""

    model: str
    chip: str
    num_chips: int
    max_slots: int
    max_seq_len: int
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    int4_group: int = INT4_GROUP_NATIVE  # int4: weights per scale and offset
    int8_group: int = 0  # int8: 0 per output channel; 32 a GGUF's groups
    int8_matrices: tuple[str, ...] = ()  # int4: these of config.MATRICES int8 (a GGUF's mix)
    efficiency: float = 0.85
    prompt_len: int | None = None  # None: min(2048, max_seq_len)
    mesh: str = "auto"
    page_size: int = CacheConfig().page_size
    context_len: int | None = None  # decode context; None: max_seq_len / 2 (the mean)
    hybrid_kv: bool = CacheConfig().hybrid  # sliding-window layers get their bounded pool
    num_speculative_tokens: int = 0  # R drafts verified per step (0: no speculation)
    max_loras: int = 0  # LoRA adapter pool slots (0: no pool); counted with the weights
    max_lora_rank: int = 16

    def __post_init__(self):
        model = model_preset(self.model)
        chip_spec(self.chip)
        for name, valid in (("weight_dtype", WEIGHT_DTYPES), ("kv_dtype", tuple(DTYPE_BYTES))):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(valid)}")
        object.__setattr__(self, "int8_matrices", tuple(self.int8_matrices))
        bad = [m for m in self.int8_matrices if m not in MATRICES]
        if bad:
            raise ValueError(f"int8_matrices: {bad[0]!r} is not one of {', '.join(MATRICES)}")
        if self.int4_group <= 0 or self.int4_group % 2 or self.int8_group < 0:
            raise ValueError(f"int4_group={self.int4_group} must be a positive even number and "
                             f"int8_group={self.int8_group} 0 (per output channel) or positive")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 0")
        for name in ("num_chips", "max_slots", "max_seq_len", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_seq_len > model.max_position:
            raise ValueError(f"max_seq_len={self.max_seq_len} exceeds {self.model}'s context "
                             f"max_position={model.max_position}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency={self.efficiency} must be in (0, 1]")
        if self.prompt_len is None:
            object.__setattr__(self, "prompt_len", min(2048, self.max_seq_len))
        if not 1 <= self.prompt_len <= self.max_seq_len:
            raise ValueError(f"prompt_len={self.prompt_len} must be in [1, max_seq_len="
                             f"{self.max_seq_len}]")
        if self.context_len is not None and not 0 <= self.context_len <= self.max_seq_len:
            raise ValueError(f"context_len={self.context_len} must be in [0, max_seq_len="
                             f"{self.max_seq_len}]")
        _, expert, mp = parse_mesh(self.mesh, self.num_chips)
        stored_model(self).check_mesh({"expert": expert, "model": mp})


# ----- per-chip sizes ---------------------------------------------------------------------------
def _split(n: int, m: int) -> int:
    return -(-n // m)


def weight_bytes_per_chip(config: ModelConfig, model_parallel: int,
                          expert_parallel: int = 1) -> tuple[int, int]:
    """(all weights on one chip, of which the input embedding shard) in bytes, each matrix
    stored as `config.matrix_storage` says (module doc; with int4 weights, the matrices of
    `config.int8_matrices` are int8). model_parallel: the tensor-parallel chips (expert x
    model on an expert mesh); of them expert_parallel split the experts (module doc). At M = 1
    a float model's total equals `roofline.weight_bytes` and a quantized one's the model's
    arrays' bytes (tests check both)."""
    c, m, ep = config, model_parallel, expert_parallel
    d, h = c.embed_dim, c.head_dim
    n, k, f, v = (_split(c.num_q_heads, m), _split(c.num_kv_heads, m), _split(c.ffn_dim, m),
                  _split(c.vocab_size, m))
    small, store = _small_bytes(c), c.matrix_storage  # (kind, group) of each stored matrix
    o_kind, o_group = store("o")
    attn = (_matrix_bytes(d, (n + 2 * k) * h, *store("qkv"))
            + _matrix_bytes(n * h, d, o_kind, min(o_group, h))
            + c.layer_norm_params() * small)
    attn += small * ((h * (n + 2 * k) if c.qkv_bias else 0) + (d if c.o_bias else 0)
                     + (n if c.attention_sinks else 0))
    dense = _matrix_bytes(d, 2 * f, *store("gate_up")) + _matrix_bytes(f, d, *store("down"))
    moe = _router_and_shared_bytes(c, m) + local_experts_bytes(c, m, ep)
    layers = sum(attn + (moe if c.is_moe(i) else dense) for i in range(c.num_layers))
    # The LoRA pool (`jaxinfer.model.lora.pool_layout`) in the activations' dtype, split like
    # the weights it adapts: q/k/v/o/gate/up/down's A and B of every slot and layer.
    pool = c.lora_slots * c.lora_rank * (7 * d + (2 * n + 2 * k) * h + 3 * f)
    layers += c.num_layers * pool * DTYPE_BYTES[c.dtype]
    embed = _matrix_bytes(d, v, *store("embed"))
    total = layers + embed + d * small + (0 if c.tie_embeddings else embed)
    return total, embed


def _small_bytes(config: ModelConfig) -> int:
    """Bytes of a norm or bias value (module doc)."""
    kind = config.weights
    return DTYPE_BYTES[kind] if kind in ("float32", "bfloat16") else 4


def expert_bytes_per_chip(config: ModelConfig, model_parallel: int) -> int:
    """Bytes of one expert of a mixture layer on one chip (its FFN split over the model axis;
    its biases with `expert_bias`); 0 without experts."""
    c = config
    if not c.num_experts:
        return 0
    d, f = c.embed_dim, _split(c.moe_ffn_dim, model_parallel)
    biases = (2 * f + d) * _small_bytes(c) if c.expert_bias else 0
    return (_matrix_bytes(d, 2 * f, *c.matrix_storage("experts_gate_up"))
            + _matrix_bytes(f, d, *c.matrix_storage("experts_down")) + biases)


def local_experts_bytes(config: ModelConfig, model_parallel: int, expert_parallel: int = 1) -> int:
    """Bytes of the experts of one mixture layer on one chip: E / expert_parallel of them, each
    with its FFN split over the model_parallel / expert_parallel chips of the model axis."""
    return (_split(config.num_experts, expert_parallel)
            * expert_bytes_per_chip(config, model_parallel // expert_parallel))


def _router_and_shared_bytes(config: ModelConfig, model_parallel: int) -> int:
    """A mixture layer's bytes on one chip besides its experts: the router (and its bias), the
    shared expert and its gate."""
    c, small = config, _small_bytes(config)
    out = (c.embed_dim + (1 if c.router_bias else 0)) * c.num_experts * small
    if c.shared_expert_ffn_dim:
        d, fs = c.embed_dim, _split(c.shared_expert_ffn_dim, model_parallel)
        out += (_matrix_bytes(d, 2 * fs, *c.matrix_storage("shared_gate_up"))
                + _matrix_bytes(fs, d, *c.matrix_storage("shared_down")) + d * small)
    return out


def unread_expert_bytes(config: ModelConfig, model_parallel: int, rows: float,
                        expert_parallel: int = 1) -> float:
    """Bytes per chip of the experts a step of `rows` tokens does not read, over all mixture
    layers (`ModelConfig.expected_experts`; a chip's E / expert_parallel experts are read
    alike)."""
    skipped = (config.num_experts - config.expected_experts(rows)) / expert_parallel
    return config.num_moe_layers * skipped * expert_bytes_per_chip(
        config, model_parallel // expert_parallel)


def _matrix_bytes(contract: int, out: int, kind: str, group: int) -> int:
    """Bytes of a weight with `contract` elements along its contraction axes and `out` outputs
    stored as `kind`: a float dtype; int8 with an f32 scale per output (group 0) or an f32
    scale and offset per `group` contraction elements; int4 likewise, two values per byte."""
    values = contract * out
    if kind in ("float32", "bfloat16"):
        return values * DTYPE_BYTES[kind]
    if kind == "int8" and not group:
        return values + 4 * out
    group = min(group, contract)
    scales = 8 * _split(contract, group) * out
    return (_split(values, 2) if kind == "int4" else values) + scales


def kv_bytes_per_token_per_chip(config: ModelConfig, model_parallel: int, kv_bytes: int) -> int:
    """`roofline.kv_bytes_per_token` for the ceil(K/M) kv heads one chip holds."""
    per_head = roofline.kv_bytes_per_token(config, kv_bytes) // config.num_kv_heads
    return per_head * _split(config.num_kv_heads, model_parallel)


def kv_cache_bytes_per_token_per_chip(config: ModelConfig, model_parallel: int, kv_dtype: str,
                                      *, page_size: int, chip: str) -> int:
    """Bytes one token takes in the KV pool on one chip: its K/V values
    (`kv_bytes_per_token_per_chip`) plus, for an int8 pool, their scales (module doc: padded to
    TPU_LANES per page on TPU)."""
    values = kv_bytes_per_token_per_chip(config, model_parallel, DTYPE_BYTES[kv_dtype])
    scale = KV_SCALE_BYTES.get(kv_dtype, 0)
    if scale and chip.startswith("tpu"):
        scale = scale * _split(page_size, TPU_LANES) * TPU_LANES // page_size
    return values + 2 * config.num_layers * _split(config.num_kv_heads, model_parallel) * scale


def activation_bytes(config: ModelConfig, model_parallel: int, prompt_len: int,
                     rows: int, expert_parallel: int = 1) -> int:
    """Peak activation estimate per chip (module docstring, "Activations")."""
    c, m = config, model_parallel
    n, k, f = _split(c.num_q_heads, m), _split(c.num_kv_heads, m), _split(c.ffn_dim, m)
    mlp = 3 * f
    if c.num_experts:  # a mixture layer: router logits, then per chosen expert its gathered
        # input row, gate/up/activation and output, plus the shared expert's
        fe = _split(c.moe_ffn_dim, m // expert_parallel)
        fs = _split(c.shared_expert_ffn_dim, m)
        mlp = max(mlp, c.num_experts + c.experts_per_token * (2 * c.embed_dim + 3 * fe)
                  + 3 * fs)
    per_token = 2 * c.embed_dim + (2 * n + 2 * k) * c.head_dim + mlp
    scores = n * min(prompt_len, ATTENTION_QUERY_BLOCK) * prompt_len
    logits = rows * _split(c.vocab_size, m)
    return (ACT_BYTES * (per_token * max(prompt_len, rows) + scores + logits)
            + dequantized_weight_bytes(c, m, max(prompt_len, rows)))


def dequantized_weight_bytes(config: ModelConfig, model_parallel: int, rows: int) -> int:
    """Bytes per chip of the float copy (at `config.dtype`) of the largest int4 matrix, which a
    step of more than AFTER_DOT_ROWS_PER_GROUP x int4_group_size `rows` dequantizes before its
    dot (module doc, "Activations"); 0 for fewer rows or no int4 matrix. The attention's and
    the dense MLP's projections (`quant.einsum`); a mixture layer's experts go through the
    grouped matmul instead."""
    c, m = config, model_parallel
    if rows <= AFTER_DOT_ROWS_PER_GROUP * c.int4_group_size:
        return 0
    n, k, f = _split(c.num_q_heads, m), _split(c.num_kv_heads, m), _split(c.ffn_dim, m)
    d, h = c.embed_dim, c.head_dim
    sizes = {"qkv": d * (n + 2 * k) * h, "o": n * h * d}
    if not all(c.is_moe(i) for i in range(c.num_layers)):
        sizes.update(gate_up=2 * d * f, down=f * d)
    int4 = [size for name, size in sizes.items() if c.matrix_storage(name)[0] == "int4"]
    return max(int4, default=0) * DTYPE_BYTES[c.dtype]


def acceptance_bytes(config: ModelConfig, model_parallel: int, slots: int,
                     num_speculative_tokens: int) -> int:
    """Peak bytes per chip of the speculative acceptance's sampling program for `slots` slots
    (all of them, whatever the data axis) verifying R = `num_speculative_tokens` drafts (module
    docstring, "Speculative acceptance"); 0 without speculation."""
    if num_speculative_tokens <= 0:
        return 0
    v = config.vocab_size
    rows = slots * (num_speculative_tokens + 1)
    return ACT_BYTES * rows * (v + ACCEPTANCE_SPLIT_COPIES * _split(v, model_parallel))


def all_reduce_bytes(num_bytes: float, chips: int) -> float:
    """Bytes each chip sends in a ring all-reduce of `num_bytes` over `chips`:
    2 (chips - 1) / chips x bytes."""
    return 2 * (chips - 1) / chips * num_bytes


def all_reduce_seconds(num_bytes: float, chips: int, link: Interconnect) -> float:
    """Ring all-reduce of `num_bytes` over `chips`: `all_reduce_bytes` / bandwidth."""
    if chips <= 1:
        return 0.0
    bw = link.bytes_per_s
    if link.domain_size is not None and chips > link.domain_size:
        bw = link.scale_out_bytes_per_s
    return all_reduce_bytes(num_bytes, chips) / bw


# ----- the plan ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Per-chip memory (bytes), capacity and predicted times (seconds) for a PlanConfig."""

    config: PlanConfig
    chip_name: str
    data_parallel: int
    expert_parallel: int  # the mesh's expert axis (1: none)
    model_parallel: int  # the mesh's model axis; tensor parallel over expert x model
    kv_heads_per_chip: int
    kv_replication: int  # copies of each kv head over the tensor-parallel chips
    hbm_bytes: int
    weight_bytes: int
    kv_bytes: int
    activation_bytes: int
    acceptance_bytes: int  # speculative acceptance (0 without); workspace = max(it, activations)
    reserve_bytes: int
    free_bytes: int
    kv_bytes_per_slot: int
    largest_batch: int
    prefill_compute_s: float
    prefill_memory_s: float
    prefill_ici_s: float
    prefill_ici_bytes: float  # all-reduce bytes each chip sends for the prefill
    prefill_s: float
    decode_context: float
    total_params: int
    active_params: int
    expert_bytes: int  # all experts on one chip (0: a dense model)
    decode_experts: float  # distinct experts a decode step reads per mixture layer
    decode_bytes: float
    decode_memory_s: float
    decode_compute_s: float
    decode_ici_s: float
    decode_ici_bytes: float  # all-reduce bytes each chip sends per decode step
    decode_step_s: float
    tokens_per_s_per_seq: float
    tokens_per_s_total: float

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = dataclasses.asdict(self.config)
        return out


def _rows(batch: int, data_parallel: int) -> int:
    return _split(batch, data_parallel)


def _kv_token_bytes(cfg: PlanConfig, model: ModelConfig, mp: int) -> int:
    return kv_cache_bytes_per_token_per_chip(model, mp, cfg.kv_dtype, page_size=cfg.page_size,
                                             chip=chip_spec(cfg.chip).name)


def kv_slot_tokens(model: ModelConfig, *, max_seq_len: int, page_size: int,
                   hybrid: bool) -> float:
    """Page-table tokens one slot holds, averaged over the layers (each layer's share of the
    per-token bytes): the full length, or with a hybrid pool the local layers' bounded window
    (module doc)."""
    full = _split(max_seq_len, page_size) * page_size
    cache = CacheConfig(page_size=page_size, max_seq_len=max_seq_len, hybrid=hybrid)
    window = cache.local_window(model)
    if window is None:
        return full
    local = min(full, local_pages_bound(window, page_size, EngineConfig().chunk_size)
                * page_size)
    num_local = sum(model.is_local(i) for i in range(model.num_layers))
    return (full * (model.num_layers - num_local) + local * num_local) / model.num_layers


def _memory(cfg: PlanConfig, model: ModelConfig, hbm: int, mp: int, rows: int,
            ep: int = 1) -> dict[str, int]:
    """Per-chip bytes at `rows` slots per replica over `mp` tensor-parallel chips, `ep` of them
    over the experts."""
    weights, _ = weight_bytes_per_chip(model, mp, ep)
    slot = round(kv_slot_tokens(model, max_seq_len=cfg.max_seq_len, page_size=cfg.page_size,
                                hybrid=cfg.hybrid_kv) * _kv_token_bytes(cfg, model, mp))
    dp = parse_mesh(cfg.mesh, cfg.num_chips)[0]
    act = activation_bytes(model, mp, cfg.prompt_len, rows, ep)
    accept = acceptance_bytes(model, mp, rows * dp, cfg.num_speculative_tokens)
    used = weights + rows * slot + max(act, accept) + int(RUNTIME_RESERVE_FRACTION * hbm)
    return {"weight_bytes": weights, "kv_bytes": rows * slot, "activation_bytes": act,
            "acceptance_bytes": accept, "reserve_bytes": int(RUNTIME_RESERVE_FRACTION * hbm),
            "free_bytes": hbm - used, "kv_bytes_per_slot": slot}


def largest_fitting(fits: Callable[[int], bool]) -> int:
    """The largest n >= 1 with fits(n), or 0; `fits` holds up to some n and fails after it."""
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _largest_rows(cfg: PlanConfig, model: ModelConfig, hbm: int, mp: int, ep: int = 1) -> int:
    """Most rows per replica whose memory fits (0 if not even one)."""
    return largest_fitting(lambda r: _memory(cfg, model, hbm, mp, r, ep)["free_bytes"] >= 0)


def _suggest_mesh(cfg: PlanConfig, model: ModelConfig, hbm: int) -> tuple[int, int, int] | None:
    """The mesh (D, E, M) with the fewest chips that holds max_slots: E x M a power of two or a
    divisor of the query heads (up to 1024), D = ceil(max_slots / rows that fit per replica).
    A mixture puts as many of the tensor-parallel chips on the expert axis as divide its
    experts (each chip then holds whole-width experts), a dense model none."""
    heads = model.num_q_heads
    sizes = sorted({2**i for i in range(11)} | {d for d in range(1, heads + 1) if heads % d == 0})
    best = None
    for mp in (m for m in sizes if m <= 1024):
        ep = math.gcd(model.num_experts, mp) if model.num_experts else 1
        rows = _largest_rows(cfg, model, hbm, mp, ep)
        if rows and (best is None or _split(cfg.max_slots, rows) * mp
                     < best[0] * best[1] * best[2]):
            best = (_split(cfg.max_slots, rows), ep, mp // ep)
    return best


def mesh_flag(data: int, expert: int, model: int) -> str:
    """The --mesh value of a (D, E, M) mesh: the expert axis named only when it splits."""
    return f"data:{data}," + (f"expert:{expert}," if expert > 1 else "") + f"model:{model}"


def _check_fits(cfg: PlanConfig, model: ModelConfig, chip: roofline.Chip, mp: int,
                largest: int, ep: int = 1) -> None:
    if largest >= cfg.max_slots:
        return
    mem = _memory(cfg, model, chip.memory_bytes, mp, 1, ep)
    mesh = _suggest_mesh(cfg, model, chip.memory_bytes)
    hint = (f"{cfg.max_slots} slots fit on {math.prod(mesh)} chips with "
            f"--mesh={mesh_flag(*mesh)}" if mesh else
            "no mesh up to 1024 chips per replica fits one slot")
    where = (f"{cfg.model} ({cfg.weight_dtype} weights {mem['weight_bytes'] / GIB:.2f} GiB per "
             f"chip, {cfg.kv_dtype} KV {mem['kv_bytes_per_slot'] / GIB:.3f} GiB per slot per "
             f"chip at max_seq_len={cfg.max_seq_len}) on {cfg.num_chips} x {chip.name} "
             f"({chip.memory_bytes / GIB:.1f} GiB each)")
    if largest == 0:
        raise ValueError(f"{where} does not fit even at batch 1; {hint}")
    raise ValueError(f"max_slots={cfg.max_slots} does not fit: {where} holds at most "
                     f"{largest} slots; {hint}")


def stored_model(cfg: PlanConfig) -> ModelConfig:
    """The preset of `cfg.model` with its weights stored as `cfg` asks (dtype and groups)."""
    return dataclasses.replace(model_preset(cfg.model), weight_dtype=cfg.weight_dtype,
                               int4_group_size=cfg.int4_group, int8_group_size=cfg.int8_group,
                               int8_matrices=cfg.int8_matrices, lora_slots=cfg.max_loras,
                               lora_rank=cfg.max_lora_rank if cfg.max_loras else 0)


def plan(cfg: PlanConfig) -> Plan:
    """Memory, capacity and roofline times for `cfg` (module docstring: every assumption).

    Raises ValueError when max_slots does not fit (the message names the largest that does and
    the model axis that would hold max_slots).
    """
    model, chip = stored_model(cfg), chip_spec(cfg.chip)
    dp, ep, m = parse_mesh(cfg.mesh, cfg.num_chips)
    mp = ep * m  # the tensor-parallel chips: attention, dense MLPs, vocabulary, expert FFNs
    largest = dp * _largest_rows(cfg, model, chip.memory_bytes, mp, ep)
    _check_fits(cfg, model, chip, mp, largest, ep)
    rows = _rows(cfg.max_slots, dp)
    mem = _memory(cfg, model, chip.memory_bytes, mp, rows, ep)
    link = INTERCONNECTS[chip.name]
    act_bytes = 4 if cfg.weight_dtype == "float32" else 2
    peak = chip.peak_flops(cfg.weight_dtype) or chip.peak_flops("bfloat16")
    bw, flops_s = cfg.efficiency * chip.hbm_bytes_per_s, cfg.efficiency * peak
    weights, embed = weight_bytes_per_chip(model, mp, ep)
    read = weights if model.tie_embeddings else weights - embed
    kv_token = _kv_token_bytes(cfg, model, mp)
    d, layers = model.embed_dim, model.num_layers

    t = cfg.prompt_len
    pre_compute = roofline.prefill_flops(model, t) / mp / flops_s
    pre_memory = (read - unread_expert_bytes(model, mp, t, ep) + t * kv_token) / bw
    pre_ici = 2 * layers * all_reduce_seconds(t * d * act_bytes, mp, link)
    pre_ici_bytes = 2 * layers * all_reduce_bytes(t * d * act_bytes, mp)

    context = cfg.max_seq_len / 2 if cfg.context_len is None else cfg.context_len
    dec_bytes = (read - unread_expert_bytes(model, mp, rows, ep) + kv_token * context * rows
                 + kv_token * rows)
    dec_memory = dec_bytes / bw
    dec_compute = roofline.decode_step_flops(model, rows, context) / mp / flops_s
    dec_ici = 2 * layers * all_reduce_seconds(rows * d * act_bytes, mp, link)
    dec_ici_bytes = 2 * layers * all_reduce_bytes(rows * d * act_bytes, mp)
    step = max(dec_memory, dec_compute) + dec_ici
    kv_per_chip = _split(model.num_kv_heads, mp)
    return Plan(
        config=cfg, chip_name=chip.name, data_parallel=dp, expert_parallel=ep, model_parallel=m,
        kv_heads_per_chip=kv_per_chip, kv_replication=max(1, mp // model.num_kv_heads),
        hbm_bytes=chip.memory_bytes, **mem, largest_batch=largest,
        prefill_compute_s=pre_compute, prefill_memory_s=pre_memory, prefill_ici_s=pre_ici,
        prefill_ici_bytes=pre_ici_bytes,
        prefill_s=max(pre_compute, pre_memory) + pre_ici, decode_context=context,
        total_params=model.num_params(), active_params=model.num_active_params(),
        expert_bytes=model.num_moe_layers * local_experts_bytes(model, mp, ep),
        decode_experts=model.expected_experts(rows), decode_bytes=dec_bytes,
        decode_memory_s=dec_memory, decode_compute_s=dec_compute,
        decode_ici_s=dec_ici, decode_ici_bytes=dec_ici_bytes, decode_step_s=step,
        tokens_per_s_per_seq=1 / step, tokens_per_s_total=cfg.max_slots / step)


# ----- report -----------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _layout_lines(p: Plan) -> list[str]:
    """The plan's mesh and how the weights, KV and slots split over it."""
    c, model = p.config, model_preset(p.config.model)
    k, ep, tp = model.num_kv_heads, p.expert_parallel, p.expert_parallel * p.model_parallel
    kv_note = (f"each of the {k} kv heads replicated {p.kv_replication}x"
               if tp > k else f"{p.kv_heads_per_chip} of {k} kv heads per chip")
    axes = f"expert={ep} x " if ep > 1 else ""
    lines = [
        f"{c.model} on {c.num_chips} x {p.chip_name}: mesh data={p.data_parallel} x "
        f"{axes}model={p.model_parallel}",
        f"tensor parallel: weights and KV sharded over the {tp} "
        + ("expert x model" if ep > 1 else "model-axis") + f" chip(s) ({kv_note})",
    ]
    if ep > 1:
        lines.append(f"expert parallel: {model.num_experts // ep} of {model.num_experts} experts "
                     f"per chip, each with 1/{p.model_parallel} of its FFN; the mixture's "
                     "combine is one all-reduce over expert x model (no all-to-all)")
    if p.data_parallel > 1:
        lines.append(f"data parallel: {p.data_parallel} replicas, each a full copy of the weights "
                     f"with ceil({c.max_slots}/{p.data_parallel}) = "
                     f"{-(-c.max_slots // p.data_parallel)} slots")
    return lines


def format_plan(p: Plan) -> str:
    """The human-readable table `jaxinfer-plan` prints."""
    c, model = p.config, model_preset(p.config.model)
    gib = lambda b: f"{b / GIB:9.3f} GiB"  # noqa: E731
    ep = p.expert_parallel
    lines = _layout_lines(p) + [
        f"weights {c.weight_dtype}, KV {c.kv_dtype}, max_seq_len {c.max_seq_len}, "
        f"{c.max_slots} slots, efficiency {c.efficiency:.2f}",
        f"parameters {p.total_params / 1e9:.2f}B, {p.active_params / 1e9:.2f}B active per token "
        f"({model.num_active_params(input_embedding=False) / 1e9:.2f}B without the input "
        "embedding table)",
        "",
        f"per-chip memory ({p.hbm_bytes / GIB:.2f} GiB HBM)",
        f"  weights                {gib(p.weight_bytes)}",
        *([f"    of which experts     {gib(p.expert_bytes)}  ({model.num_experts // ep} of "
           f"{model.num_experts} per mixture layer on each chip, {model.experts_per_token} per "
           "token)"] if p.expert_bytes else []),
        f"  KV pages               {gib(p.kv_bytes)}  "
        f"({p.kv_bytes_per_slot / 2**20:.1f} MiB per slot)",
        f"  activations/workspace  {gib(p.activation_bytes)}  (estimate)",
    ]
    if p.acceptance_bytes:
        lines.append(f"  spec. acceptance       {gib(p.acceptance_bytes)}  (estimate; runs apart "
                     "from the forward: the larger of the two counts)")
    lines += [
        f"  runtime reserve        {gib(p.reserve_bytes)}  "
        f"({RUNTIME_RESERVE_FRACTION:.0%} of HBM)",
        f"  free                   {gib(p.free_bytes)}",
        f"largest batch at max_seq_len {c.max_seq_len}: {p.largest_batch} slots",
        "",
        f"prefill {c.prompt_len} tokens: {_ms(p.prefill_s)}  (compute {_ms(p.prefill_compute_s)}"
        f", HBM {_ms(p.prefill_memory_s)}, ICI {_ms(p.prefill_ici_s)}: "
        f"{p.prefill_ici_bytes / 2**20:.1f} MiB all-reduced per chip)",
        f"decode step, batch {c.max_slots}, {'mean ' if c.context_len is None else ''}context "
        f"{p.decode_context:.0f}: "
        f"{_ms(p.decode_step_s)}  (HBM {_ms(p.decode_memory_s)}, compute "
        f"{_ms(p.decode_compute_s)}, ICI {_ms(p.decode_ici_s)}: "
        f"{p.decode_ici_bytes / 2**20:.2f} MiB all-reduced per chip)",
        f"  {p.tokens_per_s_per_seq:.1f} tok/s per sequence, {p.tokens_per_s_total:.1f} tok/s "
        "total",
    ]
    if model.num_experts:
        lines.append(f"  reads {p.decode_experts:.1f} of {model.num_experts} experts per mixture "
                     f"layer (E(1 - (1 - k/E)^B), B = {-(-c.max_slots // p.data_parallel)} rows)")
    return "\n".join(lines)
