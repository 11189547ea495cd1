"""Text <-> token ids, built on the `tokenizers` library from GGUF metadata or a tokenizer.json.

Two sources give the same `Tokenizer`:

* a GGUF file (`from_gguf_file` / `from_gguf_metadata`): the vocabulary, merges and special ids are
  read from llama.cpp's `tokenizer.ggml.*` keys and a `tokenizers.Tokenizer` is assembled from them.
  `tokenizer.ggml.model == "gpt2"` is byte-level BPE, split by the regex named in
  `tokenizer.ggml.pre` (llama.cpp's table); `"llama"` is SentencePiece-style BPE ('\u2581' for a
  space, `<0xXX>` byte fallback, merges from the file or derived from the scores).
* a Hugging Face directory (`from_hf_dir`): tokenizer.json + tokenizer_config.json (+ the eos ids of
  generation_config.json / config.json). `save_hf` writes that format back.

BOS is added by `encode` itself, never by the `tokenizers` post-processor, so both sources behave
the same. Stop ids (`eos_ids`) are the checkpoint's eos id, llama.cpp's eot / eom ids when present,
and, when the checkpoint has a chat template, the first end-of-turn marker found in the vocabulary
(see `END_OF_TURN_TOKENS`): a chat model ends its reply with that token, which need not be its eos.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 2, 3, 4

# Tokens that end a chat turn, by model family; the first found in the vocabulary is a stop id.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> list of regexes applied in turn, each isolating its matches (llama.cpp's
# `regex_exprs`). "smollm" & co. isolate every digit first, then use the GPT-2 regex.
PRE_TOKENIZER_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt-2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "deepseek-r1-qwen": [_QWEN2_SPLIT],
    "tekken": [_TEKKEN_SPLIT],
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def read_gguf_metadata(path: str) -> dict:
    """All GGUF key/values of `path` as plain Python values (str, int, float, bool, lists)."""
    from gguf import GGUFValueType  # local: only GGUF loading needs it

    from jaxinfer.checkpoint.gguf import open_reader

    reader = open_reader(path)
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # header pseudo-fields (version, tensor count)
            continue
        if field.types[:2] == [GGUFValueType.ARRAY, GGUFValueType.STRING]:
            # Fast path for the vocabulary / merges (~10x quicker than `contents()`).
            metadata[key] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            continue
        value = field.contents()
        metadata[key] = value.tolist() if hasattr(value, "tolist") else value
    return metadata


def _pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name."""
    splits = PRE_TOKENIZER_SPLITS.get(pre or "default")
    if splits is None:
        logger.warning("unknown tokenizer.ggml.pre=%r; using the GPT-2 byte-level split", pre)
        splits = PRE_TOKENIZER_SPLITS["default"]
    steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _special_flags(metadata: dict) -> dict[int, bool]:
    """{id: is_special} for tokens that must be matched whole (control, user-defined, unknown)."""
    types = metadata.get("tokenizer.ggml.token_type") or []
    flags = {}
    for i, t in enumerate(types):
        if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            flags[i] = True
        elif t == TOKEN_TYPE_USER_DEFINED:
            flags[i] = False
    return flags


