"""Property tests (hypothesis) over every input surface. The promise: bad input gets a
ValueError naming the field and the bad value, never another exception type; a run's good
requests all complete.

Surfaces: the config dataclasses and `merge`; absl flags; YAML files; prompt files (text and
JSONL); the Python API (`token_ids`, `encode_prompt`, `sampling_config`, `batch_of`,
`Engine.add_request` and the calls that take a request id, `LLM.generate`). One `LLM` (the toy
model of tests/test_engine.py, with a byte-level tokenizer whose printable ASCII bytes are ids
0..94) serves every engine example: each adds its requests, runs them, checks and forgets them.
Derandomized, with no example database, so CI runs the same examples every time. The tests at
the end pin the edges these properties found (an integer past the float range, unparsable JSON,
a self-referencing YAML alias, a lone surrogate, an unhashable id, automatic ids).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import types
import typing
from collections.abc import Hashable, Mapping

import numpy as np
import pytest
import yaml
from absl import flags as absl_flags
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

from jaxinfer import config as cfg
from jaxinfer.checkpoint.tokenizer import Tokenizer, bytes_to_unicode
from jaxinfer.cli import flags as jflags
from jaxinfer.cli.prompt_file import read_prompt_file
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.prompts import batch_of, encode_prompt, sampling_config, token_ids
from jaxinfer.model import Llama, init_params
from tests.helpers import toy_config

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


def fuzz(max_examples: int) -> settings:
    return settings(FUZZ, max_examples=max_examples)


SECTIONS = {"cache": CacheConfig, "engine": EngineConfig, "sampling": SamplingConfig}
HINTS = {cls: typing.get_type_hints(cls) for cls in (*SECTIONS.values(), RunConfig)}
FIELDS = {cls: [f.name for f in dataclasses.fields(cls)] for cls in HINTS}
WORDS = sorted({*cfg.DTYPES, *cfg.ATTENTION_IMPLS, *cfg.SCHEDULING_POLICIES,
                *cfg.SPECULATIVE_METHODS, *cfg.PRESETS, "float16", ""})

# ----- strategies ------------------------------------------------------------------------------
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4)
                    | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=10)
# What Python callers can pass on top of JSON: bytes, tuples, sets, numpy scalars, huge ints.
PYTHON = (JSON | st.binary(max_size=6) | st.frozensets(st.integers(-2, 200), max_size=3)
          | st.lists(st.integers(-2, 200), max_size=4).map(tuple)
          | st.integers(-2**80, 2**80).map(lambda i: [1, i])
          | st.sampled_from([np.int64(3), np.int32(-1), np.float32(0.5), np.bool_(True),
                             np.arange(3), [np.int64(2), 5]]))


def near_values(typ) -> st.SearchStrategy:
    """Values for a field of annotation `typ`: mostly of its type, so the checks after the type
    check run too, and any JSON value."""
    return typed_values(typ) | typed_values(typ) | JSON


def typed_values(typ) -> st.SearchStrategy:
    """Values of annotation `typ` (or, for a config section, a mapping of its fields)."""
    if isinstance(typ, types.UnionType):
        inner = next(a for a in typing.get_args(typ) if a is not type(None))
        return st.none() | typed_values(inner)
    if typ is bool:
        typed = st.booleans()
    elif typ is int:
        typed = st.integers(-3, 40) | st.sampled_from([2**31 - 1, 2**31, 2**63, -2**31])
    elif typ is float:
        typed = st.floats(-1, 3) | st.floats() | st.integers(-2, 3)
    elif typ is str:
        typed = st.sampled_from(WORDS) | st.text(max_size=6)
    elif typ == tuple[int, ...]:
        typed = st.lists(st.integers(-2, 600), max_size=4)
    elif typ == tuple[str, ...]:
        typed = st.lists(st.text(max_size=3), max_size=3) | st.text(max_size=3)
    else:  # a config section: itself, or (the wrong type) a mapping of its fields
        typed = st.just(typ()) | fields_of(typ, unknown=False)
    return typed


def fields_of(cls: type, *, unknown: bool = True, typed: bool = False) -> st.SearchStrategy:
    """A dict of fields of `cls` (with `unknown` also keys that are not fields; with `typed`
    only values of the fields' types)."""
    values = typed_values if typed else near_values
    pair = st.sampled_from(FIELDS[cls]).flatmap(
        lambda name: st.tuples(st.just(name), values(HINTS[cls][name])))
    if unknown:
        pair = pair | pair | st.tuples(st.text(max_size=6), JSON)
    return st.lists(pair, max_size=4).map(dict)


# YAML-shaped overrides of a RunConfig: sections as nested mappings, some keys unknown or not
# strings (YAML reads `1:` and `null:` as an int and None).
OVERRIDES = st.lists(
    st.sampled_from(["cache", "engine", "sampling"]).flatmap(
        lambda s: st.tuples(st.just(s), fields_of(SECTIONS[s]) | JSON))
    | st.sampled_from(["model_path", "draft_model_path", "dtype", "mesh", "multihost"]).flatmap(
        lambda name: st.tuples(st.just(name), near_values(HINTS[RunConfig][name])))
    | st.tuples(st.text(max_size=6) | st.integers(-2, 2) | st.none(), JSON),
    max_size=4).map(dict)


# ----- oracles ---------------------------------------------------------------------------------
def type_error(cls: type, name: str, value) -> bool:
    try:
        cfg.conform(value, HINTS[cls][name])
    except TypeError:
        return True
    return False


def checked_error(cls: type, values: Mapping, prefix: str = "", *,
                  field_order: bool = False) -> str | None:
    """What `replace_checked(cls(), values)` must say first, if an unknown key or a value of
    the wrong type stops it: "unknown key <key>" or "<key>=<value!r> must be ". Values are
    checked in the mapping's order (`field_order`: in the fields' order)."""
    unknown = [k for k in values if k not in FIELDS[cls]]
    if unknown:
        return f"unknown key {prefix}{unknown[0]!s}"
    keys = [k for k in FIELDS[cls] if k in values] if field_order else list(values)
    bad = [k for k in keys if type_error(cls, k, values[k])]
    return f"{prefix}{bad[0]}={cfg.short_repr(values[bad[0]])} must be " if bad else None


def merge_error(overrides: Mapping) -> str | None:
    """The words `merge(RunConfig(), overrides)`'s error must hold, where they can be told."""
    for section, cls in SECTIONS.items():
        if section in overrides:
            values = overrides[section]
            if not isinstance(values, Mapping):
                return f"{section} must be a mapping"
            expected = checked_error(cls, values, f"{section}.")
            if expected:
                return expected
            try:
                dataclasses.replace(cls(), **values)
            except ValueError as e:  # a range or cross-field check: the first key it names
                named = [k for k in re.findall(r"\b(\w+)=", str(e)) if k in values]
                return f"({section}.{named[0]})" if named else f"({section})"
    return checked_error(RunConfig, {k: v for k, v in overrides.items() if k not in SECTIONS})


def dotted_keys(overrides: Mapping) -> list[str]:
    keys = [str(k) for k in overrides if k != ""]
    for section in SECTIONS:
        if isinstance(overrides.get(section), Mapping):
            keys += [f"{section}.{k}" for k in overrides[section]]
    return keys


# ----- config dataclasses and merge ------------------------------------------------------------
@fuzz(300)
@given(case=st.sampled_from(list(HINTS)).flatmap(
    lambda cls: st.tuples(st.just(cls), fields_of(cls, unknown=False))))
def test_config_dataclasses_take_a_value_or_name_the_field(case):
    cls, kwargs = case
    bad = [k for k in FIELDS[cls] if k in kwargs and type_error(cls, k, kwargs[k])]
    try:
        obj = cls(**kwargs)
    except ValueError as e:
        if bad:  # fields are type-checked first, in field order
            assert str(e).startswith(f"{bad[0]}={cfg.short_repr(kwargs[bad[0]])} must be "), str(e)
        else:
            assert any(k in str(e) for k in kwargs), str(e)
    else:
        assert not bad
        for k, v in kwargs.items():
            assert repr(getattr(obj, k)) == repr(cfg.conform(v, HINTS[cls][k]))


def plain(typ):
    """`typ` without `| None`."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    return args[0] if isinstance(typ, types.UnionType) else typ


NUMPY_SCALARS = {bool: st.booleans().map(np.bool_),
                 int: st.integers(-2**31, 2**31 - 1).flatmap(
                     lambda i: st.sampled_from([np.int64(i), np.int32(i)])),
                 float: st.floats(width=32).map(np.float32) | st.integers(-9, 9).map(np.int64)}
SCALAR_FIELDS = [(cls, name) for cls in HINTS for name in FIELDS[cls]
                 if plain(HINTS[cls][name]) in NUMPY_SCALARS]


@fuzz(100)
@given(case=st.sampled_from(SCALAR_FIELDS).flatmap(lambda field: st.tuples(
    st.just(field), NUMPY_SCALARS[plain(HINTS[field[0]][field[1]])])))
def test_numpy_scalars_stand_for_their_python_types(case):
    (cls, name), value = case
    out = cfg.check_field(cls, name, value)
    assert type(out) is plain(HINTS[cls][name])
    assert out == value or (out != out and value != value)


@fuzz(300)
@given(overrides=OVERRIDES, lines=st.booleans())
def test_merge_names_source_line_and_key(overrides, lines):
    key_lines = {k: i + 1 for i, k in enumerate(dotted_keys(overrides))} if lines else None
    try:
        run = cfg.merge(RunConfig(), overrides, source="src", lines=key_lines)
    except ValueError as e:
        message = str(e)
        assert message.startswith("src"), message
        expected = merge_error(overrides)
        if expected:
            assert expected in message, (expected, message)
            key = re.match(r"(?:unknown key )?\(?([^=)]*)", expected).group(1)
            if key_lines and key in key_lines:
                assert re.match(rf"src, line {key_lines[key]}[: ]", message), message
        else:
            assert any(k in message for k in dotted_keys(overrides)), message
    else:
        assert merge_error(overrides) is None
        assert isinstance(run, RunConfig) and json.loads(run.to_json())


# ----- flags -----------------------------------------------------------------------------------
FLAG_KINDS = {name: kind for name, kind, _, _ in jflags.FLAG_TABLE}
FLAG_PATHS = {name: path for name, _, path, _ in jflags.FLAG_TABLE}
NO_COMMA = st.characters(exclude_characters=",")


def flag_values(name: str) -> st.SearchStrategy:
    kind = FLAG_KINDS.get(name, "str")
    typed = {
        "int": st.integers(-5, 5000).map(str),
        "float": st.floats().map(repr) | st.sampled_from(["nan", "-inf", "1e400", "0x1p3"]),
        "bool": st.sampled_from(["true", "false", "1", "maybe"]),
        "list_int": st.lists(st.integers(-2, 600).map(str) | st.text(NO_COMMA, max_size=3),
                             max_size=4).map(",".join),
        "list_str": st.lists(st.text(NO_COMMA, max_size=3), max_size=3).map(",".join),
    }.get(kind, st.sampled_from(WORDS) | st.text(max_size=6))
    return typed | typed | st.text(max_size=6)


FLAG_ARGS = st.sampled_from([*FLAG_KINDS, "preset"]).flatmap(
    lambda name: flag_values(name).map(lambda value: f"--{name}={value}")
    | (st.sampled_from([f"--{name}", f"--no{name}"]) if FLAG_KINDS.get(name) == "bool"
       else st.nothing()))


def _parse(*argv: str) -> absl_flags.FlagValues:
    fv = absl_flags.FlagValues()
    jflags.define_flags(fv)
    fv(["prog", *argv])
    return fv


@fuzz(300)
@given(argv=st.lists(FLAG_ARGS, max_size=4))
def test_flags_resolve_or_name_the_flag(argv):
    fv = absl_flags.FlagValues()
    jflags.define_flags(fv)
    try:
        fv(["prog", *argv])
    except absl_flags.Error as e:  # a value absl cannot read as the flag's kind
        message = jflags.flag_error_message(e, fv)  # the one line every CLI prints
        assert "\n" not in message, message
        assert any(arg.split("=", 1)[0].replace("--no", "--") in message.replace("--no", "--")
                   for arg in argv), (argv, message)
        return
    given_flags = [name for name in [*FLAG_KINDS, "preset"] if fv[name].present]
    try:
        run = jflags.resolve_config(fv)
    except ValueError as e:
        message = str(e)
        assert message.startswith(("flags", "--", "unknown preset")), message
        assert any(f"--{n}" in message or FLAG_PATHS.get(n, "preset").split(".")[-1] in message
                   for n in given_flags), message
    else:
        for name in given_flags:
            if name == "preset":
                continue
            value = run
            for part in FLAG_PATHS[name].split("."):
                value = getattr(value, part)
            flag = fv[name].value
            if FLAG_KINDS[name].startswith("list"):
                assert [str(v) for v in value] == [str(int(f)) if FLAG_KINDS[name] == "list_int"
                                                  else f for f in flag]
            else:
                assert value == flag or (value != value and flag != flag), (name, value, flag)


# ----- YAML files ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@fuzz(200)
@example(content=b"[" * 1100)  # deeper than Python's recursion limit
@example(content=b"model_path: 2001-13-01\n")  # a date YAML cannot make
@example(content=b"sampling:\n  seed: " + b"7" * 5000 + b"\n")  # past int's digit limit
@example(content=b"sampling:\n  top_k: 4294967296\n")
@given(content=st.binary(max_size=60) | st.text(max_size=60).map(str.encode)
       | OVERRIDES.map(lambda o: yaml.safe_dump(o, sort_keys=False).encode()))
def test_yaml_files_resolve_or_name_the_file(files, content):
    path = files / "run.yaml"
    path.write_bytes(content)
    try:
        run = jflags.resolve_config(_parse(f"--config={path}"))
    except ValueError as e:
        assert str(e).startswith((f"config file {path}", "unknown preset")), str(e)
    else:
        assert isinstance(run, RunConfig)


# ----- prompt files ----------------------------------------------------------------------------
PROMPTS = (st.lists(st.integers(-2, 300), max_size=4) | st.text(max_size=8)
           | st.lists(JSON, max_size=3) | JSON)
RECORDS = st.tuples(PROMPTS, fields_of(SamplingConfig)).map(lambda t: {"prompt": t[0], **t[1]})
LINES = (RECORDS.map(json.dumps) | JSON.map(json.dumps) | st.text(max_size=12)
         | st.binary(max_size=8).map(lambda b: b.decode("latin-1")))
ENDINGS = st.sampled_from(["\n", "\r\n", "\r"])


@st.composite
def prompt_files(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=80))
    lines = draw(st.lists(LINES, max_size=5))
    text = draw(ENDINGS).join(lines)
    raw = text.encode("utf-8", "surrogatepass")
    return (b"\xef\xbb\xbf" if draw(st.booleans()) else b"") + raw


def jsonl_error(line: str) -> str | None:
    """What the error of a JSONL line must hold, where it can be told; None: it may be a
    prompt."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return "not valid JSON"
    if not isinstance(obj, dict):
        return "must be a JSON object"
    if "prompt" not in obj:
        return 'no "prompt" key'
    prompt = obj.pop("prompt")
    if not isinstance(prompt, str) and (
            not isinstance(prompt, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return "prompt"
    # The record's fields override the run's sampling, so they are checked in field order.
    return checked_error(SamplingConfig, obj, field_order=True)


@fuzz(200)
@given(content=prompt_files(), name=st.sampled_from(["p.jsonl", "p.NDJSON", "p.txt"]),
       fmt=st.sampled_from(["auto", "text", "jsonl"]))
def test_prompt_files_give_a_record_per_line(files, content, name, fmt):
    path = files / name
    path.write_bytes(content)
    sampling = SamplingConfig(max_new_tokens=7)
    records = read_prompt_file(str(path), sampling, fmt=fmt)
    jsonl = fmt == "jsonl" or (fmt == "auto" and name != "p.txt")
    expected = []
    for number, raw in enumerate(content.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            expected.append((number, "not UTF-8", None))
            continue
        line = line.removeprefix("\ufeff") if number == 1 else line
        if line.strip():
            expected.append((number, jsonl_error(line) if jsonl else None, line))
    assert [r.where for r in records] == [f"{path}:{n}" for n, _, _ in expected]
    for record, (_, error, line) in zip(records, expected):
        if record.error is None:
            assert error is None, (error, line)
            assert isinstance(record.sampling, SamplingConfig)
            if jsonl:
                obj = json.loads(line)
                assert record.prompt == obj["prompt"]
                assert record.sampling.max_new_tokens == obj.get("max_new_tokens", 7)
            else:
                assert record.prompt == line and record.sampling is sampling
        else:
            assert record.prompt is None and record.error.startswith(f"{record.where}: ")
            message = record.error.removeprefix(f"{record.where}: ")
            if error is not None:
                assert error in message, (error, message)
            else:  # a value out of its range: the message names one of the record's fields
                assert any(k in message for k in json.loads(line) if k != "prompt"), message


# ----- the Python API without an engine --------------------------------------------------------
VOCAB = 96
PRINTABLE = st.characters(min_codepoint=32, max_codepoint=126)  # ids 0..94 of `byte_tokenizer`
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<a>{% endif %}")


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: one token per byte, printable ASCII first (ids 0..94,
    `~` = 94 is EOS), so ASCII text fits the toy model's 96 ids and other text does not."""
    spelling = bytes_to_unicode()
    order = [*range(32, 127), *(b for b in range(256) if not 32 <= b < 127)]
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [spelling[b] for b in order],
        "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": 94,
        "tokenizer.chat_template": CHAT_TEMPLATE})


TOKENIZER = byte_tokenizer()


@fuzz(300)
@given(prompt=PYTHON)
def test_token_ids_returns_ints_or_names_the_prompt(prompt):
    try:
        ids = token_ids(prompt)
    except ValueError as e:
        assert "prompt" in str(e) or "token id" in str(e), str(e)
    else:
        assert all(type(t) is int for t in ids) and ids == [int(t) for t in prompt]


@fuzz(300)
@given(prompt=PYTHON | st.text(max_size=12) | st.text(PRINTABLE, max_size=12),
       chat=st.booleans(), system=st.none() | st.text(max_size=6))
def test_encode_prompt_gives_ids_in_range_or_a_value_error(prompt, chat, system):
    for tokenizer in (TOKENIZER, None):
        try:
            ids = encode_prompt(tokenizer, VOCAB, prompt, chat=chat, system=system)
        except ValueError as e:
            assert re.search("prompt|token id", str(e)), str(e)
        else:
            assert ids and all(0 <= t < VOCAB for t in ids)


@fuzz(300)
@given(sampling=PYTHON | fields_of(SamplingConfig))
def test_sampling_config_checks_every_field(sampling):
    try:
        sc = sampling_config(sampling)
    except ValueError as e:
        assert str(e).startswith("sampling"), str(e)
        if isinstance(sampling, Mapping) and checked_error(SamplingConfig, sampling):
            assert checked_error(SamplingConfig, sampling) in str(e), str(e)
    else:
        assert isinstance(sc, SamplingConfig)


@fuzz(300)
@given(prompts=PYTHON | st.lists(PYTHON, max_size=3),
       sampling=PYTHON | st.lists(fields_of(SamplingConfig), max_size=3))
def test_batch_of_pairs_prompts_with_samplings(prompts, sampling):
    try:
        ps, scs = batch_of(prompts, sampling)
    except ValueError as e:
        assert re.search("prompts|sampling", str(e)), str(e)
    else:
        assert len(ps) == len(scs)


# ----- the engine ------------------------------------------------------------------------------
CACHE = CacheConfig(page_size=4, max_seq_len=96, num_pages=40)  # as tests/test_engine.py
ENGINE = EngineConfig(max_slots=4, prefill_buckets=(8, 16, 32), max_num_batched_tokens=40,
                      prefill_chunk_size=16)


@pytest.fixture(scope="module")
def llm() -> LLM:
    config = toy_config(vocab_size=VOCAB, max_position=128)
    params = init_params(config, seed=5, scale=0.3)
    params["lm_head"] *= 8.0
    return LLM(Llama(config, params), TOKENIZER, cache=CACHE, engine=ENGINE)


# Any valid sampling, drawn from past the edges of the valid ranges (what SamplingConfig
# accepts must run: the steps hold float32 and int32 copies), but with no stop strings and no
# EOS, so a good request ends by length.
FINITE = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def good_samplings(draw) -> SamplingConfig:
    edges = st.sampled_from([0, 1, 5, 64, 65, 2**31 - 3, 2**31 - 1, 2**31, 2**63])
    kwargs = dict(
        max_new_tokens=draw(st.integers(1, 6)), ignore_eos=True, n=draw(st.integers(1, 3)),
        logprobs=draw(st.booleans()), seed=draw(edges | st.integers(0, 2**32)),
        top_k=draw(edges | st.integers(0, 2**32)),
        temperature=draw(st.sampled_from([0.0, 1.0]) | FINITE.map(abs)),
        top_p=draw(st.sampled_from([1.0, 0.5]) | st.floats(0, 1)),
        min_p=draw(st.sampled_from([0.0, 0.1]) | st.floats(0, 1)),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3]) | FINITE.map(abs)),
        presence_penalty=draw(st.sampled_from([0.0, 0.5]) | FINITE),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5]) | FINITE))
    try:
        return SamplingConfig(**kwargs)
    except ValueError:
        reject()


