"""Config dataclasses, presets, YAML and flags: the one flag table, precedence, loud failures.

Precedence (lowest first): dataclass default < preset < YAML (`--config`) < flag (STYLE rule 7).
"""

import dataclasses
import glob
import json
import os
import typing

import pytest
from absl import flags as absl_flags

from jaxinfer import config as cfg
from jaxinfer.cli import flags as jflags
from tests.helpers import toy_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = {"cache": cfg.CacheConfig, "engine": cfg.EngineConfig, "sampling": cfg.SamplingConfig}

# Flag kind -> the field types it can feed (None allowed where the field is optional).
KIND_TYPES = {
    "str": {str, str | None},
    "int": {int, int | None},
    "float": {float},
    "bool": {bool},
    "list_int": {tuple[int, ...]},
    "list_str": {tuple[str, ...]},
    "enum": {str, str | None},
}


def _leaf(path: str) -> tuple[type, str, type]:
    """(owning dataclass, field name, resolved field type) of a dotted RunConfig path."""
    owner = cfg.RunConfig
    *sections, name = path.split(".")
    for s in sections:
        owner = typing.get_type_hints(owner)[s]
    return owner, name, typing.get_type_hints(owner)[name]


def _leaf_paths() -> list[str]:
    out = []
    for f in dataclasses.fields(cfg.RunConfig):
        if f.name in SECTIONS:
            out += [f"{f.name}.{g.name}" for g in dataclasses.fields(SECTIONS[f.name])]
        else:
            out.append(f.name)
    return out


def _parse(*argv: str) -> absl_flags.FlagValues:
    fv = absl_flags.FlagValues()
    jflags.define_flags(fv)
    fv(["prog", *argv])
    return fv


def _resolve(*argv: str) -> cfg.RunConfig:
    return jflags.resolve_config(_parse(*argv))


def _write(tmp_path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ----- the flag table ---------------------------------------------------------------------------
def test_every_flag_maps_to_a_leaf_field_of_a_matching_type():
    names = [row[0] for row in jflags.FLAG_TABLE]
    paths = jflags.table_paths()
    assert len(names) == len(set(names)), "duplicate flag names"
    assert len(paths) == len(set(paths)), "two flags map to one field"
    assert not {"preset", "config"} & set(names)
    for name, kind, path, help_ in jflags.FLAG_TABLE:
        assert jflags.field_exists(path), f"--{name} maps to missing field {path!r}"
        owner, field, typ = _leaf(path)
        assert not dataclasses.is_dataclass(typ), f"--{name} maps to a whole section {path!r}"
        assert typ in KIND_TYPES[kind.split(":")[0]], f"--{name}: kind {kind} vs {path}: {typ}"
        assert help_
        if kind.startswith("enum:"):  # every enum value is one the field accepts
            for value in kind[5:].split(","):
                cfg.merge(cfg.RunConfig(), _nested(path, value), source=f"--{name}")


def _nested(path: str, value) -> dict:
    *sections, field = path.split(".")
    out = {field: value}
    for s in reversed(sections):
        out = {s: out}
    return out


def test_every_config_field_has_a_flag():
    missing = sorted(set(_leaf_paths()) - set(jflags.table_paths()))
    assert not missing, f"config fields without a flag: {missing}"


def test_field_exists_rejects_bad_paths():
    assert jflags.field_exists("sampling.top_p")
    for bad in ("sampling.nope", "nope", "model_path.x", "cache.page_size.x"):
        assert not jflags.field_exists(bad), bad


def test_flags_default_to_unset():
    fv = _parse()
    assert all(fv[name].value is None for name, *_ in jflags.FLAG_TABLE)
    assert jflags.overrides_from_flags(fv) == {}
    assert jflags.resolve_config(fv) == cfg.RunConfig()
    jflags.define_flags(fv)  # idempotent per FlagValues


# ----- precedence -------------------------------------------------------------------------------
BENCH = "smollm2-135m-cpu-bench"


def test_preset_overrides_defaults():
    run = _resolve(f"--preset={BENCH}")
    assert run.dtype == "float32"
    assert run.cache.max_seq_len == 2304
    assert run.engine.max_slots == 64 and run.engine.prefill_buckets == (128, 512, 2048)
    assert run.sampling == cfg.SamplingConfig()


def test_yaml_overrides_preset_and_flags_override_yaml(tmp_path):
    path = _write(tmp_path, f"""
preset: {BENCH}
engine:
  max_slots: 4
sampling:
  temperature: 0.5
  top_k: 3
  stop: ["\\n\\n", "END"]
""")
    run = _resolve(f"--config={path}")
    assert run.engine.max_slots == 4  # YAML over preset
    assert run.engine.prefill_buckets == (128, 512, 2048)  # preset over default
    assert run.cache.max_seq_len == 2304 and run.dtype == "float32"
    assert run.cache.page_size == cfg.CacheConfig().page_size  # default
    assert (run.sampling.temperature, run.sampling.top_k) == (0.5, 3)
    assert run.sampling.stop == ("\n\n", "END")

    run = _resolve(f"--config={path}", "--top_k=5", "--max_slots=2", "--prefill_buckets=8,16",
                   "--stop=x,y", "--logprobs", "--dtype=bfloat16")
    assert (run.sampling.temperature, run.sampling.top_k) == (0.5, 5)  # flag over YAML
    assert run.engine.max_slots == 2 and run.engine.prefill_buckets == (8, 16)
    assert run.sampling.stop == ("x", "y") and run.sampling.logprobs is True
    assert run.dtype == "bfloat16" and run.cache.max_seq_len == 2304


def test_preset_flag_overrides_preset_in_yaml(tmp_path):
    path = _write(tmp_path, f"preset: {BENCH}\nsampling:\n  seed: 7\n")
    run = _resolve(f"--config={path}", "--preset=smollm2-135m")
    assert run.cache.max_seq_len == 2048 and run.engine.max_slots == 8  # --preset's values
    assert run.dtype is None and run.sampling.seed == 7  # the YAML still applies


def test_bool_flag_can_set_false_over_yaml(tmp_path):
    path = _write(tmp_path, "sampling:\n  ignore_eos: true\n")
    assert _resolve(f"--config={path}").sampling.ignore_eos is True
    assert _resolve(f"--config={path}", "--noignore_eos").sampling.ignore_eos is False


# ----- loud failures ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, key", [
    ("max_slot: 4\n", "max_slot"),
    ("sampling:\n  temprature: 0.5\n", "temprature"),
    ("engine:\n  max_slots: 4\n  bucket: [16]\n", "bucket"),
])
def test_unknown_yaml_keys_fail(tmp_path, text, key):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=f"unknown key.*{key}") as err:
        _resolve(f"--config={path}")
    assert path in str(err.value) and "valid keys" in str(err.value)


