"""GGUF checkpoints (llama.cpp) -> ModelConfig + HF-named, HF-layout tensors, decoded on demand.

GGUF stores each matrix with `ne = [in, out]`, i.e. numpy row-major `[out, in]`, the same layout as
a HF `nn.Linear.weight`. llama.cpp's converter permutes the rows of attn_q / attn_k (and their
biases) of the "llama" architecture so that RoPE pairs adjacent dims (2j, 2j+1); we undo that to
get HF `rotate_half` pairing (j, j + H/2), exactly as transformers' GGUF loader does. Qwen2 GGUFs
use NEOX RoPE and are stored unpermuted.
"""

from __future__ import annotations

import math
import os

import gguf
import numpy as np

from jaxinfer.checkpoint import quants, requant
from jaxinfer.config import ModelConfig, RopeConfig
from jaxinfer.model import quant

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")  # Mistral GGUFs use "llama"
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def open_reader(path: str) -> gguf.GGUFReader:
    """gguf.GGUFReader (memory-mapped), with truncation/corruption reported as one ValueError."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # GGUFReader raises ValueError/IndexError/struct errors on bad bytes
        raise ValueError(f"GGUF file {path} is truncated or corrupt: "
                         f"{type(e).__name__}: {e}") from e


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """All key/values as plain Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF name; None for names we do not map (e.g. rope_freqs.weight)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of attn_q/attn_k rows: interleaved pairs -> rotate_half pairs.

    Args:
      w: f32[num_heads*H, ...] rows as stored in the GGUF (a weight [n*H, D] or a bias [n*H]).
    Returns:
      f32[num_heads*H, ...] rows in HF order (transformers' `reverse_permute`).
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _get(md: dict, arch: str, key: str, default=None):
    value = md.get(f"{arch}.{key}", default)
    if isinstance(value, float):  # GGUF stores f32: use its shortest decimal (1e-05, not 9.99e-06)
        value = float(str(np.float32(value)))
    return value


def config_from_gguf(md: dict, tensor_names: set[str],
                     rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """GGUF metadata (+ tensor names, the optional `rope_freqs.weight` f32[H/2]) -> ModelConfig."""
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (Mistral GGUFs use llama)")
    embed_dim = int(_get(md, arch, "embedding_length"))
    num_q_heads = int(_get(md, arch, "attention.head_count"))
    vocab = _get(md, arch, "vocab_size") or len(md.get("tokenizer.ggml.tokens") or ())
    head_dim = (_get(md, arch, "attention.key_length") or _get(md, arch, "rope.dimension_count")
                or embed_dim // num_q_heads)
    theta = float(_get(md, arch, "rope.freq_base", 10000.0))
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        embed_dim=embed_dim,
        num_layers=int(_get(md, arch, "block_count")),
        num_q_heads=num_q_heads,
        num_kv_heads=int(_get(md, arch, "attention.head_count_kv") or num_q_heads),
        head_dim=int(head_dim),
        ffn_dim=int(_get(md, arch, "feed_forward_length")),
        rms_norm_eps=float(_get(md, arch, "attention.layer_norm_rms_epsilon", 1e-5)),
        rope=_rope_from_gguf(md, arch, theta, int(head_dim), rope_freqs),
        max_position=int(_get(md, arch, "context_length", 4096)),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
    )


def _rope_from_gguf(md: dict, arch: str, theta: float, head_dim: int,
                    rope_freqs: np.ndarray | None) -> RopeConfig:
    kind = _get(md, arch, "rope.scaling.type", "none")
    factor = _get(md, arch, "rope.scaling.factor") or _get(md, arch, "rope.scale_linear")
    if rope_freqs is not None:
        return llama3_rope_from_freqs(theta, head_dim, rope_freqs)
    if kind == "linear" or (kind == "none" and factor not in (None, 1.0)):
        return RopeConfig(theta=theta, type="linear", factor=float(factor))
    if kind == "none":
        return RopeConfig(theta=theta)
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r} ({arch}.rope.scaling.type); "
                     "supported: none, linear, and llama3 via rope_freqs.weight")


