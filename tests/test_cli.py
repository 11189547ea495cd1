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
from absl import flags

from jaxinfer.cli import flags as jflags
from jaxinfer.cli import generate
from tests.helpers import tiny_smollm_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_smollm_dir(str(tmp_path_factory.mktemp("tiny-smollm")))


@pytest.fixture
def cli(capsys, caplog):
    """Runs `jaxinfer-generate ARGS` as `jflags.run_app` does: parse the flags with its flag
    parser (a parsing error exits), run `main`. Returns (status, stdout, stderr + log)."""

    def run(*args):
        caplog.set_level(logging.INFO)
        try:
            argv = jflags.flags_parser("jaxinfer-generate")(
                ["jaxinfer-generate", "--compilation_cache_dir=", *args])
            status = generate.main(argv)
        except SystemExit as e:
            status = e.code
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
    assert status == 1, err  # one prompt failed; every prompt has its record
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["index"] for rec in records] == [0, 1, 2]
    good = [records[0], records[2]]
    for rec in good:
        assert rec["error"] is None and rec["finish_reason"] == "length"
        assert len(rec["token_ids"]) == 5 and len(rec["logprobs"]) == 5
        assert all(len(t) == 2 for t in rec["top_logprobs"])
        assert rec["metrics"]["ttft_s"] > 0
    assert records[1]["finish_reason"] == "error"
    assert records[1]["error"].startswith(f"{prompts}:2: ")  # where, in the error itself
    assert "exceeds the context of 64 tokens" in records[1]["error"]
    assert f"1 request(s) failed: first error: {prompts}:2: " in err


