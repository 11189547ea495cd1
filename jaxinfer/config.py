"""Run configuration: frozen keyword-only dataclasses, one per concern.

Precedence (lowest first): dataclass default < preset < YAML (`--config=...`) < flag.
`jaxinfer.cli.flags` owns the one table that maps flags onto these fields.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import re
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "llama3", "linear", "yarn")
DTYPES = ("float32", "bfloat16")
# Weight storage: a float dtype, or int8 (per output channel) / int4 (per group) quantized
# (`jaxinfer.model.quant`).
WEIGHT_DTYPES = (*DTYPES, "int8", "int4")
# int4's group along the contraction axis: on CPU and for a GGUF (its block), and for a float
# checkpoint on a platform where int4 is native 4-bit (TPU, GPU; `quant.default_int4_group`).
INT4_GROUP = 32
INT4_GROUP_NATIVE = 128
# Native int4 applies its scales after the dot (`quant.einsum`) while its [rows, groups, out] f32
# intermediate has at most this many elements per weight element (rows / group): its
# scale-and-offset pass then costs no more vector work than dequantizing the weight before the
# dot once (a convert, a multiply and an add per element), and XLA TPU counts 2.1-3.7x fewer
# bytes accessed than bf16 up to there, where dequantizing before the dot counts 0.95x
# (docs/benchmarks.md). Past it (long prompt chunks) the weight is dequantized before the dot:
# a float copy of it the planner counts (`planner.dequantized_weight_bytes`).
AFTER_DOT_ROWS_PER_GROUP = 2
# Each layer's weight matrices as the model stores them, fused (`jaxinfer.model.params`): q, k, v
# in qkv; o; gate and up in gate_up; down; a mixture layer's stacked experts and shared expert
# (`jaxinfer.model.moe`). One storage kind per name in every layer.
MATRICES = ("qkv", "o", "gate_up", "down", "experts_gate_up", "experts_down", "shared_gate_up",
            "shared_down")
TABLES = ("embed", "lm_head")  # the token embedding and the LM head: int8 when quantized
# KV cache storage: a float dtype, or int8 pages with an f32 scale per token and kv head
# (`jaxinfer.model.kv_quant`).
KV_DTYPES = (*DTYPES, "int8")
# The gated MLP's activation: SwiGLU, GeGLU, and gpt-oss's clamped SwiGLU (`jaxinfer.model.mlp`).
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamped")
# A mixture-of-experts router (`jaxinfer.model.moe`): softmax over every expert then the top k
# (Qwen2/3-MoE with norm_topk_prob false), the same with the k weights renormalised to sum to 1
# (Mixtral, Qwen3-MoE), or the top k logits then a softmax over them (gpt-oss).
ROUTERS = ("softmax_topk", "softmax_topk_norm", "topk_softmax")
ATTENTION_IMPLS = ("auto", "xla", "pallas")
SCHEDULING_POLICIES = ("continuous", "static")
SPECULATIVE_METHODS = ("none", "ngram", "draft", "self", "eagle")
TREE_METHODS = ("ngram", "eagle")  # the drafters that draft trees (`DraftTree`)
MAX_TOP_LOGPROBS = 20  # widest top-n logprobs output a step computes
MAX_LORA_RANK = 64  # the largest LoRA rank the adapter pool takes (`EngineConfig.max_lora_rank`)
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar")  # SamplingConfig's structured output
# The layer stack's layout (`RunConfig.scan_layers`, `ModelConfig.scan_layers`): "auto" resolves
# per platform (`resolve_scan_layers`).
SCAN_LAYERS = ("auto", "true", "false")
# Platforms whose "auto" scans the layers: compile time nearly independent of depth, and XLA:TPU
# reads each layer's weights from the stack in place (the dynamic slice fused into the matmul or
# staged into VMEM, as an unrolled layer's weights are). XLA:CPU and XLA:GPU (jaxlib 0.10.2,
# sm_90a) copy a layer's weights out of the stack before its matmuls, a second pass over the
# weights that a bandwidth-bound decode step pays for (CPU: docs/architecture.md,
# decision 16; GPU: the compile check's moves, `jaxinfer.proof.aot`), so they unroll.
SCANNED_PLATFORMS = ("tpu",)


# ----- field types ---------------------------------------------------------------------------
# Every config dataclass checks its fields against their annotations first thing in
# `__post_init__`, so a value of the wrong type fails the same way whether it came from a flag,
# YAML, a JSONL record or Python: a ValueError naming the field, the value and what is valid.
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def conform(value: Any, typ: Any) -> Any:
    """`value` as the annotation `typ` holds it, or raises TypeError. Only unambiguous
    conversions: an integer for a float, a list for a tuple, one string for a tuple of strings,
    a numpy scalar for its Python type. No float for an int, no bool for a number."""
    args = typing.get_args(typ)
    if isinstance(typ, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return conform(value, inner)
    if typ is bool:
        if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):  # numpy's too
            return bool(value)
    elif typ is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
    elif typ is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer past the float range
                raise TypeError("a finite number") from None
    elif typ is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(typ) is tuple:
        if isinstance(value, str) and args[0] is str:
            return (value,)
        if isinstance(value, (list, tuple)):
            try:
                return tuple(conform(v, args[0]) for v in value)
            except TypeError:
                raise TypeError(describe_type(typ)) from None
    elif isinstance(value, typ):
        return value
    raise TypeError(describe_type(typ))


def describe_type(typ: Any) -> str:
    """What a value of annotation `typ` must be, in words."""
    args = typing.get_args(typ)
    if isinstance(typ, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return f"{describe_type(inner)} or null"
    if typing.get_origin(typ) is tuple:
        return ("a list of strings (or one string)" if args[0] is str
                else f"a list of {describe_type(args[0]).removeprefix('an ').removeprefix('a ')}s")
    return {bool: "true or false", int: "an integer", float: "a number",
            str: "a string"}.get(typ, f"a {getattr(typ, '__name__', typ)}")


def check_field(cls: type, name: str, value: Any, *, label: str | None = None) -> Any:
    """`value` conformed to field `name` of config dataclass `cls`; raises ValueError naming
    the field (as `label`, default its name), the value and the type it needs."""
    try:
        return conform(value, _hints(cls)[name])
    except TypeError as e:
        raise ValueError(f"{label or name}={short_repr(value)} must be {e}") from None


def short_repr(value: Any, width: int = 60) -> str:
    """`repr(value)` cut to `width` characters (an integer past Python's 4300-digit repr limit
    is described by its size)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<an integer of more than {sys.get_int_max_str_digits()} digits>"
    return text if len(text) <= width else text[:width - 3] + "..."


