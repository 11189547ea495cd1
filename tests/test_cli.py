"""`jaxinfer-generate` end to end, as a user runs it (a subprocess), on a tiny model directory.

The directory is a real Hugging Face layout written by `save_hf` (random tiny weights, the
embedded model's real tokenizer), so the run covers loading, tokenizing, chat templating,
generation, streaming, JSONL output, metrics and error handling in seconds.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import tiny_smollm_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_smollm_dir(str(tmp_path_factory.mktemp("tiny-smollm")))


def _cli(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli.generate", "--compilation_cache_dir=",
                           *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_single_prompt_streams_to_stdout_and_reports_metrics(model_dir):
    r = _cli(f"--model_path={model_dir}", "--prompt=What is the capital of France?", "--chat",
             "--max_new_tokens=6", "--ignore_eos", "--max_slots=4", "--max_seq_len=128")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the streamed text
    assert "TTFT" in r.stderr and "tok/s" in r.stderr and "resolved config" in r.stderr


def test_prompts_file_to_jsonl_with_a_bad_prompt_failing_alone(model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me a joke.\n" + "word " * 200 + "\n"
                       + json.dumps({"prompt": "Name three colors."}) + "\n")
    out = tmp_path / "out.jsonl"
    r = _cli(f"--model_path={model_dir}", f"--prompts_file={prompts}", f"--output_jsonl={out}",
             "--max_new_tokens=5", "--ignore_eos", "--max_seq_len=64", "--temperature=0.8",
             "--seed=3", "--logprobs", "--top_logprobs=2")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["index"] for rec in records] == [0, 1, 2]
    good = [records[0], records[2]]
    for rec in good:
        assert rec["error"] is None and rec["finish_reason"] == "length"
        assert len(rec["token_ids"]) == 5 and len(rec["logprobs"]) == 5
        assert all(len(t) == 2 for t in rec["top_logprobs"])
        assert rec["metrics"]["ttft_s"] > 0
    assert records[1]["finish_reason"] == "error"
    assert "exceeds the context of 64 tokens" in records[1]["error"]
    assert "1 request(s) failed" in r.stderr


def test_bad_flag_values_fail_with_the_valid_choices(model_dir):
    r = _cli(f"--model_path={model_dir}", "--prompt=hi", "--dtype=float16")
    assert r.returncode != 0 and "float32" in r.stderr and "bfloat16" in r.stderr
    r = _cli(f"--model_path={model_dir}", "--prompt=hi", "--top_p=1.5")
    assert r.returncode != 0 and "top_p=1.5 must be in (0, 1]" in r.stderr
    r = _cli(f"--model_path={model_dir}", "--prompt=", "--max_new_tokens=2")
    assert r.returncode != 0 and "empty prompt" in r.stderr
