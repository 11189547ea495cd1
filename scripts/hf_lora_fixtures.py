"""LoRA reference fixtures from `peft` + transformers (run in a Hugging Face venv with peft through
`scripts/make_hf_fixtures.py --model=qwen3-toy-lora`; no jaxinfer needed).

Three random adapters on the Qwen3 toy (tests/fixtures/hf_qwen3_toy, written by
`--model=qwen3-toy`), saved as `peft` writes them (adapter_config.json +
adapter_model.safetensors) under tests/fixtures/lora_qwen3_toy/<name>/:

  a: rank 4 on q_proj and v_proj, lora_alpha 8 (scale alpha / r = 2)
  b: rank 8 on all seven projections, lora_alpha 16 with rsLoRA (scale alpha / sqrt(r))
  c: rank 2 on o_proj, gate_proj and down_proj of layer 1 only (`layers_to_transform`),
     lora_alpha 2 (scale 1)

Both factors of every adapter are random (peft's default B = 0 would make it a no-op), so each
changes the logits visibly. tests/fixtures/lora_qwen3_toy/reference.npz holds, per adapter and
prompt: the logits at every prompt position and 32 greedy tokens (with their top-1 minus top-2
margins), computed by peft's own model with that adapter active.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import transformers

PROMPTS = {"a": [5, 17, 200, 3, 99, 41, 7, 7, 150],
           "b": [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True),
    "c": dict(r=2, lora_alpha=2, target_modules=["o_proj", "gate_proj", "down_proj"],
              layers_to_transform=[1]),
}
NEW_TOKENS = 32
SEEDS = {"a": 104, "b": 101, "c": 102}  # seeds whose greedy runs have no near-tie (margin > 0.01)


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], new_tokens: int):
    """Greedy decode with the model's KV cache -> (ids, top1-top2 margins)."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    last = out.logits[0, -1].float()
    gen, margins = [], []
    for step in range(new_tokens):
        top = torch.topk(last, 2)
        gen.append(int(top.indices[0]))
        margins.append(round(float(top.values[0] - top.values[1]), 5))
        if step == new_tokens - 1:
            break
        out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
        last = out.logits[0, -1].float()
    return gen, margins


def qwen3_toy_lora(out_dir: str) -> None:
    import peft

    base_dir = os.path.join(out_dir, "hf_qwen3_toy")
    lora_dir = os.path.join(out_dir, "lora_qwen3_toy")
    ref = {}
    for name, kwargs in ADAPTERS.items():
        torch.manual_seed(SEEDS[name])
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config = peft.LoraConfig(lora_dropout=0.0, bias="none", init_lora_weights=False,
                                 **kwargs)
        model = peft.get_peft_model(base, config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(0.3 * torch.randn_like(p))
        path = os.path.join(lora_dir, name)
        model.save_pretrained(path)
        os.remove(os.path.join(path, "README.md"))  # peft's model card template
        with open(os.path.join(path, "adapter_config.json")) as f:
            saved = json.load(f)
        saved["base_model_name_or_path"] = "../hf_qwen3_toy"  # not this machine's path
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(saved, f, indent=2, sort_keys=True)
            f.write("\n")
        for prompt, ids in PROMPTS.items():
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
            gen, margins = greedy(model, ids, NEW_TOKENS)
            ref[f"{name}_{prompt}_logits"] = logits
            ref[f"{name}_{prompt}_greedy"] = np.array(gen, np.int32)
            ref[f"{name}_{prompt}_margins"] = np.array(margins, np.float32)
            print(f"{name} {prompt}: min margin {min(margins):.3f}, {gen[:8]}...",
                  file=sys.stderr)
    for prompt, ids in PROMPTS.items():
        ref[f"prompt_{prompt}"] = np.array(ids, np.int32)
    np.savez_compressed(os.path.join(lora_dir, "reference.npz"), **ref)
    with open(os.path.join(lora_dir, "versions.json"), "w") as f:
        json.dump({"peft": peft.__version__, "transformers": transformers.__version__,
                   "torch": torch.__version__}, f, indent=1)
        f.write("\n")
    print(f"wrote {lora_dir}", file=sys.stderr)