@pytest.mark.parametrize("args, message", [
    (["--dtype=float16"], "--dtype=float16: must be one of float32, bfloat16"),
    (["--top_p=1.5"], "flags (--top_p): top_p=1.5 must be in (0, 1]"),
    (["--max_slots=two"], "--max_slots=two: must be an integer"),
    (["--temperature=hot"], "--temperature=hot: must be a number"),
    (["--kv_dtype=int3"], "--kv_dtype=int3: must be one of float32, bfloat16, int8"),
    (["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
    (["extra_argument"], "unexpected arguments: ['extra_argument']"),
    ([], "give exactly one of --prompt or --prompts_file"),
])
def test_bad_flag_values_fail_with_the_valid_choices(model_dir, cli, args, message):
    """Exit status 2 and one line naming the flag and what is valid, before the model loads."""
    base = [f"--model_path={model_dir}"] + (["--prompt=hi"] if args else [])
    status, out, err = cli(*base, *args)
    assert status == 2 and err.startswith(f"jaxinfer-generate: error: {message}\n"), err
    assert err.count("\njaxinfer") == 0 and "loaded" not in err, err  # one line, no model
    assert not out


@pytest.mark.parametrize("module, args, message", [
    ("generate", ["--prompt=hi", "--max_slots=two"], "--max_slots=two: must be an integer"),
    ("generate", ["--prompt=hi", "--kv_dtype=int3"],
     "--kv_dtype=int3: must be one of float32, bfloat16, int8"),
    ("serve", ["--port=eighty"], "--port=eighty: must be an integer"),
    ("plan", ["--num_chips=x"], "--num_chips=x: must be an integer"),
    ("tts", ["--strategy=vote"],
     "--strategy=vote: must be one of self_consistency, best_of_n, repeated_sampling"),
    ("tts", ["--num_problems=-2"], "--num_problems=-2 must be >= 1"),
    ("tts", ["--n=0"], "--n=0 must be >= 1"),
])
def test_every_cli_reports_a_bad_flag_in_one_line_with_exit_2(module, args, message):
    """The console scripts as a user runs them (`app.run` parses the flags)."""
    proc = subprocess.run([sys.executable, "-m", f"jaxinfer.cli.{module}", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"jaxinfer-{module}: error: {message}\n", proc.stderr


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
    assert status == 1, err
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
    assert "warning" not in err


def test_a_text_file_of_jsonl_records_runs_with_one_warning(model_dir, cli, tmp_path):
    prompts = tmp_path / "requests.txt"
    prompts.write_text('{"prompt": "Hi", "max_new_tokens": 2}\n\n{"prompt": "Bye"}\n')
    status, out, err = cli(f"--model_path={model_dir}", f"--prompts_file={prompts}",
                           "--max_new_tokens=2", "--ignore_eos", "--max_seq_len=64")
    assert status == 0, err
    assert out.count("--- prompt") == 2  # run as the text it is
    assert err.count("warning") == 1 and "--prompts_format=jsonl" in err, err


@pytest.mark.parametrize("case", ["prompt", "jsonl_too_long", "jsonl_not_json", "empty_prompt"])
def test_one_exit_rule_for_one_prompt_and_many(model_dir, cli, tmp_path, case):
    """A request that fails is a record with its error (naming where the prompt came from)
    and exit status 1, whether the run has one prompt or many; a flag error is exit 2."""
    too_long = "word " * 200
    path = tmp_path / "one.jsonl"
    out = tmp_path / "out.jsonl"
    args, where = {
        "prompt": ([f"--prompt={too_long}"], "--prompt"),
        "empty_prompt": (["--prompt="], "--prompt"),
        "jsonl_too_long": ([f"--prompts_file={path}", f"--output_jsonl={out}"], f"{path}:1"),
        "jsonl_not_json": ([f"--prompts_file={path}", f"--output_jsonl={out}"], f"{path}:1"),
    }[case]
    path.write_text(json.dumps({"prompt": too_long}) + "\n" if case == "jsonl_too_long"
                    else '{"prompt": "Hi",\n')
    status, stdout, err = cli(f"--model_path={model_dir}", *args, "--max_new_tokens=2",
                              "--max_seq_len=64")
    assert status == 1, err
    assert f"1 request(s) failed: first error: {where}: " in err, err
    if case.startswith("jsonl"):
        [record] = [json.loads(line) for line in out.read_text().splitlines()]
        assert record["finish_reason"] == "error" and record["error"].startswith(f"{where}: ")
    else:
        assert not stdout.strip()  # nothing streamed


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


def test_a_server_cli_exits_with_its_status_without_teardown(tmp_path):
    """`run_app(skip_teardown=True)` (jaxinfer-serve): main's status is the exit status and
    its buffered output is written, but the interpreter's teardown (atexit handlers, freeing
    modules and jax's executables: seconds) does not run."""
    code = """if True:
        import atexit, sys
        from jaxinfer.cli import flags as jflags
        atexit.register(lambda: print("teardown"))

        @jflags.reporting_errors("prog")
        def main(argv):
            print("done", end="")  # stdout is a pipe: block-buffered
            return 3

        sys.argv = ["prog"]
        jflags.run_app(main, skip_teardown=True)
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3 and proc.stdout == "done", (proc.stdout, proc.stderr)


def test_lora_modules_and_a_jsonl_records_adapter(model_dir, cli, tmp_path):
    """--lora_modules registers adapters, a JSONL record picks one by "lora" (--lora for the
    rest); a record naming an unknown adapter fails alone."""
    from jaxinfer.checkpoint.weights import load_checkpoint
    from tests.helpers import write_peft_adapter

    config = load_checkpoint(model_dir).config
    x = write_peft_adapter(str(tmp_path / "x"), config, rank=4, seed=1, scale=1.0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in (
        {"prompt": "Hello there"}, {"prompt": "Hello there", "lora": "x"},
        {"prompt": "Hello there", "lora": "nope"})) + "\n")
    out = tmp_path / "out.jsonl"
    status, _, err = cli(f"--model_path={model_dir}", f"--prompts_file={prompts}",
                         f"--output_jsonl={out}", "--max_new_tokens=6", "--ignore_eos",
                         "--max_seq_len=64", f"--lora_modules=x={x}")
    assert status == 1, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["error"] is None and records[1]["error"] is None
    assert records[0]["token_ids"] != records[1]["token_ids"]  # the adapter changed them
    assert "unknown LoRA adapter 'nope'; loaded: ['x']" in records[2]["error"]
    status, out_text, err = cli(f"--model_path={model_dir}", "--prompt=Hello there",
                                "--max_new_tokens=6", "--ignore_eos", "--max_seq_len=64",
                                f"--lora_modules=x={x}", "--lora=x")
    assert status == 0, err
    status, _, err = cli(f"--model_path={model_dir}", "--prompt=Hi", "--lora_modules=x")
    assert status != 0 and "lora_modules entry 'x' must be name=path" in err
