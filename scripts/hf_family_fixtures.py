"""Reference fixtures for the Qwen3 and Gemma 3 families from Hugging Face transformers (run in
the Hugging Face venv through `scripts/make_hf_fixtures.py --model=...`; no jaxinfer needed).

* qwen3-toy: a small randomly initialised `Qwen3ForCausalLM` (QK-norm, GQA, untied head, random
  norm weights so every norm matters) saved as an HF directory, tests/fixtures/hf_qwen3_toy/,
  plus hf_qwen3_toy_reference.npz: the logits at every position of a few random prompts and
  their greedy continuations.
* gemma3-270m: transformers' `Gemma3ForCausalLM` on the Gemma 3 270M GGUF (transformers
  dequantizes it itself), tests/fixtures/hf_gemma3_270m.json: per prompt (plain, chat, one past
  the 512-token window) the prompt ids, greedy ids with their top-1 minus top-2 margins, and
  the f32 logits at the last prompt position: the top 32 and 256 fixed vocabulary ids.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

QWEN3_PROMPTS = {"a": [5, 17, 200, 3, 99, 41, 7, 7, 150],
                 "b": [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}

# google/gemma-3-270m-it's chat template as published (text parts), set on the GGUF tokenizer,
# which ships none: an independent rendering to compare jaxinfer's family default with.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is "
    "string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception("
    "\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + "
    "(first_user_prefix if loop.first else \"\") }}{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}{%- elif message['content'] is iterable -%}{%- for item in "
    "message['content'] -%}{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{ raise_exception(\"Invalid content type\") }}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}{%- endif -%}")

GEMMA3_PLAIN = [("capital_france", "The capital of France is"),
                ("code_fibonacci", "def fibonacci(n):")]
GEMMA3_CHAT = [("chat_capital", "What is the capital of France?"),
               ("chat_system", "Name three primary colors.")]


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], new_tokens: int):
    """Greedy decode with the model's KV cache -> (ids, top1-top2 margins, prompt last logits)."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    last = out.logits[0, -1].float()
    prompt_last, gen, margins = last.clone(), [], []
    for step in range(new_tokens):
        top = torch.topk(last, 2)
        gen.append(int(top.indices[0]))
        margins.append(round(float(top.values[0] - top.values[1]), 5))
        if step == new_tokens - 1:
            break
        out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
        last = out.logits[0, -1].float()
    return gen, margins, prompt_last


def qwen3_toy(out_dir: str, new_tokens: int = 16) -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.2)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    path = os.path.join(out_dir, "hf_qwen3_toy")
    model.save_pretrained(path)
    ref = {}
    for name, ids in QWEN3_PROMPTS.items():
        with torch.inference_mode():
            ref[name + "_logits"] = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
        gen, margins, _ = greedy(model, ids, new_tokens)
        ref[name + "_greedy"] = np.array(gen, np.int32)
        ref[name + "_margins"] = np.array(margins, np.float32)
        ref[name + "_prompt"] = np.array(ids, np.int32)
    np.savez_compressed(os.path.join(out_dir, "hf_qwen3_toy_reference.npz"), **ref)
    print(f"wrote {path} and hf_qwen3_toy_reference.npz", file=sys.stderr)


def _gemma3_prompts(tok, text_file: str):
    for name, text in GEMMA3_PLAIN:
        yield name, False, text, tok.encode(text)
    for name, text in GEMMA3_CHAT:
        messages = [{"role": "user", "content": text}]
        if name == "chat_system":
            messages.insert(0, {"role": "system", "content": "Answer in one line."})
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        yield name, messages, rendered, tok.encode(rendered, add_special_tokens=False)
    with open(text_file, encoding="utf-8") as f:  # past the sliding window of 512
        text = f.read()
    ids = tok.encode(text)[:700]
    yield "long_700", False, tok.decode(ids[1:]), ids


def gemma3_270m(out_dir: str, gguf_path: str, new_tokens: int = 12) -> None:
    folder, filename = os.path.split(os.path.abspath(gguf_path))
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    tok.chat_template = GEMMA3_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    model.eval()
    print(f"loaded in {time.time() - t0:.1f}s", file=sys.stderr)
    sample = np.random.default_rng(0).choice(model.config.vocab_size, 256, replace=False)
    cases = []
    for name, chat, text, ids in _gemma3_prompts(tok, os.path.join(out_dir,
                                                                    "public_domain_text.txt")):
        gen, margins, last = greedy(model, ids, 4 if name.startswith("long") else new_tokens)
        top = torch.topk(last, 32)
        cases.append({
            "name": name, "messages": chat or None, "prompt_text": text, "prompt_ids": ids,
            "greedy_ids": gen, "margins": margins,
            "greedy_text": tok.decode(gen), "top_ids": top.indices.tolist(),
            "top_logits": [round(float(v), 5) for v in top.values],
            "sample_logits": [round(float(v), 5) for v in last[sample]],
        })
        print(f"{name}: {len(ids)} tokens, {tok.decode(gen)!r}", file=sys.stderr)
    doc = {"model": "gemma-3-270m (GGUF Q4_K_M, dequantized to f32 by transformers)",
           "transformers_version": transformers.__version__, "torch_version": torch.__version__,
           "gguf": filename, "new_tokens": new_tokens, "sample_ids": sample.tolist(),
           "cases": cases}
    path = os.path.join(out_dir, "hf_gemma3_270m.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} B)", file=sys.stderr)