def llama3_factors(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` f32[H/2] for a llama3 RopeConfig: frequency i is divided by it."""
    inv_freq = rope.theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = rope.original_max_position
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                         - rope.low_freq_factor)
    mid = 1 / ((1 - smooth) / rope.factor + smooth)
    out = np.where(wavelen < orig / rope.high_freq_factor, 1.0, mid)
    return np.where(wavelen > orig / rope.low_freq_factor, rope.factor, out)


def llama3_rope_from_freqs(theta: float, head_dim: int, freqs: np.ndarray) -> RopeConfig:
    """Recover RopeConfig(type="llama3") from a GGUF `rope_freqs.weight` f32[H/2].

    Only the ratios original_max_position / {low,high}_freq_factor affect the frequencies, so we
    fix low_freq_factor = 1 (as every Llama 3.x release does) and solve the linear ramp of the
    in-between band for the other two; the result is checked by recomputing the factors.
    """
    freqs = np.asarray(freqs, np.float64).reshape(-1)
    factor = float(freqs.max())
    if np.allclose(freqs, 1.0):
        return RopeConfig(theta=theta)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    if freqs.shape != inv_freq.shape or mid.sum() < 2:
        raise ValueError("cannot derive llama3 rope parameters from GGUF tensor rope_freqs.weight "
                         f"(shape {freqs.shape}, head_dim {head_dim}, {int(mid.sum())} ramp "
                         "points); convert the model from its Hugging Face checkpoint instead")
    smooth = (1 / freqs[mid] - 1 / factor) / (1 - 1 / factor)  # = a / wavelen - b
    a, minus_b = np.polyfit(inv_freq[mid] / (2 * math.pi), smooth, 1)
    high = round(float(1 - 1 / minus_b), 4)  # b = low / (high - low) with low = 1
    rope = RopeConfig(theta=theta, type="llama3", factor=round(factor, 4), low_freq_factor=1.0,
                      high_freq_factor=high, original_max_position=round(float(a * (high - 1))))
    if not np.allclose(llama3_factors(rope, head_dim), freqs, rtol=1e-4):
        raise ValueError(f"GGUF tensor rope_freqs.weight does not match a llama3 rope ({rope})")
    return rope


def _shape(tensor) -> tuple[int, ...]:
    """numpy row-major shape of a ReaderTensor (GGUF `ne` reversed)."""
    return tuple(int(s) for s in reversed(tensor.shape.tolist()))


def _dequantize(tensor) -> np.ndarray:
    """One ReaderTensor -> f32 in numpy row-major shape."""
    try:
        return quants.dequantize(tensor.data, tensor.tensor_type, _shape(tensor))
    except ValueError as e:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {e}") from e


class GGUFTensor:
    """One tensor of a memory-mapped GGUF in HF layout, decoded only when asked: `dequantized()`
    (f32) or `quantized(kind, group)` (a `quant.QTensor`, `requant.from_gguf`), with llama.cpp's
    q/k row permutation undone either way (`unpermute_heads`: the heads of a permuted tensor)."""

    def __init__(self, tensor, unpermute_heads: int | None = None):
        self.tensor, self.unpermute_heads = tensor, unpermute_heads
        self.shape = _shape(tensor)

    def dequantized(self) -> np.ndarray:
        w = _dequantize(self.tensor)
        return w if self.unpermute_heads is None else unpermute_rope(w, self.unpermute_heads)

    def quantized(self, kind: str, group: int) -> quant.QTensor:
        try:
            t = requant.from_gguf(self.tensor.data, self.tensor.tensor_type, self.shape, kind,
                                  group)
        except ValueError as e:
            raise ValueError(f"GGUF tensor {self.tensor.name!r}: {e}") from e
        if self.unpermute_heads is None:
            return t
        heads = self.unpermute_heads
        return quant.transform(t, t.shape, t.contract, lambda a, _: unpermute_rope(a, heads))


def read_gguf(path: str) -> tuple[ModelConfig, dict[str, GGUFTensor], dict]:
    """A .gguf file -> (config, HF-named `GGUFTensor`s in HF layout, metadata dict)."""
    reader = open_reader(path)
    md = read_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    rope_freqs = by_name.get("rope_freqs.weight")
    rope_freqs = None if rope_freqs is None else _dequantize(rope_freqs)
    config = config_from_gguf(md, set(by_name), rope_freqs)
    unknown = sorted(n for n in by_name if hf_name(n) is None and n != "rope_freqs.weight")
    if unknown:
        raise ValueError(f"{path}: unexpected GGUF tensor(s) {unknown[:5]}")
    tensors = {}
    for name, tensor in by_name.items():
        hf = hf_name(name)
        if hf is None:
            continue
        heads = None
        if config.arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config.num_q_heads if "attn_q" in name else config.num_kv_heads
            rows = _shape(tensor)[0]
            if rows % (2 * heads):
                raise ValueError(f"{path}: tensor {name!r} has shape {_shape(tensor)}; rows not "
                                 f"divisible by 2 * {heads} heads")
        tensors[hf] = GGUFTensor(tensor, heads)
    return config, tensors, md
