"""Smoke test of scripts/train_draft_head.py on a one-layer model with SmolLM2's tokenizer:
generation, recording, a few training steps on a data:2 mesh of the fake CPU devices, the
exported head, the history and its loss plot; a second run reads the first one's answers
(--answers), a run with other generation flags refuses them, and one naming a layer the target
lacks (--init_layer) stops with a clear error; a run on prompt files of one's own, with drawn
answers besides the greedy ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from jaxinfer.checkpoint.eagle import load_draft_head
from jaxinfer.checkpoint.loading import load_model
from jaxinfer.config import RunConfig
from tests.helpers import tiny_smollm_dir

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "train_draft_head.py")


@pytest.mark.slow  # a script end to end in its own process (1.5 min of CPU)
def test_training_script_on_a_mesh_writes_head_history_and_plot(tmp_path):
    model_dir = tiny_smollm_dir(str(tmp_path / "model"))
    out = tmp_path / "head"
    answers = tmp_path / "answers.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)  # 8 fake devices

    def run(*extra):
        return subprocess.run(
            [sys.executable, SCRIPT, f"--model_path={model_dir}", f"--out={out}",
             "--mesh=data:2", "--num_prompts=4", "--num_held_out=2", "--seq_len=48",
             "--draft_vocab=256", "--steps=3", "--batch_size=2", "--eval_every=3",
             "--eval_depth=2", "--depth=2", f"--answers={answers}", *extra],
            capture_output=True, text=True, timeout=900, cwd=REPO_ROOT, env=env)

    proc = run("--max_new_tokens=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh: data=2 x model=1" in proc.stdout and "generated 4 + 2 answers" in proc.stdout
    first = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    again = run("--max_new_tokens=8")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"read 4 + 2 answers from {answers}" in again.stdout, again.stdout
    assert [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()
            ][-1]["acceptance"] == first[-1]["acceptance"]  # the same data, the same head
    bad = run("--max_new_tokens=8", "--init_layer=1")  # the tiny model has layer 0 only
    assert bad.returncode != 0 and "--init_layer='1': valid are 'last', 'random' and the " \
        "target's layers 0 to 0" in bad.stderr, bad.stderr[-3000:]
    other = run("--max_new_tokens=9")
    assert other.returncode != 0 and "'max_new_tokens': 8" in other.stderr and (
        "pass another file" in other.stderr), other.stderr[-3000:]
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2, 3] and "acceptance" in history[-1]
    root = ET.parse(out / "loss.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    model, _ = load_model(RunConfig(model_path=model_dir))
    head = load_draft_head(str(out), model.config)
    assert head.config.draft_vocab_size == 256

    # Prompts of one's own (a bad line is skipped and named), two answers per training prompt.
    prompts, held = tmp_path / "prompts.jsonl", tmp_path / "held.txt"
    prompts.write_text('{"prompt": "Name a color."}\n{"prompt": "Count to three."}\n'
                       '{"prompt": "Say hi.", "top_k": 5}\n{"prompt": "Name a fruit."}\n')
    held.write_text("Name an animal.\nName a city.\n")
    own = run("--max_new_tokens=8", f"--prompts_file={prompts}", f"--held_out_file={held}",
              "--samples_per_prompt=2", "--temperature=1.0",
              f"--answers={tmp_path / 'own.json'}")
    assert own.returncode == 0, own.stderr[-3000:]
    assert f"{prompts}: skipped 1 line(s); the first: {prompts}:3: sampling fields" in (
        own.stdout) and "generated 6 + 2 answers" in own.stdout, own.stdout
