"""Hugging Face checkpoints: config.json <-> ModelConfig; a torch-free safetensors reader/writer.

safetensors layout: u64 little-endian header length n, n bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then raw
row-major data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from jaxinfer import families
from jaxinfer.config import ModelConfig

# Integer and boolean tensors are index tables (an EAGLE-3 head's d2t / t2d vocabulary maps).
_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
           "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
           "I32": np.dtype(np.int32), "BOOL": np.dtype(np.bool_)}
_DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
INDEX_FILE = "model.safetensors.index.json"


def config_from_hf(cfg: dict) -> ModelConfig:
    """A Hugging Face config.json dict -> ModelConfig, by the family its `model_type` /
    `architectures` select (`jaxinfer.families`)."""
    return families.for_hf_config(cfg).from_hf(cfg)


def _special_tokens(metadata: dict) -> dict:
    """bos/eos/pad ids from GGUF metadata (tokenizer.ggml.*) or a HF config dict."""
    out = {}
    for key in ("bos", "eos", "pad"):
        for src in (f"tokenizer.ggml.{key}_token_id",
                    "tokenizer.ggml.padding_token_id" if key == "pad" else "",
                    f"{key}_token_id"):
            if metadata.get(src) is not None:
                out[f"{key}_token_id"] = metadata[src]
                break
    return out


def config_to_hf(config: ModelConfig, *, dtype: str = "float32",
                 metadata: dict | None = None) -> dict:
    """ModelConfig -> a config.json dict that transformers and `config_from_hf` both read."""
    cfg = families.family(config.arch).to_hf(config)
    cfg["torch_dtype"] = dtype
    cfg.update(_special_tokens(metadata or {}))
    return cfg


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Memory-map one .safetensors file -> {name: array} (F32, F16, BF16, I64, I32, BOOL).

    Raises ValueError naming the file (and tensor) when it is truncated or malformed.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"safetensors file {path} is truncated: {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"safetensors file {path} is truncated: header needs {n} bytes, "
                             f"file has {size - 8} after the length")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"safetensors file {path} has a corrupt header: {e}") from e
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    mm = np.memmap(path, dtype=np.uint8, mode="r") if header else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}; supported: "
                             f"{sorted(_DTYPES)}")
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end > data_len:
            raise ValueError(f"safetensors file {path} is truncated: tensor {name!r} needs bytes "
                             f"[{begin}, {end}) of a {data_len}-byte data section")
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} byte range [{begin}, {end}) does not "
                             f"match {info['dtype']}{list(shape)}")
        start = 8 + n + begin
        out[name] = mm[start:start + end - begin].view(dtype).reshape(shape)
    return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write {name: F32/F16/BF16/I64/I32/BOOL array} as one .safetensors file (header padded
    to 8 bytes)."""
    names = {v: k for k, v in _DTYPES.items()}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, arr in tensors.items():
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def read_json(path: str) -> Any:
    """A JSON file's value; a file that cannot be read or parsed raises ValueError naming it
    (and the line and column of a syntax error)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None


def read_hf(path: str) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """A HF directory -> (config, HF-named tensors, config.json dict)."""
    config_path = os.path.join(path, "config.json")
    cfg = read_json(config_path)
    try:
        if not isinstance(cfg, dict):
            raise ValueError(f"expected a JSON object, got {type(cfg).__name__}")
        config = config_from_hf(cfg)
    except KeyError as e:
        raise ValueError(f"{config_path}: missing key {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_path}: {e}") from None
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: expected an object with a \"weight_map\" object")
        files = sorted(set(map(str, weight_map.values())))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor {INDEX_FILE}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(path, name)))
    return config, tensors, cfg


def write_hf(out_dir: str, hf_config: dict, tensors: dict[str, np.ndarray], *, dtype: str,
             max_shard_bytes: int | None = None) -> None:
    """Write config.json and the tensors (cast to `dtype`), sharded past `max_shard_bytes`."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported save dtype {dtype!r}; supported: {sorted(_DTYPE_NAMES)}")
    np_dtype = _DTYPES[_DTYPE_NAMES[dtype]]
    tensors = {k: np.asarray(v).astype(np_dtype) for k, v in tensors.items()}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if max_shard_bytes and shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0])
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(out_dir, file), shard)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