GOOD_PROMPTS = (st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
                | st.text(PRINTABLE, min_size=1, max_size=24))
GOOD_SAMPLINGS = good_samplings() | good_samplings().map(dataclasses.asdict)
# Prompts and samplings that are bad for sure (LLM.generate knows which results are errors).
BAD_PROMPTS = (
    st.none() | st.integers() | st.floats() | st.binary(max_size=4) | st.just([]) | st.just("")
    | st.dictionaries(st.text(max_size=3), JSON, max_size=2)
    | st.tuples(st.lists(st.integers(0, VOCAB - 1), max_size=4),
                st.floats() | st.text(max_size=2) | st.none() | st.booleans() | st.lists(JSON)
                | st.integers(VOCAB, 2**70) | st.integers(-2**70, -1)).map(lambda t: [*t[0], t[1]])
    | st.text(PRINTABLE, max_size=4).map(lambda s: s + "é")
    | st.just(list(range(VOCAB)) + [1]))
# A field given a value of the wrong type, or a key that is no field.
WRONG_FIELD = (st.sampled_from(FIELDS[SamplingConfig]).flatmap(
    lambda name: st.tuples(st.just(name), JSON.filter(
        lambda v: type_error(SamplingConfig, name, v))))
    | st.tuples(st.text(max_size=6).filter(lambda k: k not in FIELDS[SamplingConfig]), JSON))
