"""`jaxinfer-generate` end to end, in-process (its absl flags parsed as a user's command line), on
a tiny model directory.

The directory is a real Hugging Face layout written by `save_hf` (random tiny weights, the
embedded model's real tokenizer), so the run covers loading, tokenizing, chat templating,
generation, streaming, JSONL output, metrics and error handling in seconds.
"""

import json
import logging
import subprocess
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
    assert "TTFT" in err and "tok/s" in err
    assert "resolved config" not in err  # printed with -v=1 or --print_config


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


def test_jsonl_lines_fail_alone_naming_file_and_line(model_dir, cli, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": "Tell me a joke.", "max_new_tokens": 3}),
             json.dumps({"prompt": 42}), json.dumps({"prompt": None}), "{not json",
             json.dumps({"prompt": "x", "max_tokens": 3}), json.dumps([1, 2]),
             json.dumps({"prompt": [5, 6, 7], "temperature": "hot"}),
             json.dumps({"prompt": [5, 6, 7], "top_logprobs": 2, "n": 2})]
    prompts.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe\n")
    out = tmp_path / "out.jsonl"
    status, _, err = cli(f"--model_path={model_dir}", f"--prompts_file={prompts}",
                         f"--output_jsonl={out}", "--max_new_tokens=4", "--ignore_eos",
                         "--max_seq_len=64")
    assert status == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in records] == [
        (0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0), (7, 1), (8, 0)]
    assert len(records[0]["token_ids"]) == 3  # the record's max_new_tokens
    assert [len(r["top_logprobs"][0]) for r in records[7:9]] == [2, 2]
    assert [r["seed"] for r in records[7:9]] == [0, 1]
    errors = {r["index"]: r["error"] for r in records if r["error"]}
    assert sorted(errors) == [1, 2, 3, 4, 5, 6, 8]
    for index, error in errors.items():
        assert error.startswith(f"{prompts}:{index + 1}: "), error
    assert "got int 42" in errors[1] and "got NoneType None" in errors[2]
    assert "not valid JSON" in errors[3] and "unknown key max_tokens" in errors[4]
    assert "must be a JSON object" in errors[5]
    assert "temperature='hot' must be a number" in errors[6]
    assert "not UTF-8 text (byte 0xff at column 1)" in errors[8]


def test_a_text_file_is_text_even_where_a_line_looks_like_json(model_dir, cli, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('{"prompt": "not parsed"}\n{ a brace\n')
    status, out, err = cli(f"--model_path={model_dir}", f"--prompts_file={prompts}",
                           "--max_new_tokens=2", "--ignore_eos", "--max_seq_len=64")
    assert status == 0, err
    assert out.count("--- prompt") == 2 and "[error]" not in out


@pytest.mark.parametrize("args, message", [
    (["--output_jsonl={tmp}/missing/out.jsonl"], "out.jsonl: No such file or directory"),
    (["--output_jsonl={tmp}"], "Is a directory"),
    (["--prompts_file={tmp}"], "is a directory, not a file of prompts"),
    (["--prompts_file={tmp}/nope.txt"], "nope.txt: No such file or directory"),
    (["--config={tmp}/bad.yaml"], "bad.yaml, line 2: sampling.temperature='hot' must be"),
    (["--config={tmp}/broken.yaml"], "broken.yaml: not valid YAML"),
    (["--seed=-1"], "seed=-1 must be in [0, 2**31)"),
    (["--top_logprobs=100000"], "top_logprobs=100000 must be in [0, 20]"),
])
def test_bad_input_stops_before_the_model_loads(model_dir, cli, tmp_path, args, message):
    (tmp_path / "bad.yaml").write_text("sampling:\n  temperature: hot\n")
    (tmp_path / "broken.yaml").write_text("engine: {max_slots: 2\n")
    args = [a.format(tmp=tmp_path) for a in args]
    base = [] if any(a.startswith("--prompts_file") for a in args) else ["--prompt=hi"]
    status, _, err = cli(f"--model_path={model_dir}", *base, *args)
    assert status == 2 and message in err, err
    assert "loaded" not in err


def test_print_config_prints_the_resolved_config_and_exits(cli, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("sampling:\n  stop: foo\n")
    status, out, err = cli(f"--config={config}", "--temperature=0.5", "--print_config")
    assert status == 0, err
    resolved = json.loads(out)
    assert resolved["sampling"]["stop"] == ["foo"] and resolved["sampling"]["temperature"] == 0.5


def test_help_lists_the_main_flags_with_defaults():
    out = subprocess.run([sys.executable, "-m", "jaxinfer.cli.generate", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    assert "--max_new_tokens: Tokens to generate at most. Default: 128." in out
    assert "--temperature" in out and "--prompts_file" in out and "--mesh" in out


def test_a_streamed_prompt_prints_its_logprobs(model_dir, cli):
    status, out, err = cli(f"--model_path={model_dir}", "--prompt=Hi", "--max_new_tokens=3",
                           "--ignore_eos", "--max_seq_len=64", "--logprobs", "--top_logprobs=2")
    assert status == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert len(record["token_ids"]) == len(record["logprobs"]) == 3
    assert all(len(top) == 2 for top in record["top_logprobs"])


def test_structured_output_flags(model_dir, cli, tmp_path):
    """--choice, --regex and --json_schema=FILE constrain even a random model's output; a bad
    schema file stops the run before the model loads."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    base = (f"--model_path={model_dir}", "--prompt=Answer.", "--max_slots=4", "--max_seq_len=128",
            "--max_new_tokens=24")
    status, out, err = cli(*base, "--choice=yes,no way")
    assert status == 0 and out.strip() in ("yes", "no way"), (out, err)
    status, out, err = cli(*base, "--regex=[0-9]{3}")
    assert status == 0 and len(out.strip()) == 3 and out.strip().isdigit(), (out, err)
    status, out, err = cli(*base, f"--json_schema={path}")
    assert status == 0 and json.loads(out) in ({"ok": True}, {"ok": False}), (out, err)
    path.write_text("{not json")
    status, _, err = cli(*base, f"--json_schema={path}")
    assert status == 2 and "json_schema is not valid JSON" in err, err
    status, _, err = cli(*base, f"--json_schema={tmp_path / 'missing.json'}")
    assert status == 2 and "cannot read it" in err, err