def _byte_level_backend(metadata: dict, added: dict[int, bool]) -> _HFTokenizer:
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`)."""
    tokens = metadata["tokenizer.ggml.tokens"]
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        # Added tokens keep their literal text (matched before BPE); others must be byte-spelled.
        if i not in added and not set(tok) <= alphabet:
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    backend.pre_tokenizer = _pre_tokenizer_for(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _derive_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the vocabulary: higher-scored merged pieces first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for merged, score in zip(tokens, scores, strict=True):
        local = [
            (merged[:k], merged[k:], score)
            for k in range(1, len(merged))
            if merged[:k] in vocab and merged[k:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (-m[2], len(m[0]), len(m[1])))
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_backend(metadata: dict) -> _HFTokenizer:
    """SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`) with `<0xXX>` byte fallback."""
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _derive_merges(tokens, scores)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = _HFTokenizer(model)
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # llama.cpp (like sentencepiece) prefixes a space to every text fragment that starts the input
    # or follows a special token, even one that already starts with a space: a normalizer does just
    # that, as it runs on each fragment between added tokens (Metaspace gives "▁x" for " x").
    steps = [normalizers.Prepend("\u2581")] if add_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _neutral_post_processor() -> processors.PostProcessor:
    """A post-processor that adds nothing (BOS is handled by `Tokenizer.encode`)."""
    return processors.TemplateProcessing(single="$A", pair="$A:0 $B:1", special_tokens=[])


def _stop_ids(eos: Sequence[int], vocab: dict[str, int], chat_template: str | None) -> tuple:
    """eos ids plus, for chat models, the first known end-of-turn token in the vocabulary."""
    ids = [int(i) for i in eos if i is not None]
    if chat_template:
        for name in END_OF_TURN_TOKENS:
            if name in vocab:
                ids.append(vocab[name])
                break
    return tuple(dict.fromkeys(ids))


def _read_json(path: str) -> dict:
    """The JSON object in `path`, or {} when the file does not exist."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value) -> str | None:
    """A tokenizer_config special-token entry (str or AddedToken dict) as its text."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the checkpoint's special ids and chat template.

    Attributes:
        vocab_size: number of ids, added tokens included.
        bos_id: beginning-of-sequence id, or None.
        eos_ids: every id that ends generation (see the module docstring).
        pad_id: padding id, or None.
        add_bos: whether `encode(..., add_special_tokens=True)` prepends `bos_id`.
        chat_template: the checkpoint's Jinja chat template, or None.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ):
        backend.post_processor = _neutral_post_processor()
        self._backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, *,
                           default_chat_template: str | None = None) -> Tokenizer:
        """Build from GGUF key/values (`tokenizer.ggml.*`, `tokenizer.chat_template`; without
        one, `default_chat_template`: the architecture's, `jaxinfer.families`)."""
        kind = metadata.get("tokenizer.ggml.model", "gpt2")
        added = _special_flags(metadata)
        if kind == "gpt2":
            backend = _byte_level_backend(metadata, added)
        elif kind == "llama":
            backend = _sentencepiece_backend(metadata)
        else:
            raise ValueError(
                f"unsupported tokenizer.ggml.model={kind!r}; expected 'gpt2' or 'llama'"
            )
        tokens = metadata["tokenizer.ggml.tokens"]
        # Their text is already in the model vocab, so they keep their ids; none are appended.
        specials = [
            AddedToken(tokens[i], special=True, normalized=False) for i, s in added.items() if s
        ]
        plain = [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, s in added.items()
            if not s
        ]
        backend.add_special_tokens(specials)
        backend.add_tokens(plain)
        eos = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        template = metadata.get("tokenizer.chat_template") or default_chat_template
        return cls(
            backend,
            bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_ids=_stop_ids(eos, backend.get_vocab(with_added_tokens=True), template),
            pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
            # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise.
            add_bos=metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"),
            chat_template=template,
        )

    @classmethod
    def from_gguf_file(cls, path: str) -> Tokenizer:
        """Build from the metadata of the GGUF file at `path`."""
        return cls.from_gguf_metadata(read_gguf_metadata(path))

    @classmethod
    def from_hf_dir(cls, path: str, *, default_chat_template: str | None = None) -> Tokenizer:
        """Build from a Hugging Face directory (tokenizer.json, tokenizer_config.json, configs;
        without a chat template there, `default_chat_template`)."""
        backend = _HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        vocab = backend.get_vocab(with_added_tokens=True)
        bos, eos = (_token_content(config.get(k)) for k in ("bos_token", "eos_token"))
        pad = _token_content(config.get("pad_token"))
        bos_id = vocab.get(bos) if bos else None
        eos_ids = [vocab[eos]] if eos in vocab else []
        for name in ("generation_config.json", "config.json"):
            extra = _read_json(os.path.join(path, name)).get("eos_token_id")
            eos_ids += extra if isinstance(extra, list) else [extra]
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # not stated: infer from what the tokenizer.json post-processor adds
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and probe[:1] == [bos_id]
        template = config.get("chat_template")
        jinja_path = os.path.join(path, "chat_template.jinja")  # newer transformers save it apart
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        template = template or default_chat_template
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=_stop_ids(eos_ids, vocab, template),
            pad_id=vocab.get(pad) if pad else None,
            add_bos=add_bos,
            chat_template=template,
        )

    def save_hf(self, out_dir: str) -> None:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json (eos ids)."""
        os.makedirs(out_dir, exist_ok=True)
        self._backend.save(os.path.join(out_dir, "tokenizer.json"))
        config = {
            "add_bos_token": self.add_bos,
            "bos_token": None if self.bos_id is None else self.token_str(self.bos_id),
            "eos_token": self.token_str(self.eos_ids[0]) if self.eos_ids else None,
            "pad_token": None if self.pad_id is None else self.token_str(self.pad_id),
            "chat_template": self.chat_template,
        }
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=1)
        with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": list(self.eos_ids)}, f, indent=1)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text become single ids.

        Args:
            text: the string to encode.
            add_special_tokens: prepend `bos_id` when `add_bos` is set.
        Returns:
            The ids, BOS first when added.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids`; control tokens are dropped when `skip_special_tokens`."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer serialised as tokenizer.json text (what grammar engines
        such as llguidance build their token tables from)."""
        return self._backend.to_str()

    def token_str(self, i: int) -> str:
        """The vocabulary entry of id `i` as stored (byte-level / '\u2581' spelling)."""
        tok = self._backend.id_to_token(int(i))
        if tok is None:
            raise IndexError(f"token id {i} out of range for vocab_size={self.vocab_size}")
        return tok

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render `messages` with the checkpoint's chat template, as Hugging Face does.

        Args:
            messages: [{"role": ..., "content": ...}, ...].
            add_generation_prompt: end with the header that starts the assistant's turn.
            **kwargs: extra template variables (e.g. `tools`, `enable_thinking`).
        Returns:
            The prompt text (encode it with `add_special_tokens=False` if it already holds BOS).
        """
        if not self.chat_template:
            raise ValueError(
                "this checkpoint has no chat template (no tokenizer.chat_template in the GGUF / "
                "chat_template in tokenizer_config.json); format the prompt yourself"
            )
        variables = {
            "bos_token": "" if self.bos_id is None else self.decode([self.bos_id]),
            "eos_token": self.decode(self.eos_ids[:1]) if self.eos_ids else "",
            **kwargs,
        }
        template = _compile_template(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


def _raise_exception(message: str):
    """Template helper: `{{ raise_exception('...') }}` aborts rendering (HF convention)."""
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _compile_template(source: str):
    """A Jinja template in a sandbox configured like transformers' chat templating."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDecoder:
    """Streaming detokenizer: push ids one at a time, get only the newly completed text.

    Keeps a window `ids[prefix:]` and emits the text that decoding the window adds over decoding
    `ids[prefix:read]`. Text ending in U+FFFD is held back: it is a UTF-8 character (or a
    byte-fallback sequence) split across tokens that the next ids will complete. Decoding a window
    rather than single ids also keeps context-dependent decoders (SentencePiece's leading-space
    strip) correct.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._text: list[str] = []

    def _window(self, end: int) -> str:
        """Decode `ids[prefix:end]`."""
        ids = self._ids[self._prefix : end]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        before = self._window(self._read)
        after = self._window(len(self._ids))
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._text.append(new)
        return new

    def flush(self) -> str:
        """Return whatever is still held back (possibly with U+FFFD for a truncated character)."""
        before = self._window(self._read)
        after = self._window(len(self._ids))
        new = after[len(before) :] if after.startswith(before) else ""
        self._prefix = self._read = len(self._ids)
        if new:
            self._text.append(new)
        return new

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text)