BAD_SAMPLINGS = (
    st.none() | st.text(max_size=4) | st.integers() | st.lists(JSON, max_size=2)
    | st.tuples(fields_of(SamplingConfig, unknown=False), WRONG_FIELD).map(
        lambda t: {**t[0], t[1][0]: t[1][1]})
    | st.sampled_from([{"top_p": 2.0}, {"n": 0}, {"max_new_tokens": 200}, {"top_logprobs": 3},
                       {"stop": [""]}, {"seed": 2**31 - 1, "n": 2}, {"top_k": 2**31}]))


def short(fields: st.SearchStrategy) -> st.SearchStrategy:
    """Fields over a short max_new_tokens (the default 128 never fits the context)."""
    return fields.map(lambda kw: {"max_new_tokens": 3, **kw})


# Bad requests, and some valid by chance. The sampling is checked first: a bad prompt needs a
# good sampling to be looked at.
BAD_ITEMS = st.one_of(
    st.tuples(GOOD_PROMPTS, short(fields_of(SamplingConfig, unknown=False, typed=True))),
    st.tuples(GOOD_PROMPTS, short(fields_of(SamplingConfig, unknown=False, typed=True))),
    st.tuples(GOOD_PROMPTS, short(fields_of(SamplingConfig))),
    st.tuples(GOOD_PROMPTS, BAD_SAMPLINGS),
    st.tuples(BAD_PROMPTS | PYTHON, GOOD_SAMPLINGS),
    st.tuples(GOOD_PROMPTS | BAD_PROMPTS | PYTHON, PYTHON))
