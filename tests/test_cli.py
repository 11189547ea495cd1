"""`jaxinfer-generate` end to end, in-process (its absl flags parsed as a user's command line), on
a tiny model directory.

The directory is a real Hugging Face layout written by `save_hf` (random tiny weights, the
embedded model's real tokenizer), so the run covers loading, tokenizing, chat templating,
generation, streaming, JSONL output, metrics and error handling in seconds.
"""

import json
import logging
import sys

import pytest
from absl import app, flags

from jaxinfer.cli import generate
from tests.helpers import tiny_smollm_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_smollm_dir(str(tmp_path_factory.mktemp("tiny-smollm")))


@pytest.fixture
def cli(capsys, caplog):
    """Runs `jaxinfer-generate ARGS` as `app.run` would: parse the flags, run `main`, map a
    usage or flag error to exit status 1 with its message on stderr. Returns
    (status, stdout, stderr + log)."""

    def run(*args):
        caplog.set_level(logging.INFO)
        try:
            argv = flags.FLAGS(["jaxinfer-generate", "--compilation_cache_dir=", *args])
            status = generate.main(argv)
        except (flags.Error, app.UsageError) as e:
            print(f"jaxinfer-generate: {e}", file=sys.stderr)
            status = 1
        finally:
            flags.FLAGS.unparse_flags()
        out, err = capsys.readouterr()
        return status, out, err + caplog.text

    return run


def test_single_prompt_streams_to_stdout_and_reports_metrics(model_dir, cli):
    status, out, err = cli(f"--model_path={model_dir}", "--prompt=What is the capital of France?",
                           "--chat", "--max_new_tokens=6", "--ignore_eos", "--max_slots=4",
                           "--max_seq_len=128")
    assert status == 0, err
    assert out.strip()  # the streamed text
    assert "TTFT" in err and "tok/s" in err and "resolved config" in err


def test_prompts_file_to_jsonl_with_a_bad_prompt_failing_alone(model_dir, cli, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me a joke.\n" + "word " * 200 + "\n"
                       + json.dumps({"prompt": "Name three colors."}) + "\n")
    out = tmp_path / "out.jsonl"
    status, _, err = cli(f"--model_path={model_dir}", f"--prompts_file={prompts}",
                         f"--output_jsonl={out}", "--max_new_tokens=5", "--ignore_eos",
                         "--max_seq_len=64", "--temperature=0.8", "--seed=3", "--logprobs",
                         "--top_logprobs=2")
    assert status == 0, err
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
    assert "1 request(s) failed" in err


@pytest.mark.parametrize("args, message", [
    (["--dtype=float16"], "float32"),  # an enum flag names its valid values
    (["--top_p=1.5"], "top_p=1.5 must be in (0, 1]"),
    (["--prompt=", "--max_new_tokens=2"], "empty prompt"),
    (["--max_slots=two"], "max_slots"),
    (["extra_argument"], "unexpected arguments"),
])
def test_bad_flag_values_fail_with_the_valid_choices(model_dir, cli, args, message):
    base = [f"--model_path={model_dir}"] + ([] if any(a.startswith("--prompt=") for a in args)
                                            else ["--prompt=hi"])
    status, _, err = cli(*base, *args)
    assert status != 0 and message in err, err
    if message == "float32":
        assert "bfloat16" in err