def _check_fields(obj: Any) -> None:
    """Conforms every field of a frozen config dataclass in place (see `conform`)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        conformed = check_field(type(obj), f.name, value)
        if conformed is not value:
            object.__setattr__(obj, f.name, conformed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding. Pairing is HF `rotate_half` (first half with second half).

    `type`: "default" (plain theta^(-2i/H)), "llama3" (Llama 3.1 frequency-band scaling),
    "linear" (positions divided by `factor`) or "yarn" (YaRN: frequencies past the
    `beta_fast`..`beta_slow` rotations-per-`original_max_position` ramp divided by `factor`,
    those before it kept, and cos/sin scaled by `attention_factor`; None = 0.1 ln(factor) + 1,
    Hugging Face's default; `truncate` rounds the ramp's ends outward to whole dimensions).
    """

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self):
        _check_fields(self)
        if self.type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.type!r} is not one of {ROPE_TYPES}")
        if self.theta <= 0:
            raise ValueError(f"theta={self.theta!r} must be > 0")
        if self.factor <= 0:
            raise ValueError(f"factor={self.factor!r} must be > 0")
        if self.type == "yarn" and (self.original_max_position <= 0 or self.beta_fast <= 0
                                    or self.beta_slow <= 0):
            raise ValueError(f"yarn rope: original_max_position={self.original_max_position}, "
                             f"beta_fast={self.beta_fast} and beta_slow={self.beta_slow} must "
                             "be > 0")
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ValueError(f"attention_factor={self.attention_factor!r} must be > 0 or None")

    @property
    def attention_scale(self) -> float:
        """The factor YaRN scales cos and sin by (1.0 for the other types)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What one layer's code and weights depend on beyond the model's shapes: its attention
    (`window` None: global, else local within that sliding window), its RoPE and its MLP (dense
    or a mixture of experts). Layers of one kind have the same weights' structure and run the
    same code, so the scanned layout stacks them together (`jaxinfer.model.layers`); a block
    variant that differs between layers is a field here, and part of `name`."""

    window: int | None
    rope: RopeConfig
    moe: bool = False  # the MLP is a mixture of experts (`ModelConfig.is_moe`)

    @property
    def name(self) -> str:
        """The kind's key among the model's weight stacks (unique per distinct kind)."""
        return ("global" if self.window is None else "local") + ("_moe" if self.moe else "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer: the shapes plus the block-variant features every registered
    architecture (`jaxinfer.families`) is expressed in, so one model class runs them all.

    Axis names: D embed_dim, N num_q_heads, K num_kv_heads, H head_dim, F ffn_dim, V vocab_size,
    L num_layers. `arch` names the family (its weight names and chat template); the model itself
    reads only the features:

      qkv_bias: biases on q, k, v (Qwen2).  qk_norm: RMSNorm over each head's q and k before
      RoPE (Qwen3, Gemma 3).  post_norms: RMSNorm on the attention and MLP outputs before each
      residual add (Gemma 3).  norm_plus_one: RMSNorm scales by (1 + w) (Gemma).
      scale_embeddings: embeddings times sqrt(D) (Gemma).  activation: the gated MLP's
      (`ACTIVATIONS`).  query_pre_attn_scalar: scores scaled by its -1/2 power instead of H's.
      sliding_window: the local layers' window (a query at p sees keys in (p - window, p]);
      sliding_window_pattern: None = every layer local; n = layer i is global (full attention)
      when (i + 1) % n == 0, local otherwise (Gemma 3: 6, five local per global).
      rope_local: the local layers' RoPE when it differs from `rope` (Gemma 3).
      o_bias: a bias on the attention output projection (gpt-oss).  attention_sinks: a learned
      logit per query head in every softmax denominator (gpt-oss).  swiglu_alpha, swiglu_limit:
      the sigmoid gain and the clamp of activation "swiglu_clamped" (`jaxinfer.model.mlp`).

    Mixture of experts (`jaxinfer.model.moe`), on when num_experts E > 0: a layer's MLP is E
    expert MLPs of width `expert_ffn_dim` (None: ffn_dim) of which each token runs
    `experts_per_token` k, chosen and weighted by a router (`ROUTERS`; `router_bias`: a bias on
    its logits); `expert_bias`: biases on the experts' gate/up and down projections (gpt-oss);
    shared_expert_ffn_dim > 0: plus a dense MLP of that width every token runs, scaled by
    sigmoid(x . gate) (Qwen2-MoE's shared expert). Layer i is a mixture when (i + 1) %
    moe_layer_step == 0 and i is not in `dense_layers` (Qwen's decoder_sparse_step,
    mlp_only_layers); the other layers keep the dense MLP of width ffn_dim.

    lora_slots, lora_rank: the LoRA adapter pool every layer holds beside its weights
    (docs/architecture.md, decision 18; `jaxinfer.model.lora`): that many adapter slots of at
    most that rank; 0 = no pool. The engine sets them from `EngineConfig.max_loras` /
    `max_lora_rank`.
    scan_layers: the layout of the layer stack (docs/architecture.md, decision 16): False =
    one `Block` per layer, run unrolled; True = each kind's weights (`LayerKind`) stacked on a
    leading `layers` axis and the layers run as a `jax.lax.scan` over their repeating group
    (`jaxinfer.model.layers`), the KV pool stacked alike. Both give the same outputs.
    """

    arch: str = "llama"
    vocab_size: int
    embed_dim: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    rope_local: RopeConfig | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    norm_plus_one: bool = False
    scale_embeddings: bool = False
    activation: str = "silu"
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    o_bias: bool = False
    attention_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_dim: int | None = None
    router: str = "softmax_topk_norm"
    router_bias: bool = False
    expert_bias: bool = False
    shared_expert_ffn_dim: int = 0
    moe_layer_step: int = 1
    dense_layers: tuple[int, ...] = ()
    dtype: str = "float32"  # activations (and float weights unless weight_dtype says otherwise)
    weight_dtype: str | None = None  # None: dtype; int8 / int4: `jaxinfer.model.quant`
    int4_group_size: int = INT4_GROUP  # int4: elements per scale along the contraction axis
    # int8: 0 = a symmetric scale per output channel; > 0 = a scale and zero per group of that
    # many along the contraction axis (a GGUF load: `jaxinfer.checkpoint.requant`)
    int8_group_size: int = 0
    scan_layers: bool = False
    # int4 weights: these of MATRICES are int8 instead, in every layer (a GGUF's matrices that
    # its 4-bit mix stores wider: `jaxinfer.checkpoint.requant.int8_matrices`); no effect on
    # float or int8 weights
    int8_matrices: tuple[str, ...] = ()
    # The LoRA adapter pool (`jaxinfer.model.lora`): slots x rank in every layer; 0 = none.
    lora_slots: int = 0
    lora_rank: int = 0

    def __post_init__(self):
        _check_fields(self)
        if not self.arch:
            raise ValueError("arch must name a registered architecture (jaxinfer.families)")
        for name in ("vocab_size", "embed_dim", "num_layers", "num_q_heads", "num_kv_heads",
                     "head_dim", "ffn_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} not divisible by num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not one of {ACTIVATIONS}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window!r} must be > 0 or None")
        if self.sliding_window_pattern is not None and (
                self.sliding_window_pattern <= 0 or self.sliding_window is None):
            raise ValueError(f"sliding_window_pattern={self.sliding_window_pattern!r} must be "
                             "> 0, with a sliding_window")
        if self.query_pre_attn_scalar is not None and self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar={self.query_pre_attn_scalar!r} must be > 0")
        if self.weight_dtype is not None and self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype={self.weight_dtype!r} is not one of {WEIGHT_DTYPES}")
        if self.int4_group_size <= 0 or self.int4_group_size % 2:
            raise ValueError(f"int4_group_size={self.int4_group_size} must be a positive even "
                             "number")
        if self.int8_group_size < 0:
            raise ValueError(f"int8_group_size={self.int8_group_size} must be 0 (per output "
                             "channel) or a positive group size")
        if self.swiglu_limit <= 0 or self.swiglu_alpha <= 0:
            raise ValueError(f"swiglu_alpha={self.swiglu_alpha} and swiglu_limit="
                             f"{self.swiglu_limit} must be > 0")
        bad = [m for m in self.int8_matrices if m not in MATRICES]
        if bad:
            raise ValueError(f"int8_matrices={self.int8_matrices!r}: {bad[0]!r} is not one of "
                             f"{MATRICES}")
        if self.lora_slots < 0 or self.lora_rank < 0 or (self.lora_slots > 0) != (
                self.lora_rank > 0):
            raise ValueError(f"lora_slots={self.lora_slots} and lora_rank={self.lora_rank} "
                             "must both be 0 (no adapter pool) or both > 0")
        self._check_experts()

    def _check_experts(self) -> None:
        """The mixture-of-experts fields (class doc) are consistent."""
        e, k = self.num_experts, self.experts_per_token
        if e < 0:
            raise ValueError(f"num_experts={e} must be >= 0 (0: dense MLPs)")
        if e == 0:
            used = [name for name in ("experts_per_token", "expert_ffn_dim", "router_bias",
                                      "expert_bias", "shared_expert_ffn_dim", "dense_layers")
                    if getattr(self, name)]
            if used:
                raise ValueError(f"{used[0]}={getattr(self, used[0])!r} needs num_experts > 0 "
                                 "(a mixture-of-experts model)")
            return
        if not 1 <= k <= e:
            raise ValueError(f"experts_per_token={k} must be in [1, num_experts={e}]")
        if self.expert_ffn_dim is not None and self.expert_ffn_dim <= 0:
            raise ValueError(f"expert_ffn_dim={self.expert_ffn_dim} must be > 0 or None "
                             "(ffn_dim)")
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r} is not one of {ROUTERS}")
        if self.shared_expert_ffn_dim < 0:
            raise ValueError(f"shared_expert_ffn_dim={self.shared_expert_ffn_dim} must be >= 0 "
                             "(0: no shared expert)")
        if self.moe_layer_step <= 0:
            raise ValueError(f"moe_layer_step={self.moe_layer_step} must be > 0")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dense_layers={list(self.dense_layers)}: layer {bad[0]} is not in "
                             f"[0, num_layers={self.num_layers})")

    @property
    def weights(self) -> str:
        """The weights' storage dtype: `weight_dtype`, or `dtype` when unset."""
        return self.weight_dtype or self.dtype

    def matrix_storage(self, matrix: str) -> tuple[str, int]:
        """(kind, group) of a weight matrix of MATRICES or TABLES: `weights`, except int8
        for the tables of a quantized model and for `int8_matrices` of an int4 one; group:
        `int4_group_size` for int4, `int8_group_size` for int8 (0 for a float kind)."""
        if matrix not in MATRICES + TABLES:
            raise ValueError(f"matrix {matrix!r} is not one of {MATRICES + TABLES}")
        kind = self.weights
        if (kind in ("int8", "int4") and matrix in TABLES) or (
                kind == "int4" and matrix in self.int8_matrices):
            kind = "int8"
        group = {"int4": self.int4_group_size, "int8": self.int8_group_size}.get(kind, 0)
        return kind, group

    @property
    def q_per_kv(self) -> int:  # G
        return self.num_q_heads // self.num_kv_heads

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends within `sliding_window` (see the class docstring)."""
        if self.sliding_window is None:
            return False
        n = self.sliding_window_pattern
        return n is None or (layer + 1) % n != 0

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`; None: full attention."""
        return self.sliding_window if self.is_local(layer) else None

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE of `layer`: `rope_local` on local layers where set, else `rope`."""
        return self.rope_local if self.rope_local and self.is_local(layer) else self.rope

    @property
    def moe_ffn_dim(self) -> int:
        """Each expert's FFN width: `expert_ffn_dim`, or ffn_dim when unset."""
        return self.expert_ffn_dim or self.ffn_dim

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (see the class docstring)."""
        return (self.num_experts > 0 and (layer + 1) % self.moe_layer_step == 0
                and layer not in self.dense_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.num_layers))

    def check_mesh(self, mesh_sizes: dict[str, int]) -> None:
        """Raises ValueError unless a mesh of `mesh_sizes` (`sharding.parse_mesh`'s, or a
        mesh's shape) can hold this model's experts (`jaxinfer.sharding`: experts over
        "expert", their FFN over "model"): the expert axis divides num_experts (each expert
        shard holds whole experts), and with grouped int8 / int4 experts the model axis splits
        the down projection's FFN at group boundaries (each chip's rows keep their own scales;
        a group longer than the FFN is the FFN). Checked from the config, before any weight
        loads; a dense model runs on any expert axis (there it is tensor parallelism)."""
        e, m, n = mesh_sizes.get("expert", 1), mesh_sizes.get("model", 1), self.num_experts
        if n and n % e:
            valid = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(f"the mesh's expert axis expert:{e} does not divide the model's "
                             f"num_experts={n}; valid expert axis sizes: {valid}")
        kind, f = self.weights, self.moe_ffn_dim
        group = min(self.int4_group_size if kind == "int4" else self.int8_group_size, f)
        if n and kind in ("int8", "int4") and group and (f // group) % m:
            raise ValueError(
                f"{kind} experts in groups of {group} along their FFN of {f} ({f // group} "
                f"groups) cannot split over model:{m}; use a model axis that divides "
                f"{f // group}, or put those chips on the expert axis")

    def expert_params(self) -> int:
        """Parameters of one expert: its gate, up and down matrices (and biases)."""
        d, f = self.embed_dim, self.moe_ffn_dim
        return 3 * d * f + ((2 * f + d) if self.expert_bias else 0)

    def _mlp_params(self, layer: int, experts: int) -> int:
        """MLP parameters of `layer` counting `experts` of its experts (a mixture layer)."""
        d = self.embed_dim
        if not self.is_moe(layer):
            return 3 * d * self.ffn_dim
        router = d * self.num_experts + (self.num_experts if self.router_bias else 0)
        shared = 3 * d * self.shared_expert_ffn_dim + d if self.shared_expert_ffn_dim else 0
        return router + shared + experts * self.expert_params()

    def layer_kind(self, layer: int) -> LayerKind:
        """The kind of `layer` (`LayerKind`)."""
        return LayerKind(window=self.layer_window(layer), rope=self.layer_rope(layer),
                         moe=self.is_moe(layer))

    def layer_norm_params(self) -> int:
        """Norm weights per layer: the pre-norms, post-norms and q/k norms it has."""
        d = self.embed_dim
        return 2 * d + (2 * d if self.post_norms else 0) + (2 * self.head_dim
                                                            if self.qk_norm else 0)

    def attention_params(self) -> int:
        """Parameters of one layer's attention: q/k/v/o and their biases, sinks."""
        d, h, n, k = self.embed_dim, self.head_dim, self.num_q_heads, self.num_kv_heads
        out = d * h * (n + 2 * k) + n * h * d
        if self.qkv_bias:
            out += h * (n + 2 * k)
        return out + (d if self.o_bias else 0) + (n if self.attention_sinks else 0)

    def expected_experts(self, rows: float) -> float:
        """Distinct experts a mixture layer reads for `rows` tokens when each picks k of E:
        E (1 - (1 - k/E)^rows) in expectation (0 without experts). What a step over them reads
        (`jaxinfer.model.moe`) and what the planner counts (`jaxinfer.perf.planner`)."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1 - (1 - k / e) ** rows) if e else 0.0

    def num_params(self) -> int:
        """Every parameter (a tied embedding counted once)."""
        return self._params(self.num_experts)

    def num_active_params(self, *, input_embedding: bool = True) -> int:
        """The parameters one token's forward uses: all but the experts its router does not
        pick (k of E per mixture layer). `input_embedding=False` leaves out the untied input
        embedding table, of which a token reads one row (model cards differ on counting it)."""
        total = self._params(self.experts_per_token)
        if not input_embedding and not self.tie_embeddings:
            total -= self.vocab_size * self.embed_dim
        return total

    def _params(self, experts: int) -> int:
        d = self.embed_dim
        layers = sum(self.attention_params() + self._mlp_params(i, experts)
                     + self.layer_norm_params() for i in range(self.num_layers))
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return layers + self.vocab_size * d + d + head


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Paged KV pool (docs/architecture.md, decision 3). `max_seq_len` caps prompt + output tokens;
    None = min(2048, the model's context), fixed by `resolved(model)`.

    hybrid: a model with sliding-window layers gives them a pool of their own, of
    `num_local_pages` pages, in which a sequence holds only the pages its window can still see
    (`jaxinfer.engine.scheduler`, "Hybrid pools"); False: every layer keeps full-length pages
    (the reference). No effect on a model without sliding windows.
    num_local_pages: None = max_slots x `local_pages_bound(window, page_size, chunk)` (every slot
    can prefill a chunk at once), at most num_pages.
    min_bucket_pages: the smallest page bucket a decode or verification step reads
    (`kv_cache.pages_bucket`: a power of two; a step with a prompt chunk keeps its own bucket,
    `BatchBuilder.chunk_pages`). Each page bucket is one more compiled variant of those steps;
    a floor spares the smallest ones at the price of reading (on the XLA path) a short
    sequence's KV padded to the floor. None = `auto_min_bucket_pages`, the largest floor whose
    padded reads at a full batch stay under 1/32 of a step's weight bytes.
    """

    page_size: int = 16
    num_pages: int | None = None  # None: max_slots * pages_per_seq (every slot reaches max_seq_len)
    max_seq_len: int | None = None
    dtype: str | None = None  # None: the model dtype; KV_DTYPES
    hybrid: bool = True
    num_local_pages: int | None = None
    min_bucket_pages: int | None = None

    def __post_init__(self):
        _check_fields(self)
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size!r} must be a positive power of two")
        least = self.min_bucket_pages
        if least is not None and (least <= 0 or least & (least - 1)):
            raise ValueError(f"min_bucket_pages={least!r} must be a positive power of two or "
                             f"None (auto)")
        if self.max_seq_len is not None and self.max_seq_len <= 0:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be > 0")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages={self.num_pages!r} must be > 0 or None")
        if self.num_local_pages is not None and self.num_local_pages <= 0:
            raise ValueError(f"num_local_pages={self.num_local_pages!r} must be > 0 or None")
        if self.dtype is not None and self.dtype not in KV_DTYPES:
            raise ValueError(f"cache dtype (--kv_dtype) {self.dtype!r} is not one of "
                             f"{KV_DTYPES} or None")

    def resolved(self, model: ModelConfig) -> CacheConfig:
        """This config with max_seq_len fixed: None -> min(2048, model context); a value over the
        model's context raises."""
        if self.max_seq_len is None:
            return dataclasses.replace(self, max_seq_len=min(2048, model.max_position))
        if self.max_seq_len > model.max_position:
            raise ValueError(f"cache max_seq_len={self.max_seq_len} exceeds the model's context "
                             f"max_position={model.max_position}")
        return self

    @property
    def pages_per_seq(self) -> int:  # P
        if self.max_seq_len is None:
            raise ValueError("max_seq_len is unset: call CacheConfig.resolved(model) first")
        return -(-self.max_seq_len // self.page_size)

    def local_window(self, model: ModelConfig) -> int | None:
        """The window of the local layers when they get a pool of their own (hybrid, and the
        model has sliding-window layers); None: one pool for every layer."""
        if not self.hybrid or not any(model.is_local(i) for i in range(model.num_layers)):
            return None
        return model.sliding_window

    def with_pools(self, model: ModelConfig, *, max_slots: int, chunk_size: int,
                   extra_tokens: int = 0) -> CacheConfig:
        """This config resolved (`resolved`) with its pool sizes fixed: num_pages (None:
        max_slots * pages_per_seq), hybrid, num_local_pages (None: each slot can write a
        chunk of `chunk_size` + `extra_tokens` speculative rows inside its window), and
        min_bucket_pages (None: `auto_min_bucket_pages`)."""
        cache = self.resolved(model)
        if cache.min_bucket_pages is None:
            cache = dataclasses.replace(
                cache, min_bucket_pages=auto_min_bucket_pages(model, cache, max_slots=max_slots))
        num_pages = cache.num_pages or max_slots * cache.pages_per_seq
        window = cache.local_window(model)
        local = None
        if window is not None:
            per_slot = local_pages_bound(window, cache.page_size, chunk_size + extra_tokens)
            local = cache.num_local_pages or min(num_pages,
                                                 max_slots * min(per_slot, cache.pages_per_seq))
        return dataclasses.replace(cache, num_pages=num_pages, num_local_pages=local)


# Bytes of one element of each activation / KV dtype (`KV_DTYPES`), and of each weight storage
# (`WEIGHT_DTYPES`: int4 packs two a byte).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}
WEIGHT_BYTES = {**DTYPE_BYTES, "int4": 0.5}


def kv_bytes_per_token(config: ModelConfig, cache_dtype_bytes: int) -> int:
    """K and V of one token over all layers: 2 * L * K * H * bytes."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * cache_dtype_bytes


# Bytes of a decode step's weights per byte its page-bucket floor may add to a full batch's KV
# reads (`auto_min_bucket_pages`): a floor that costs at most ~3% of a step.
MIN_BUCKET_WEIGHT_RATIO = 32


def auto_min_bucket_pages(model: ModelConfig, cache: CacheConfig, *, max_slots: int) -> int:
    """The largest power-of-two page count p (at most the pages of a sequence) for which
    `max_slots` rows of p pages of KV (every layer's K and V at the cache's dtype) weigh at
    most 1/`MIN_BUCKET_WEIGHT_RATIO` of the model's weights: e.g. 16 pages (256 tokens) for
    one row of SmolLM2-135M in f32, 2 at 8 rows, 1 at 64."""
    kv_token = kv_bytes_per_token(model, DTYPE_BYTES[cache.dtype or model.dtype])
    budget = model.num_params() * WEIGHT_BYTES[model.weights] / MIN_BUCKET_WEIGHT_RATIO
    least = 1
    while (2 * least <= cache.pages_per_seq
           and max_slots * 2 * least * cache.page_size * kv_token <= budget):
        least *= 2
    return least


def local_pages_bound(window: int, page_size: int, num_tokens: int) -> int:
    """Local pages a sequence holds at most in a hybrid pool during a step that writes
    `num_tokens` tokens: the blocks overlapping [q0 - window + 1, q0 + num_tokens - 1],
    ceil((window - 1 + num_tokens) / page_size) + 1 (decode: ceil(window / page_size) + 1)."""
    return -(-(window - 1 + num_tokens) // page_size) + 1


MAX_TREE_NODES = 64  # draft tree nodes at most (one verification row each)


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A static draft tree for speculative decoding (`EngineConfig.spec_tree`).

    Nodes 1..T; node 0 is the root, the slot's newest token (already sampled). `parents[i - 1]`
    is node i's parent. Nodes are numbered breadth first: a parent before its children and
    depth never decreasing, so every prefix 1..n of the nodes is a subtree (its nodes'
    ancestors are in it): a row drafts the first n nodes (`num_draft`), cut by the pages it
    could reserve or the tokens it may still emit (`nodes_within`). Siblings are in draft order
    (a drafter's top-1 first).

    Spellings (`parse`): "4,2,2,1" gives the root 4 children, each of those 2, each of those 2,
    each of those 1 (top-k per depth: 4 + 8 + 16 + 16 = 44 nodes, depth 4); "parents:0,0,1,1,2"
    lists each node's parent (here the root's 2 children, node 1's 2 children and node 2's one).
    A chain of R drafts is "1,...,1" (R ones).

    A node's K/V is written at its slot (the root's position + its index) and rotated at its
    position (the root's + its depth); its queries see the cached context and its ancestors
    (`ancestor_bits`). Hashable: jitted steps take it as a static argument.
    """

    parents: tuple[int, ...]

    def __post_init__(self):
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "parents", parents)
        if not 1 <= len(parents) <= MAX_TREE_NODES:
            raise ValueError(f"a draft tree needs 1 to {MAX_TREE_NODES} nodes; got "
                             f"{len(parents)} (parents={_clip(str(parents))})")
        depth = [0]
        for i, p in enumerate(parents, start=1):
            if not 0 <= p < i:
                raise ValueError(f"draft tree node {i} has parent {p}: a parent must be an "
                                 f"earlier node, 0 (the root) to {i - 1}")
            depth.append(depth[p] + 1)
            if depth[i] < depth[i - 1]:
                raise ValueError(
                    f"draft tree node {i} (depth {depth[i]}) follows a node of depth "
                    f"{depth[i - 1]}: number the nodes breadth first (depth never decreasing)")

    @classmethod
    def parse(cls, spec: str) -> DraftTree:
        """"b1,b2,..." (children per node at each depth) or "parents:p1,p2,..." (class doc)."""
        text = spec.strip()
        explicit = text.startswith("parents:")
        body = text[len("parents:"):] if explicit else text
        try:
            values = [int(v) for v in body.split(",")]
        except ValueError:
            raise ValueError(f"spec_tree={spec!r} is neither per-depth branching such as "
                             "'4,2,2,1' nor a parent list such as 'parents:0,0,1,1,2'") from None
        if explicit:
            return cls(parents=tuple(values))
        if any(b < 1 for b in values):
            raise ValueError(f"spec_tree={spec!r}: every depth's branching must be >= 1")
        parents, level = [], [0]
        for b in values:
            nxt = []
            for node in level:
                for _ in range(b):
                    parents.append(node)
                    nxt.append(len(parents))
                    if len(parents) > MAX_TREE_NODES:
                        raise ValueError(f"spec_tree={spec!r} has more than {MAX_TREE_NODES} "
                                         "nodes; lower the branching")
            level = nxt
        return cls(parents=tuple(parents))

    @property
    def num_nodes(self) -> int:  # T
        return len(self.parents)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of nodes 0..T (the root's is 0)."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return tuple(depth)

    @property
    def max_depth(self) -> int:  # D: the most drafts one verification can accept
        return self.depths[-1]

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of nodes 0..T, in draft order."""
        out = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents, start=1):
            out[p].append(i)
        return tuple(tuple(c) for c in out)

    @functools.cached_property
    def expanded(self) -> tuple[int, ...]:
        """The nodes with children (the root first), in order: the nodes a drafter runs to
        propose their children, and the rows of a tree's draft_probs."""
        return tuple(n for n, c in enumerate(self.children) if c)

    @property
    def words(self) -> int:  # W: i32 words of an ancestor bitmask
        return -(-(self.num_nodes + 1) // 32)

    def ancestors(self, node: int) -> tuple[int, ...]:
        """node and its ancestors, from the root (0) down."""
        path = [node]
        while path[-1]:
            path.append(self.parents[path[-1] - 1])
        return tuple(reversed(path))

    def ancestor_bits(self) -> np.ndarray:
        """i32[T + 1, W]: bit j % 32 of word j // 32 of row i is set iff node j is node i or an
        ancestor of it (the root, bit 0, is in every row): the keys node i's query sees among
        the tree's slots."""
        bits = np.zeros((self.num_nodes + 1, self.words), np.uint32)
        for i in range(self.num_nodes + 1):
            for j in self.ancestors(i):
                bits[i, j // 32] |= np.uint32(1 << (j % 32))
        return bits.view(np.int32)

    def nodes_within(self, depth: int) -> int:
        """How many nodes lie at depth <= `depth` (a prefix of the nodes)."""
        return sum(d <= depth for d in self.depths[1:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Static shapes of the jitted steps: slots, prefill buckets, attention implementation.

    attention_impl: "xla" = the jnp reference everywhere; "pallas" = the Pallas kernels for every
    row of a step (Mosaic on TPU, Triton on GPU, interpret mode on CPU: slow, for tests): a step
    holding a prompt chunk runs all its rows through the ragged flash kernel, a step without one
    (decode, verification) the paged decode kernel; "auto" = pallas on TPU/GPU, xla on CPU.
    """

    max_slots: int = 8
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    attention_impl: str = "auto"
    max_top_logprobs: int = 0  # static width of the optional top-n logprobs output
    # Serving engine (jaxinfer.engine.engine, docs/architecture.md, decision 6).
    max_num_batched_tokens: int = 512  # token budget of one step (chunks + decodes)
    prefill_chunk_size: int | None = None  # per request per step; None: min(256, top bucket)
    enable_prefix_caching: bool = True
    scheduling_policy: str = "continuous"  # or "static" (admit a batch when the last is done)
    # Fraction of the KV pool admission keeps free for the running requests' decoding
    # (`jaxinfer.engine.scheduler` module doc, `scheduler.admission_reserve`); vLLM's watermark.
    admission_watermark: float = 0.01
    # Speculative decoding (jaxinfer.engine.speculative, docs/architecture.md, decision 5).
    # none | ngram | draft (needs a draft model) | self | eagle (needs a draft head)
    speculative_method: str = "none"
    num_speculative_tokens: int = 4  # R: drafts per slot per step (static width of verify_step)
    ngram_max: int = 4  # prompt lookup: longest suffix matched
    ngram_min: int = 2  # ... shortest (1 drafts on any repeated token: mostly rejected)
    self_spec_layers: int | None = None  # self-speculative draft depth; None: num_layers // 4
    # LoRA adapters (jaxinfer.engine.adapters; docs/architecture.md, decision 18): the pool holds
    # max_loras adapters of rank <= max_lora_rank (0: no pool, requests cannot name adapters).
    max_loras: int = 0
    max_lora_rank: int = 16
    # A static draft tree (`DraftTree.parse`: "4,2,2,1" or "parents:0,0,1,..."), verified in one
    # step with a tree mask; it replaces num_speculative_tokens. None: chains of R drafts.
    spec_tree: str | None = None
    # EAGLE chain drafts cut by the head's confidence (`jaxinfer.engine.eagle.EagleDrafter`):
    # a draft is verified only while the head's probability of the chain up to it is at least
    # this; the step verifies as wide as its longest kept chain. 0: every chain is R long.
    draft_confidence: float = 0.0

    def __post_init__(self):
        _check_fields(self)
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method={self.speculative_method!r} must be one of "
                             f"{SPECULATIVE_METHODS}")
        if self.spec_tree is not None:
            DraftTree.parse(self.spec_tree)
            if self.speculative_method not in TREE_METHODS:
                raise ValueError(f"spec_tree={self.spec_tree!r} needs a drafter that drafts "
                                 f"trees: speculative_method one of {TREE_METHODS}, got "
                                 f"{self.speculative_method!r}")
        if not 0 <= self.draft_confidence < 1:
            raise ValueError(f"draft_confidence={self.draft_confidence} must be in [0, 1) "
                             "(0: chains of R drafts)")
        if self.draft_confidence and (self.speculative_method != "eagle"
                                      or self.spec_tree is not None):
            raise ValueError(f"draft_confidence={self.draft_confidence} cuts EAGLE chain "
                             f"drafts: it needs speculative_method='eagle' without spec_tree, "
                             f"got speculative_method={self.speculative_method!r}, "
                             f"spec_tree={self.spec_tree!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in "
                             "[1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram sizes need 1 <= ngram_min <= ngram_max; got "
                             f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}")
        if self.max_slots <= 0:
            raise ValueError(f"max_slots={self.max_slots!r} must be > 0")
        buckets = tuple(self.prefill_buckets)
        if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"prefill_buckets={buckets} must be positive, strictly increasing")
        object.__setattr__(self, "prefill_buckets", buckets)
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r} is not one of "
                             f"{ATTENTION_IMPLS}")
        if not 0 <= self.max_top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"max_top_logprobs={self.max_top_logprobs} must be in "
                             f"[0, {MAX_TOP_LOGPROBS}]")
        if self.prefill_chunk_size is not None and not (
                0 < self.prefill_chunk_size <= buckets[-1]):
            raise ValueError(f"prefill_chunk_size={self.prefill_chunk_size} must be in "
                             f"[1, {buckets[-1]}] (the largest prefill bucket)")
        if self.max_num_batched_tokens < self.max_slots:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_slots={self.max_slots} (each running request decodes a token "
                             "per step)")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be one of "
                             f"{SCHEDULING_POLICIES}")
        if self.max_loras < 0 or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_loras={self.max_loras} must be >= 0 (0: no adapters) and "
                             f"max_lora_rank={self.max_lora_rank} in [1, {MAX_LORA_RANK}]")
        if not 0 <= self.admission_watermark < 1:
            raise ValueError(f"admission_watermark={self.admission_watermark} must be in [0, 1) "
                             "(a fraction of the KV pool's pages)")

    @functools.cached_property
    def draft_tree(self) -> DraftTree | None:
        """The parsed `spec_tree` (None: chain drafts)."""
        return None if self.spec_tree is None else DraftTree.parse(self.spec_tree)

    @property
    def spec_width(self) -> int:
        """Draft tokens a verification holds per slot: the tree's nodes, or R."""
        tree = self.draft_tree
        return self.num_speculative_tokens if tree is None else tree.num_nodes

    @property
    def chunk_size(self) -> int:
        """`prefill_chunk_size`, or min(256, the largest prefill bucket) when unset."""
        if self.prefill_chunk_size is not None:
            return self.prefill_chunk_size
        return min(256, self.prefill_buckets[-1])


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Per-request sampling parameters; the steps see them as traced per-row arrays.

    temperature 0 = greedy. top_k 0 = off. top_p 1 = off. min_p 0 = off. Penalties follow
    Hugging Face (repetition, over prompt + output) and OpenAI (presence/frequency, over output).

    Constraints (structured output, at most one per request; `jaxinfer.engine.constraints`):
    the output must match `json_schema` (a JSON Schema, as JSON text), `regex`, one of `choice`,
    or `grammar` (a Lark grammar, llguidance's dialect). The engine masks every token the
    constraint forbids before sampling, in every sampling mode, and allows EOS only where the
    constraint is complete; a request that reaches `max_new_tokens` first finishes with
    "length" and its output may be incomplete. The syntax of a regex or grammar and the
    validity of a schema are checked at `Engine.add_request` (they need the tokenizer).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Prompt logprobs (vLLM's `prompt_logprobs`): the logprob of every prompt token after the
    # first under the model's raw distribution, with this many top alternatives (0: just the
    # token's); None = off. Such a request computes its whole prompt (no prefix-cache hits).
    prompt_logprobs: int | None = None
    # n samples of the prompt, sample i seeded `seed + i`; the engine prefills the prompt once
    # and forks (shared pages, copy-on-write of the partial last page).
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] = ()
    grammar: str | None = None
    # The LoRA adapter the request runs with (a name the engine has registered:
    # `Engine.add_lora`); None = the base model.
    lora: str | None = None

    def __post_init__(self):
        _check_fields(self)
        self._check_constraint()
        if self.lora == "":
            raise ValueError("lora='' is empty (None = the base model)")
        if not 1 <= self.n <= 4096:
            raise ValueError(f"n={self.n} must be in [1, 4096] (samples of the prompt)")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed={self.seed} must be in [0, 2**31)")
        if self.seed + self.n - 1 >= 2**31:
            raise ValueError(f"seed={self.seed} + n={self.n} - 1 must be < 2**31 (sample i is "
                             "seeded seed + i)")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)} must be a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 <= self.top_k < 2**31:  # the steps hold it as int32
            raise ValueError(f"top_k={self.top_k} must be >= 0 and < 2**31 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be > 0")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={self.top_logprobs} must be in "
                             f"[0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs} must be None (off) or in "
                             f"[0, {MAX_TOP_LOGPROBS}]")
        if "" in self.stop:
            raise ValueError(f"stop={list(self.stop)!r}: a stop string must not be empty")

    def _check_constraint(self) -> None:
        named = [name for name in CONSTRAINTS if getattr(self, name)]
        if len(named) > 1:
            raise ValueError(f"{' and '.join(named)} are both set: a request takes at most one "
                             f"constraint of {CONSTRAINTS}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON ({e}): "
                                 f"{_clip(self.json_schema)}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object (a JSON Schema), got "
                                 f"{_clip(self.json_schema)}")
        if "" in self.choice:
            raise ValueError(f"choice={list(self.choice)!r}: a choice must not be empty")
        for name in ("regex", "grammar", "json_schema"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}='' is empty (unset it instead)")
        if named and self.ignore_eos:
            raise ValueError(f"{named[0]} with ignore_eos=True: a constrained request ends "
                             "with EOS where its constraint is complete")

    @property
    def constraint(self) -> str | None:
        """The name of the constraint field that is set, or None."""
        return next((name for name in CONSTRAINTS if getattr(self, name)), None)

    @property
    def has_penalties(self) -> bool:
        """A repetition, presence or frequency penalty is on. Such a request's penalty state
        needs every token of its sequence to pass through its slot: it takes nothing from the
        prefix cache and its samples are not forked."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def cacheable(self) -> bool:
        """May start from cached prefix pages: not with penalties (`has_penalties`), nor with
        prompt logprobs (a cached prompt row is never computed, so it has no logits)."""
        return not self.has_penalties and self.prompt_logprobs is None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a CLI run resolves to. `model_path` None = the embedded default GGUF."""

    model_path: str | None = None
    # Draft model of engine.speculative_method="draft" (any checkpoint the loader reads; it
    # must share the target's tokenizer).
    draft_model_path: str | None = None
    # LoRA adapters served beside the model, "name=path" (a PEFT adapter directory) each.
    lora_modules: tuple[str, ...] = ()
    # Draft head of engine.speculative_method="eagle": an EAGLE / EAGLE-3 checkpoint directory
    # (config.json + safetensors, as published; scripts/train_draft_head.py exports its heads
    # so), made for the target (`jaxinfer.checkpoint.eagle`).
    draft_head_path: str | None = None
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on TPU/GPU
    # Weight storage (`jaxinfer.model.quant`): None = dtype; int8 / int4 quantize at load.
    weight_dtype: str | None = None
    # Device mesh (jaxinfer.sharding): None = one device; "data:D,model:M" or
    # "data:D,expert:E,model:M" (a mixture's experts over E); "auto" = every device on the
    # model axis (tensor parallel).
    mesh: str | None = None
    # The layer stack's layout (`ModelConfig.scan_layers`): "true" scanned, "false" unrolled,
    # "auto" per platform (`resolve_scan_layers`).
    scan_layers: str = "auto"
    multihost: bool = False  # call jax.distributed.initialize() first (auto on TPU VM slices)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)

    def __post_init__(self):
        _check_fields(self)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES} or None")
        if self.weight_dtype is not None and self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype {self.weight_dtype!r} is not one of "
                             f"{WEIGHT_DTYPES} or None")
        if self.scan_layers not in SCAN_LAYERS:
            raise ValueError(f"scan_layers={self.scan_layers!r} is not one of {SCAN_LAYERS}")
        self.lora_paths()  # raises for a malformed entry

    def lora_paths(self) -> dict[str, str]:
        """`lora_modules` as adapter name -> directory; ValueError naming a malformed entry or
        a name given twice."""
        out: dict[str, str] = {}
        for entry in self.lora_modules:
            name, eq, path = entry.partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules entry {entry!r} must be name=path (a PEFT "
                                 "adapter directory)")
            if name.strip() in out:
                raise ValueError(f"lora_modules names adapter {name.strip()!r} twice")
            out[name.strip()] = path.strip()
        return out

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _clip(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def resolve_scan_layers(option: str, platform: str) -> bool:
    """`RunConfig.scan_layers` for devices of `platform` (jax's name: "cpu", "tpu", "gpu", or a
    deviceless target's "cuda"): "auto" scans on SCANNED_PLATFORMS and unrolls elsewhere
    (a LoRA adapter pool works in either layout, `jaxinfer.model.lora`)."""
    if option not in SCAN_LAYERS:
        raise ValueError(f"scan_layers={option!r} is not one of {SCAN_LAYERS}")
    if option == "auto":
        return platform in SCANNED_PLATFORMS
    return option == "true"


def check_data_split(*, max_slots: int, num_pages: int, data_shards: int) -> None:
    """Raises ValueError unless the slots and the KV pool split evenly over the mesh's "data"
    axis: each data shard serves an equal group of slots from its own part of the pool."""
    if max_slots % data_shards or num_pages % data_shards:
        raise ValueError(
            f"max_slots={max_slots} and num_pages={num_pages} must both be divisible by the "
            f"mesh's data axis ({data_shards}): each data shard serves an equal group of slots "
            f"from its own part of the KV pool; e.g. max_slots="
            f"{-(-max_slots // data_shards) * data_shards}, num_pages="
            f"{-(-num_pages // data_shards) * data_shards}")


# Presets: named overrides of RunConfig sections, looked up by exact name.
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "model_path": None,
        "cache": {"page_size": 16, "max_seq_len": 2048},
        "engine": {"max_slots": 8},
    },
    "smollm2-135m-cpu-bench": {
        "model_path": None,
        "dtype": "float32",
        "cache": {"page_size": 16, "max_seq_len": 2304},
        "engine": {"max_slots": 64, "prefill_buckets": [128, 512, 2048]},
    },
}