IDS = PYTHON | st.text(max_size=8) | st.sampled_from(["", "req-0", "x/0", "x/prefill", "good-0"])


def sample_count(sampling) -> int:
    try:
        return sampling_config(sampling).n
    except ValueError:
        return 1


def _drain(engine, rids) -> None:
    """Leaves the shared engine empty whatever an example did."""
    for rid in rids:
        with contextlib.suppress(ValueError):
            engine.abort(rid)
    engine.run()
    for rid in rids:
        with contextlib.suppress(ValueError):
            engine.forget(rid)


def _check_id_calls(engine, ids, live) -> None:
    for rid in ids:
        if isinstance(rid, Hashable) and rid in live:
            continue
        for call in (engine.result, engine.results, engine.abort):
            with pytest.raises(ValueError, match="request"):
                call(rid)
        if isinstance(rid, Hashable):  # an unhashable id raises TypeError (known bug below)
            with pytest.raises(ValueError, match="request"):
                engine.forget(rid)


# Extreme sampling values overflow float32 (to inf) on their way to the device: no error.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@fuzz(30)
@given(good=st.lists(st.tuples(GOOD_PROMPTS, GOOD_SAMPLINGS, st.booleans()), min_size=1,
                     max_size=3),
       bad=st.lists(st.tuples(BAD_ITEMS, IDS | st.none()), min_size=1, max_size=8),
       ids=st.lists(IDS, max_size=4), order=st.randoms(use_true_random=False))
