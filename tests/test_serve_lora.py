"""LoRA adapters through the OpenAI server: `model` names an adapter (vLLM's convention),
`/v1/models` lists the base model and the adapters, `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` change them at run time behind the API key; an unknown adapter is a
404 for its request alone. Outputs equal the offline API's with the same adapter."""

from __future__ import annotations

import httpx
import openai
import pytest

from jaxinfer.checkpoint.loading import load_tokenizer
from jaxinfer.checkpoint.weights import load_checkpoint
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama
from tests.helpers import serving, tiny_smollm_dir, write_peft_adapter

PROMPTS = ["The capital of France is", "One, two, three,"]
MAX_TOKENS = 8
KEY = "sk-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = load_checkpoint(tiny_smollm_dir(str(tmp_path_factory.mktemp("tiny"))))
    model, tokenizer = Llama(ckpt.config, ckpt.params), load_tokenizer(ckpt)
    adapters = {name: write_peft_adapter(str(tmp_path_factory.mktemp(name)), ckpt.config,
                                         targets=targets, rank=rank, seed=seed, scale=1.0)
                for name, targets, rank, seed in (
                    ("x", ("q_proj", "v_proj", "down_proj"), 4, 1),
                    ("y", ("o_proj", "gate_proj", "up_proj"), 8, 2))}
    config = dict(cache=CacheConfig(max_seq_len=64),
                  engine=EngineConfig(max_slots=4, prefill_buckets=(16,), max_loras=1,
                                      max_lora_rank=8))
    offline = LLM(model, tokenizer, lora_modules=adapters, **config)
    greedy = SamplingConfig(max_new_tokens=MAX_TOKENS, ignore_eos=True)
    expected = {name: [c.text for c in offline.generate(PROMPTS, greedy, lora=name,
                                                        use_tqdm=False)]
                for name in (None, "x", "y")}
    assert len(set(map(tuple, expected.values()))) == 3  # the adapters change the outputs
    llm = LLM(model, tokenizer, lora_modules={"x": adapters["x"]}, **config)
    with serving(llm.engine, served_model_name="base", api_key=KEY) as (url, server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        yield client, url, expected, adapters


def _texts(client, model: str) -> list[str]:
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    return [c.text for c in out.choices]


def _post(url: str, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=60)


def test_model_names_the_adapter(served):
    client, _, expected, _ = served
    assert [m.id for m in client.models.list().data] == ["base", "x"]
    assert _texts(client, "x") == expected["x"]
    assert _texts(client, "base") == expected[None]
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert _texts(client, "x") == expected["x"]  # the 404 touched nothing


def test_load_and_unload_at_run_time(served):
    client, url, expected, adapters = served
    assert _post(url, "load_lora_adapter", {"lora_name": "y", "lora_path": adapters["y"]},
                 key=None).status_code == 401
    r = _post(url, "load_lora_adapter", {"lora_name": "y", "lora_path": adapters["y"]})
    assert r.status_code == 200, r.text
    assert [m.id for m in client.models.list().data] == ["base", "x", "y"]
    assert _texts(client, "y") == expected["y"]
    assert _texts(client, "x") == expected["x"]  # one pool slot: x pages back in
    bad = _post(url, "load_lora_adapter", {"lora_name": "z", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "LoRA adapter 'z'" in bad.json()["error"]["message"]
    taken = _post(url, "load_lora_adapter", {"lora_name": "y", "lora_path": adapters["y"]})
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]
    assert _post(url, "unload_lora_adapter", {"lora_name": "y"}).status_code == 200
    assert [m.id for m in client.models.list().data] == ["base", "x"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="y", prompt="hi", max_tokens=1)
    assert _post(url, "unload_lora_adapter", {"lora_name": "y"}).status_code == 404
    metrics = httpx.get(f"{url}/metrics").text
    assert 'jaxinfer_lora_requests_total{adapter="x"}' in metrics
    assert "jaxinfer_lora_loads_total" in metrics