_SECTIONS = {"cache": CacheConfig, "engine": EngineConfig, "sampling": SamplingConfig}


def merge(base: RunConfig, overrides: Mapping[str, Any], *, source: str,
          lines: Mapping[str, int] | None = None,
          labels: Mapping[str, str] | None = None) -> RunConfig:
    """`base` with `overrides` (a nested mapping, as in YAML) applied. Every error names
    `source`, the line of the key where `lines` (dotted key -> line) knows it, the key (as
    `labels` names it, e.g. its flag; default the dotted key), the bad value and what is
    valid."""
    changes = dict(overrides) if isinstance(overrides, Mapping) else overrides
    if isinstance(changes, dict) and isinstance(changes.get("scan_layers"), bool):
        # YAML reads an unquoted `scan_layers: true` as a boolean
        changes["scan_layers"] = "true" if changes["scan_layers"] else "false"
    for key in _SECTIONS:
        if isinstance(overrides, Mapping) and key in overrides:
            changes[key] = replace_checked(getattr(base, key), overrides[key], source=source,
                                           prefix=f"{key}.", lines=lines, labels=labels)
    return replace_checked(base, changes, source=source, lines=lines, labels=labels)


def replace_checked(obj: Any, values: Any, *, source: str, prefix: str = "",
                    lines: Mapping[str, int] | None = None,
                    labels: Mapping[str, str] | None = None) -> Any:
    """Config dataclass `obj` with the fields in mapping `values` replaced, each checked
    against its annotation first. Errors name `source`, the line and the field (see `merge`;
    a field's key is `prefix` + its name)."""
    names = [f.name for f in dataclasses.fields(obj)]

    def where(key: str) -> str:
        line = (lines or {}).get(key)
        return f"{source}, line {line}" if line else source

    if not isinstance(values, Mapping):
        raise ValueError(f"{where(prefix[:-1])}: {prefix[:-1] or 'the config'} must be a "
                         f"mapping with keys from {names}, got {values!r}")
    unknown = [k for k in values if k not in names]
    if unknown:
        raise ValueError(f"{where(prefix + str(unknown[0]))}: unknown key "
                         f"{prefix}{unknown[0]!s}; valid keys: {names}")
    checked = {}
    for key, value in values.items():
        try:
            checked[key] = check_field(type(obj), key, value,
                                       label=(labels or {}).get(prefix + key, prefix + key))
        except ValueError as e:
            raise ValueError(f"{where(prefix + key)}: {e}") from None
    try:
        return dataclasses.replace(obj, **checked)
    except ValueError as e:
        # A range or cross-field check names its fields as `name=value`: point at the first
        # one this source set (its own line), else at the section; the label adds the section
        # or the flag that the message's own `name=` lacks.
        key = next((m for m in re.findall(r"\b(\w+)=", str(e)) if m in values), None)
        if key is None:
            label = prefix[:-1]
        else:
            label = (labels or {}).get(prefix + key, prefix + key if prefix else "")
        at = f" ({label})" if label else ""
        raise ValueError(f"{where(prefix + key if key else prefix[:-1])}{at}: {e}") from None


def preset(name: str) -> dict[str, Any]:
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown preset {short_repr(name)}; valid presets: "
                         f"{sorted(PRESETS)}")
    return PRESETS[name]


def load_yaml(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """A YAML run config: (its mapping, the line of each dotted key). A file that cannot be
    read or parsed raises ValueError naming it (and the line, for a syntax error)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"config file {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
        lines = _key_lines(yaml.compose(text))
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # also a bad date, deep nesting
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"config file {path}: not valid YAML: "
                         f"{getattr(e, 'problem', None) or e}{at}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data, lines


def _key_lines(node: Any, prefix: str = "", seen: frozenset[int] = frozenset()
               ) -> dict[str, int]:
    """Dotted key -> line of every mapping key under `node`; an alias back to a node being
    walked (a self-referencing YAML alias) is not followed again."""
    import yaml

    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode) and id(node) not in seen:
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                out[prefix + str(key.value)] = key.start_mark.line + 1
                out.update(_key_lines(value, f"{prefix}{key.value}.", seen | {id(node)}))
    return out