def test_engine_rejects_bad_requests_alone_and_completes_good_ones(llm, good, bad, ids, order):
    engine = llm.engine
    items = [(True, *g) for g in good] + [(False, *b, rid) for b, rid in bad]
    order.shuffle(items)
    added = []  # (request id, SamplingConfig, "good" | "stray" | "aborted")
    try:
        for is_good, prompt, sampling, extra in items:
            if is_good:
                rid = engine.add_request(prompt, sampling, chat=extra)
                added.append((rid, sampling_config(sampling), "good"))
            else:
                added += _add_bad(engine, prompt, sampling, extra)
        live = {s for rid, sc, _ in added for s in (rid, *engine.sample_ids(rid, sc.n))}
        _check_id_calls(engine, ids, live)
        for rid, _, kind in added:
            if kind != "aborted":  # nothing has run yet
                for call in (engine.results, engine.forget):
                    with pytest.raises(ValueError, match="has not finished"):
                        call(rid)
        engine.run()
        for rid, sc, kind in added:
            _check_results(engine.results(rid), sc, kind)
            engine.forget(rid)
            with pytest.raises(ValueError, match="unknown request id"):
                engine.results(rid)
        assert not engine.has_unfinished() and engine.scheduler.pool.num_used() == 0
    finally:
        _drain(engine, [rid for rid, _, _ in added])