def test_yaml_section_must_be_a_mapping(tmp_path):
    path = _write(tmp_path, "sampling: 3\n")
    with pytest.raises(ValueError, match="line 1: sampling must be a mapping"):
        _resolve(f"--config={path}")


def test_yaml_must_hold_a_mapping(tmp_path):
    path = _write(tmp_path, "- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        _resolve(f"--config={path}")


def test_bad_value_in_yaml_fails_naming_it(tmp_path):
    path = _write(tmp_path, "cache:\n  page_size: 12\n")
    with pytest.raises(ValueError, match="page_size=12"):
        _resolve(f"--config={path}")


def test_bad_enum_flag_names_valid_values():
    with pytest.raises(absl_flags.IllegalFlagValueError) as err:
        _parse("--dtype=float16")
    assert "float16" in str(err.value)
    assert "float32" in str(err.value) and "bfloat16" in str(err.value)


def test_bad_list_int_flag():
    fv = _parse("--prefill_buckets=16,x")
    with pytest.raises(ValueError, match="--prefill_buckets=16,x: expected comma-separated int"):
        jflags.resolve_config(fv)


def test_unknown_preset_names_valid_presets(tmp_path):
    for argv in (["--preset=smollm3"], [f"--config={_write(tmp_path, 'preset: smollm3')}"]):
        with pytest.raises(ValueError, match="unknown preset 'smollm3'") as err:
            _resolve(*argv)
        assert all(name in str(err.value) for name in cfg.PRESETS)


def test_bad_flag_value_fails_in_validation():
    with pytest.raises(ValueError, match="top_p=1.5"):
        _resolve("--top_p=1.5")


# ----- dataclass validation ---------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda: toy_config(num_q_heads=6, num_kv_heads=4),
     "num_q_heads=6 not divisible by num_kv_heads=4"),
    (lambda: cfg.SamplingConfig(temperature=-0.5), "temperature=-0.5 must be >= 0"),
    (lambda: cfg.SamplingConfig(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (lambda: cfg.SamplingConfig(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (lambda: cfg.SamplingConfig(top_k=-1), "top_k=-1 must be >= 0"),
    (lambda: cfg.SamplingConfig(max_new_tokens=0), "max_new_tokens=0 must be > 0"),
    (lambda: cfg.CacheConfig(page_size=12), "page_size=12 must be a positive power of two"),
    (lambda: cfg.CacheConfig(page_size=0), "page_size=0 must be a positive power of two"),
    (lambda: cfg.CacheConfig(min_bucket_pages=3),
     r"min_bucket_pages=3 must be a positive power of two or None \(auto\)"),
    (lambda: cfg.EngineConfig(prefill_buckets=(32, 16)),
     r"prefill_buckets=\(32, 16\) must be positive, strictly increasing"),
    (lambda: cfg.EngineConfig(prefill_buckets=(16, 16)),
     r"prefill_buckets=\(16, 16\) must be positive, strictly increasing"),
], ids=["heads", "temperature", "top_p_0", "top_p_1.5", "top_k", "max_new_tokens", "page_size_12",
        "page_size_0", "min_bucket_pages", "buckets_decreasing", "buckets_repeated"])
def test_validation_names_the_bad_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_configs_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.SamplingConfig().temperature = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.CacheConfig(16)  # type: ignore[misc]


# ----- shipped configs and JSON -----------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))),
                         ids=os.path.basename)
def test_repo_configs_resolve(path):
    assert isinstance(_resolve(f"--config={path}"), cfg.RunConfig)


def test_presets_resolve():
    for name in cfg.PRESETS:
        assert isinstance(_resolve(f"--preset={name}"), cfg.RunConfig)


def test_to_json_round_trips(tmp_path):
    path = _write(tmp_path, "sampling:\n  stop: [END]\n  temperature: 0.7\n")
    run = _resolve(f"--preset={BENCH}", f"--config={path}", "--kv_dtype=bfloat16",
                   "--num_pages=100", "--max_top_logprobs=5")
    data = json.loads(run.to_json())

    def plain(x):  # JSON has lists where the config has tuples
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return list(x) if isinstance(x, tuple) else x

    assert data == plain(dataclasses.asdict(run))
    assert data["engine"]["prefill_buckets"] == [128, 512, 2048]
    assert data["sampling"]["stop"] == ["END"] and data["cache"]["dtype"] == "bfloat16"
    assert cfg.merge(cfg.RunConfig(), data, source="json") == run



# ----- field types: one check for every source ----------------------------------------------
def test_fields_are_checked_against_their_annotations():
    import numpy as np

    assert cfg.SamplingConfig(stop="foo").stop == ("foo",)  # one string is one stop string
    assert cfg.SamplingConfig(stop=["a", "b"]).stop == ("a", "b")
    assert cfg.SamplingConfig(temperature=1).temperature == 1.0
    assert cfg.SamplingConfig(max_new_tokens=np.int64(3)).max_new_tokens == 3
    assert cfg.EngineConfig(prefill_buckets=[16, 32]).prefill_buckets == (16, 32)
    for kwargs, message in (
            ({"max_new_tokens": 8.7}, "max_new_tokens=8.7 must be an integer"),
            ({"max_new_tokens": 8.0}, "max_new_tokens=8.0 must be an integer"),
            ({"top_k": True}, "top_k=True must be an integer"),
            ({"temperature": "hot"}, "temperature='hot' must be a number"),
            ({"ignore_eos": 1}, "ignore_eos=1 must be true or false"),
            ({"stop": [1]}, r"stop=\[1\] must be a list of strings"),
            ({"stop": [""]}, "a stop string must not be empty"),
            ({"temperature": float("nan")}, "temperature=nan must be a finite number"),
            ({"seed": -1}, r"seed=-1 must be in \[0, 2\*\*31\)"),
            ({"top_logprobs": 21}, r"top_logprobs=21 must be in \[0, 20\]")):
        with pytest.raises(ValueError, match=message):
            cfg.SamplingConfig(**kwargs)
    with pytest.raises(ValueError, match=r"prefill_buckets=\[16, 'x'\] must be a list of integ"):
        cfg.EngineConfig(prefill_buckets=[16, "x"])
    with pytest.raises(ValueError, match="page_size=None must be an integer"):
        cfg.CacheConfig(page_size=None)


def test_yaml_errors_name_the_file_the_line_and_the_field(tmp_path):
    path = _write(tmp_path, "engine:\n  max_slots: 4\nsampling:\n  stop: foo\n  top_k: 2.5\n")
    with pytest.raises(ValueError, match=r"run.yaml, line 5: sampling.top_k=2.5 must be an "
                                         "integer"):
        _resolve(f"--config={path}")
    path = _write(tmp_path, "sampling:\n  stop: foo\n")
    assert _resolve(f"--config={path}").sampling.stop == ("foo",)
    path = _write(tmp_path, "sampling: {top_k: 2\n")
    with pytest.raises(ValueError, match=r"run.yaml: not valid YAML.*line 2"):
        _resolve(f"--config={path}")
    (tmp_path / "bytes.yaml").write_bytes(b"sampling:\n  stop: \xff\n")
    with pytest.raises(ValueError, match="bytes.yaml: not UTF-8 text"):
        _resolve(f"--config={tmp_path / 'bytes.yaml'}")
    with pytest.raises(ValueError, match="is a directory|Is a directory"):
        _resolve(f"--config={tmp_path}")
    path = _write(tmp_path, "preset: [1]\n")
    with pytest.raises(ValueError, match=r"unknown preset \[1\]"):
        _resolve(f"--config={path}")


def test_yaml_range_errors_point_at_the_key_not_its_section(tmp_path):
    """A range or cross-field check (`__post_init__`) names the key's own line."""
    path = _write(tmp_path, "sampling:\n  temperature: 0.7\n  top_p: 0\n")
    with pytest.raises(ValueError, match=r"run.yaml, line 3 \(sampling.top_p\): top_p=0.0 must "):
        _resolve(f"--config={path}")
    path = _write(tmp_path, "engine:\n  max_slots: 4\n\n  ngram_max: 2\n  ngram_min: 3\n")
    with pytest.raises(ValueError, match=r"run.yaml, line 5 \(engine.ngram_min\): ngram sizes"):
        _resolve(f"--config={path}")
    path = _write(tmp_path, "cache:\n  page_size: 16\n  max_seq_len: 0\n")
    with pytest.raises(ValueError, match=r"run.yaml, line 3 \(cache.max_seq_len\): max_seq_len"):
        _resolve(f"--config={path}")


def test_flag_errors_name_the_flag():
    with pytest.raises(ValueError, match=r"flags \(--seed\): seed=-1 must be in"):
        _resolve("--seed=-1")
    with pytest.raises(ValueError, match=r"flags \(--max_slots\): max_slots=0 must be > 0"):
        _resolve("--max_slots=0")
    with pytest.raises(ValueError, match="--prefill_buckets=.*must be a list of integers|"
                                         "expected comma-separated integers"):
        _resolve("--prefill_buckets=16,x")


def test_a_malformed_config_json_names_the_file(tmp_path):
    from jaxinfer.checkpoint.hf import read_hf

    (tmp_path / "config.json").write_text('{"vocab_size": 8,')
    with pytest.raises(ValueError, match=r"config.json: not valid JSON .* line 1"):
        read_hf(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="config.json: missing key 'num_attention_heads'"):
        read_hf(str(tmp_path))


@pytest.mark.parametrize("slots, kv_dtype, pages", [
    (1, None, 16), (8, None, 2), (64, None, 1), (1, "int8", 64), (8, "int8", 8)])
def test_the_page_bucket_floor_keeps_padded_kv_reads_under_a_32nd_of_the_weights(
        slots, kv_dtype, pages):
    """SmolLM2-135M in f32: 134,515,008 parameters = 538,060,032 weight bytes, a 32nd of them
    16,814,376; a token's KV 2 x 30 layers x 3 kv heads x 64 x 4 = 46,080 bytes (int8: 11,520),
    so a 16-token page 737,280 (184,320). One row fits 22.8 pages (91.2 int8), 8 rows 2.85
    (11.4), 64 rows 0.36: the floor is the power of two below."""
    from jaxinfer.perf.planner import MODEL_PRESETS

    model = dataclasses.replace(MODEL_PRESETS["smollm2-135m"], dtype="float32")
    assert model.num_params() == 134_515_008
    cache = cfg.CacheConfig(dtype=kv_dtype).with_pools(model, max_slots=slots, chunk_size=256)
    assert cache.min_bucket_pages == pages
    short = cfg.CacheConfig(max_seq_len=64).with_pools(model, max_slots=1, chunk_size=256)
    assert short.min_bucket_pages == 4  # at most a sequence's pages
    given = cfg.CacheConfig(min_bucket_pages=8).with_pools(model, max_slots=64, chunk_size=256)
    assert given.min_bucket_pages == 8
