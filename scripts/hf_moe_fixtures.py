"""Reference fixtures for the mixture-of-experts families from Hugging Face transformers (run in
the Hugging Face venv through `scripts/make_hf_fixtures.py --model=moe-toys`; no jaxinfer
needed).

For each family a small randomly initialised model, saved as an HF directory
tests/fixtures/hf_{name}_toy/ (weights stored in bf16 to keep it small; the reference runs the
same bf16-rounded values in f32), plus hf_{name}_toy_reference.npz: per prompt its ids, the
f32 logits at every prompt position, and GREEDY_TOKENS greedy tokens (the model's KV cache) with
the top-1 minus top-2 margin of each step.

* qwen3_moe: `Qwen3MoeForCausalLM`, 16 experts, top 4 renormalised (norm_topk_prob), layer 1
  dense (mlp_only_layers), QK-norm.
* qwen2_moe: `Qwen2MoeForCausalLM`, 8 experts, top 2 not renormalised, a gated shared expert,
  every second layer a mixture (decoder_sparse_step 2), q/k/v biases.
* mixtral: `MixtralForCausalLM`, 8 experts, top 2.
* gpt_oss: `GptOssForCausalLM`, 8 experts, top 4 (top-k then softmax, router bias), expert
  biases, the clamped SwiGLU (limit lowered to 2 so the clamp acts), attention sinks, q/k/v/o
  biases, YaRN RoPE (gpt-oss's own parameters), layers alternating an 8-token sliding window
  (prompts longer than it) and full attention.

Also tests/fixtures/hf_yarn_reference.json: transformers' YaRN frequencies (`yarn_reference`).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import transformers

GREEDY_TOKENS = 32
PROMPTS = {"a": [5, 17, 100, 3, 99, 41, 7, 7, 120, 64, 2, 33, 90],
           "b": [110, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]}
COMMON = dict(vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.2)


def _configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(
            hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
            num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
            rope_theta=1_000_000.0, **COMMON),
        "qwen2_moe": transformers.Qwen2MoeConfig(
            hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
            decoder_sparse_step=2, **COMMON),
        "mixtral": transformers.MixtralConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, **COMMON),
        "gpt_oss": transformers.GptOssConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4,
            sliding_window=8, swiglu_limit=2.0, **COMMON),
    }


@torch.inference_mode()
def _randomise(model) -> None:
    """Norms near 1 (every norm matters), sinks and biases of order 1, every value rounded to
    bf16 (the stored dtype)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
        elif name.endswith("sinks") or "bias" in name:
            p.copy_(0.5 * torch.randn_like(p))
        p.copy_(p.bfloat16().float())


@torch.inference_mode()
def _greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    gen, margins = [], []
    for step in range(GREEDY_TOKENS):
        top = torch.topk(out.logits[0, -1].float(), 2)
        gen.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        if step < GREEDY_TOKENS - 1:
            out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return gen, margins


def moe_toys(out_dir: str) -> None:
    for name, cfg in _configs().items():
        torch.manual_seed(0)
        cfg._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        _randomise(model)
        ref = {}
        for prompt, ids in PROMPTS.items():
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
            gen, margins = _greedy(model, ids)
            ref.update({prompt + "_prompt": np.array(ids, np.int32),
                        prompt + "_logits": logits.astype(np.float32),
                        prompt + "_greedy": np.array(gen, np.int32),
                        prompt + "_margins": np.array(margins, np.float32)})
            print(f"{name} {prompt}: min margin {min(margins):.4f} {gen[:8]}", file=sys.stderr)
        path = os.path.join(out_dir, f"hf_{name}_toy")
        model.to(torch.bfloat16).save_pretrained(path)
        np.savez_compressed(os.path.join(out_dir, f"hf_{name}_toy_reference.npz"), **ref)
        print(f"wrote {path} and hf_{name}_toy_reference.npz", file=sys.stderr)
    yarn_reference(out_dir)


# YaRN parameter sets (rope_parameters, head_dim): gpt-oss's own; the ramp rounded outward
# (truncate, Hugging Face's default); an attention factor from mscale / mscale_all_dim.
YARN_CASES = {
    "gpt_oss": ({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
                64),
    "truncate": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                  "original_max_position_embeddings": 2048}, 128),
    "mscale": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                "original_max_position_embeddings": 4096}, 64),
}


def yarn_reference(out_dir: str) -> None:
    """tests/fixtures/hf_yarn_reference.json: transformers' YaRN inverse frequencies and
    attention scaling (`_compute_yarn_parameters`) for `YARN_CASES`."""
    import json

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    out = {}
    for name, (params, head_dim) in YARN_CASES.items():
        cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                       head_dim=head_dim, max_position_embeddings=131072,
                                       rope_parameters=dict(params))
        inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        out[name] = {"rope_parameters": params, "head_dim": head_dim,
                     "inv_freq": inv_freq.tolist(), "attention_scaling": float(scale)}
    path = os.path.join(out_dir, "hf_yarn_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)