def _add_bad(engine, prompt, sampling, request_id) -> list:
    """Adds a request that is bad (it must raise a ValueError saying why) or valid by chance
    (then it runs, or is aborted at once if it is long): [] or [(id, sampling, kind)]."""
    try:
        rid = engine.add_request(prompt, sampling, request_id=request_id)
    except ValueError as e:
        try:
            sampling_config(sampling)
        except ValueError as sampling_error:  # the sampling is checked first
            assert str(e) == str(sampling_error)
        else:
            assert re.search("|".join(["prompt", "token id", "top_logprobs", "request", "lora",
                                       *cfg.CONSTRAINTS]), str(e)), str(e)
        return []
    sc = sampling_config(sampling)
    if sc.n * sc.max_new_tokens > 16:
        engine.abort(rid)
        return [(rid, sc, "aborted")]
    return [(rid, sc, "stray")]


def _check_results(results, sc: SamplingConfig, kind: str) -> None:
    assert len(results) == sc.n
    for res in results:
        assert all(0 <= t < VOCAB for t in res.token_ids)
        if kind == "good":
            assert res.finish_reason == "length", res
            assert len(res.token_ids) == sc.max_new_tokens
            assert res.logprobs is None or len(res.logprobs) == sc.max_new_tokens
        elif kind == "aborted":
            assert res.finish_reason == "abort" and not res.token_ids, res
        else:
            assert res.finish_reason in ("length", "eos", "stop"), res
            assert len(res.token_ids) <= sc.max_new_tokens


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@fuzz(30)
@given(items=st.lists(st.tuples(st.just(True), GOOD_PROMPTS, GOOD_SAMPLINGS)
                      | st.tuples(st.just(False), BAD_PROMPTS, GOOD_SAMPLINGS)
                      | st.tuples(st.just(False), GOOD_PROMPTS, BAD_SAMPLINGS),
                      min_size=1, max_size=5),
       raise_on_error=st.booleans())
def test_llm_generate_returns_every_sample_in_order(llm, items, raise_on_error):
    prompts = [p for _, p, _ in items]
    samplings = [s for _, _, s in items]
    if raise_on_error and not all(ok for ok, _, _ in items):
        first_bad = next(i for i, (ok, _, _) in enumerate(items) if not ok)
        with pytest.raises(ValueError, match=f"^prompt {first_bad}: "):
            llm.generate(prompts, samplings, use_tqdm=False)
        assert not llm.engine.has_unfinished() and llm.engine.scheduler.pool.num_used() == 0
        return
    results = llm.generate(prompts, samplings, use_tqdm=False, raise_on_error=raise_on_error)
    expected = [(ok, sampling_config(s) if ok else None)
                for ok, _, s in items for _ in range(sample_count(s))]
    assert len(results) == len(expected)
    for res, (ok, sc) in zip(results, expected):
        if ok:
            assert res.finish_reason == "length" and len(res.token_ids) == sc.max_new_tokens
        else:
            assert res.finish_reason == "error" and res.error and not res.token_ids
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.pool.num_used() == 0


# ----- edges the properties above found ----------------------------------------------------------
def test_a_huge_int_for_a_float_field_is_a_value_error():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=10**400)


@pytest.mark.parametrize("line", ['{"prompt": [1], "seed": ' + "7" * 5000 + "}",
                                  "[" * 100_000 + "]" * 100_000],
                         ids=["int-past-digit-limit", "deep-nesting"])
def test_a_jsonl_line_python_cannot_parse_fails_alone(files, line):
    path = files / "bad.jsonl"
    path.write_text(line + '\n{"prompt": [1]}\n')
    records = read_prompt_file(str(path), SamplingConfig())
    assert records[0].error and records[1].prompt == [1]


def test_a_self_referencing_yaml_alias_is_a_value_error(files):
    path = files / "alias.yaml"
    path.write_text("sampling: &x {stop: *x}\n")
    data, lines = cfg.load_yaml(str(path))
    assert lines == {"sampling": 1, "sampling.stop": 1}
    with pytest.raises(ValueError, match=r"alias.yaml, line 1: sampling.stop=.* must be a list"):
        cfg.merge(cfg.RunConfig(), data, source=f"config file {path}", lines=lines)


def test_a_lone_surrogate_in_a_text_prompt_is_a_value_error():
    # A JSONL record {"prompt": "\\ud800"} reads as such a string.
    with pytest.raises(ValueError, match="prompt"):
        encode_prompt(TOKENIZER, VOCAB, "bad \ud800")


def test_forget_with_an_unhashable_id_is_a_value_error(llm):
    with pytest.raises(ValueError, match="unknown request id"):
        llm.engine.forget(["x"])


def test_automatic_ids_skip_ids_callers_chose(llm):
    engine = llm.engine
    sampling = SamplingConfig(max_new_tokens=1, ignore_eos=True)
    first = engine.add_request([1], sampling)  # "req-<k>"
    rids = [first, engine.add_request([1], sampling,
                                      request_id=f"req-{int(first.removeprefix('req-')) + 1}")]
    try:
        rids.append(engine.add_request([2], sampling))  # "req-<k+1>" is taken
    finally:
        _drain(engine, rids)
